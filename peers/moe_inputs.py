"""Shared helpers of the MoE peer scripts: a small safetensors reader, the row format.

The files are the ones `afdep moe --write-inputs DIR` and `--write-outputs DIR` write:
``DIR/moe-inputs-T.safetensors`` (x, dy, wr, w1, w3, w2, s1, s3, s2 as bf16; metadata
top_k, renormalize, seed, tokens) and ``DIR/moe-outputs-T.safetensors`` (y, dx, dwr, dw1,
dw3, dw2, ds1, ds3, ds2 as bf16, topk_idx as i32; metadata impl, dispatch).

safetensors: an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
data_offsets [begin, end) relative to the end of the header; plus "__metadata__"), then the
raw little-endian bytes. bf16 is read as uint16 and converted by the caller (or with
:func:`bf16_to_f32`). Needs only the standard library for the header and numpy for the data
(the GPU machine's Python may lack the ``safetensors`` package).

Run as a script, it describes a file without numpy (used by afdep's CLI tests)::

    python3 moe_inputs.py describe FILE   # JSON: metadata, and per tensor dtype, shape, first values
"""

import argparse
import json
import math
import os
import re
import struct
import sys
import traceback

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F64": 8, "U8": 1, "I8": 1,
               "U16": 2, "I16": 2, "U32": 4, "U64": 8, "BOOL": 1}
PARAM_NAMES = ["wr", "w1", "w3", "w2", "s1", "s3", "s2"]
# the fields of a row, as afdep prints them
ROW_FIELDS = ["d_model", "width", "experts", "top_k", "shared", "tokens", "impl", "dispatch",
              "fwd_ms", "train_ms", "out_err", "gx_err", "gw_err", "status", "peak_gib",
              "digest"]


class FormatError(ValueError):
    """A file that is not the safetensors layout this reader expects."""


def inputs_path(d, tokens):
    return os.path.join(d, f"moe-inputs-{tokens}.safetensors")


def outputs_path(d, tokens):
    return os.path.join(d, f"moe-outputs-{tokens}.safetensors")


def list_inputs(d):
    """Token counts of the input files in directory ``d``, ascending."""
    out = []
    for name in os.listdir(d):
        m = re.fullmatch(r"moe-inputs-(\d+)\.safetensors", name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


class SafeTensors:
    """The header of a safetensors file; tensors are read on demand."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise FormatError(f"{path}: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise FormatError(f"{path}: header length {n} exceeds the file ({size} bytes)")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise FormatError(f"{path}: the header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise FormatError(f"{path}: the header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors = {}
        for name, t in header.items():
            try:
                dtype, shape, (b, e) = t["dtype"], list(t["shape"]), t["data_offsets"]
            except (KeyError, TypeError, ValueError) as ex:
                raise FormatError(f"{path}: tensor {name!r} has a malformed entry {t!r}") from ex
            count = math.prod(shape)
            if dtype not in DTYPE_BYTES or e - b != count * DTYPE_BYTES[dtype] or b < 0 \
                    or self.data_start + e > size:
                raise FormatError(f"{path}: tensor {name!r} ({dtype}, {shape}, bytes {b}..{e}) "
                                  "does not fit its shape or the file")
            self.tensors[name] = (dtype, shape, b, e)

    def has(self, name):
        return name in self.tensors

    def shape(self, name):
        return self.tensors[name][1]

    def raw(self, name, want_dtype):
        """The tensor as a numpy array of the storage type (bf16 -> uint16), shaped."""
        import numpy as np

        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype, shape, b, e = self.tensors[name]
        if dtype != want_dtype:
            raise FormatError(f"{self.path}: tensor {name!r} is {dtype}, expected {want_dtype}")
        np_type = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32}[dtype]
        count = math.prod(shape)
        a = np.fromfile(self.path, dtype=np.dtype(np_type).newbyteorder("<"), count=count,
                        offset=self.data_start + b)
        return a.reshape(shape)

    def bf16_bits(self, name):
        return self.raw(name, "BF16")

    def first_values(self, name, n=4):
        """The first ``n`` values as Python floats/ints, with the standard library only."""
        dtype, _, b, e = self.tensors[name]
        size = DTYPE_BYTES[dtype]
        n = min(n, (e - b) // size)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + b)
            raw = f.read(n * size)
        if dtype == "BF16":
            return [bf16_bits_to_float(v) for v in struct.unpack(f"<{n}H", raw)]
        if dtype == "F32":
            return list(struct.unpack(f"<{n}f", raw))
        if dtype == "I32":
            return list(struct.unpack(f"<{n}i", raw))
        return None


def bf16_bits_to_float(bits):
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def bf16_to_f32(u16):
    """numpy uint16 (bf16 bits) -> float32."""
    import numpy as np

    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(a):
    """numpy float32 -> uint16 bf16 bits, round to nearest even (NaN kept NaN)."""
    import numpy as np

    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), rounded)


def write_safetensors(path, tensors, metadata=None):
    """Writes ``{name: (dtype, shape, bytes)}`` (for tests)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class LayerInputs:
    """The inputs of one token count, as numpy arrays of bf16 bits (uint16)."""

    def __init__(self, path):
        st = SafeTensors(path)
        self.path = path
        self.x = st.bf16_bits("x")
        if self.x.ndim != 2:
            raise FormatError(f"{path}: x must be T x H, is {list(self.x.shape)}")
        self.tokens, self.d_model = self.x.shape
        self.dy = st.bf16_bits("dy") if st.has("dy") else None
        self.params = {n: st.bf16_bits(n) for n in PARAM_NAMES if st.has(n)}
        for n in ("wr", "w1", "w3", "w2"):
            if n not in self.params:
                raise FormatError(f"{path}: tensor {n!r} is missing")
        self.experts = self.params["wr"].shape[1]
        self.width = self.params["w1"].shape[2]
        s1 = self.params.get("s1")
        self.shared = 0 if s1 is None else s1.shape[1]
        if self.shared == 0:
            for n in ("s1", "s3", "s2"):
                self.params.pop(n, None)
        meta = st.metadata
        self.top_k = int(meta.get("top_k", 8))
        self.renormalize = meta.get("renormalize", "true").lower() == "true"
        seed = meta.get("seed")
        self.seed = int(seed) if seed is not None and seed.isdigit() else None
        # the named shape (afdep moe --suite / --shape), carried into the peers' rows
        self.shape_name = meta.get("shape")

    def shape_fields(self):
        f = dict(d_model=self.d_model, width=self.width, experts=self.experts,
                 top_k=self.top_k, shared=self.shared, tokens=self.tokens)
        if self.shape_name:
            f["shape"] = self.shape_name
        return f


class LayerOutputs:
    """afdep's outputs of one token count (bf16 bits), for the peers' error columns."""

    def __init__(self, path):
        st = SafeTensors(path)
        self.path = path
        self.meta = st.metadata
        self.y = st.bf16_bits("y")
        self.dx = st.bf16_bits("dx") if st.has("dx") else None
        self.dparams = {n: st.bf16_bits("d" + n) for n in PARAM_NAMES if st.has("d" + n)}
        self.topk_idx = st.raw("topk_idx", "I32") if st.has("topk_idx") else None

    def label(self):
        return f"{self.meta.get('impl', 'afdep')}/{self.meta.get('dispatch', '?')}"


# The tolerances of afdep_moe::accuracy (OUT_TOL, DX_TOL, GRAD_TOL), doubled: a peer is compared
# with afdep's outputs, and neither side is the reference, so each may be off by its own bound.
PEER_TOL = {"out_err": 2 * 4 / 256, "gx_err": 2 * 6 / 256, "gw_err": 2 * 5 / 256}


# afdep_moe::accuracy's tolerances (OUT_TOL, DX_TOL, GRAD_TOL): a peer against the f32 function
# of docs/design.md ("Specification"), which is the reference (the peer scripts compute it
# themselves: oracle_* fields).
ORACLE_TOL = {"oracle_out_err": 4 / 256, "oracle_gx_err": 6 / 256, "oracle_gw_err": 5 / 256}


def _judge(row, tols, against):
    """Sets ``status`` to ``error_too_large`` (with a note naming ``against``) when a measured
    error of an ``ok`` row exceeds its tolerance in ``tols`` or is not finite; errors not
    measured are left alone, and so are rows that are not ``ok``."""
    if row.get("status") != "ok":
        return row
    bad = []
    for k, tol in tols.items():
        v = row.get(k)
        if v is None:
            continue
        if not math.isfinite(v) or v > tol:
            bad.append(f"{k} {v:.3e} > {tol:.3e}")
    if bad:
        row["status"] = "error_too_large"
        row["note"] = f"against {against}: " + ", ".join(bad)
    return row


def judge_oracle(row):
    """Judges an ``ok`` row's errors against the f32 oracle by ORACLE_TOL (see ``_judge``)."""
    return _judge(row, ORACLE_TOL, "the f32 oracle")


def judge(row):
    """Judges an ``ok`` row's errors against afdep's outputs by PEER_TOL (see ``_judge``)."""
    return _judge(row, PEER_TOL, "afdep's outputs")


def finite_or_none(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def median(v):
    """The upper median (element n // 2 of the sorted values), as afdep reports it."""
    s = sorted(v)
    return s[len(s) // 2]


def emit(row, out=None):
    """Prints a row as one JSON line (non-finite numbers as null) and appends it to ``out``."""
    clean = {k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}
    line = json.dumps(clean, allow_nan=False)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def parse_tokens(s):
    """``16384,128k,1M`` -> [16384, 131072, 1048576]."""
    out = []
    for p in s.split(","):
        p = p.strip()
        mul = {"k": 1024, "K": 1024, "m": 1 << 20, "M": 1 << 20}.get(p[-1:], 1)
        out.append(int(p[:-1] if mul > 1 else p) * mul)
    return out


def peer_arg_parser(doc, inputs_required):
    """The command line every MoE peer script shares (inputs, token counts, afdep's outputs,
    iterations, warm-ups, forward only, JSONL output); the caller adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--inputs", required=inputs_required,
                    help="directory of moe-inputs-T.safetensors")
    ap.add_argument("--tokens", type=parse_tokens, help="token counts (default: every file)")
    ap.add_argument("--afdep-outputs", help="directory of afdep's moe-outputs-T.safetensors")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--no-train", action="store_true", help="forward only")
    ap.add_argument("--json-out", help="append rows to this JSONL file")
    return ap


def afdep_outputs(row, out_dir, tokens):
    """afdep's outputs for ``tokens`` in ``out_dir`` (a :class:`LayerOutputs`), named in
    ``row["err_vs"]``; None, with a note in ``row``, where there are none."""
    path = outputs_path(out_dir, tokens)
    if not os.path.exists(path):
        row["note"] = f"no afdep outputs at {path}: errors not computed"
        return None
    ref = LayerOutputs(path)
    row["err_vs"] = ref.label()
    return ref


def record_failure(row, e, oom):
    """Marks ``row`` as failed by the exception ``e`` being handled: status ``oom`` (``oom``
    true) or ``error`` (its traceback printed to stderr), and the exception as the note."""
    row["status"] = "oom" if oom else "error"
    row["note"] = f"{type(e).__name__}: {str(e)[:400]}"
    if row["status"] == "error":
        traceback.print_exc(file=sys.stderr)


def describe(path):
    st = SafeTensors(path)
    return {
        "metadata": st.metadata,
        "tensors": {n: {"dtype": d, "shape": s, "first": st.first_values(n)}
                    for n, (d, s, _, _) in sorted(st.tensors.items())},
    }


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "describe":
        sys.exit("usage: moe_inputs.py describe FILE")
    try:
        print(json.dumps(describe(sys.argv[2])))
    except (OSError, FormatError) as e:
        sys.exit(f"moe_inputs.py: {e}")
