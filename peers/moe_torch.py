#!/usr/bin/env python3
"""Peer of afdep's MoE layer in PyTorch: experts through ``torch._grouped_mm``.

The function is the one of the design brief, section 4, on the inputs afdep wrote
(``afdep moe --write-inputs DIR``):

- router: ``logits = x . Wr`` in f32, softmax in f32, top-k (``torch.topk``), weights
  renormalised over the k when the inputs say so;
- dispatch "sorted": the (token, slot) pairs sorted by expert (stable), x gathered into
  expert-sorted rows, per-expert row offsets;
- experts: ``torch._grouped_mm`` for W1 and W3, SwiGLU ``silu(a) * b``, ``torch._grouped_mm``
  for W2 (bf16 in and out, f32 accumulation inside the GEMMs);
- shared expert: dense bf16 matmuls;
- combine: each token's K expert rows gathered back to token order and summed with their
  weights by one batched GEMM (``baddbmm``, f32 accumulation) onto the shared expert's output.

The train step is the forward plus ``backward(dy)`` through autograd (gradients of x and of
every parameter). Each measurement is the median (element n // 2 of the sorted times, as afdep
reports it) of ``--iters`` runs, each between its own pair of CUDA events, created before the
runs and recorded back to back with no host sync in between, after ``--warmups`` runs. Then one
more train step gives the outputs that are compared with afdep's (``--afdep-outputs DIR``,
written by ``afdep moe --write-outputs DIR``): ``max |peer - afdep| / max |afdep|``.

One JSON row per token count on stdout (and appended to ``--json-out``), with afdep's fields;
``status`` is ``ok``, ``error_too_large`` (errors against afdep's outputs above twice afdep's
tolerances, see moe_inputs.PEER_TOL), ``oom`` (out of memory, caught: the sweep goes on) or
``error``.
Needs no network and no ``safetensors`` package. ``--device cpu`` runs on the CPU (for tests;
times by the wall clock).

    python3 moe_torch.py --inputs DIR [--tokens 16384,131072] [--afdep-outputs DIR]
                         [--iters 10] [--warmups 3] [--json-out FILE] [--device cuda]
"""

import argparse
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_inputs as mi  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IMPL = "torch_grouped_mm"


def to_torch_bf16(bits, device):
    """numpy uint16 bf16 bits -> a bf16 tensor on ``device``."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    return t.to(device)


def moe(x, P, top_k, renormalize, aux=None):
    """The layer's output, T x H bf16. ``aux`` (a dict) receives the routes' expert ids."""
    T, H = x.shape
    E = P["wr"].shape[1]
    logits = x.float() @ P["wr"].float()
    probs = torch.softmax(logits, dim=-1)
    topv, topi = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topv = topv / topv.sum(dim=-1, keepdim=True)
    if aux is not None:
        aux["topk_idx"] = topi.detach()
    flat = topi.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    tok = order // top_k
    xs = x.index_select(0, tok)
    a = torch._grouped_mm(xs, P["w1"], offs=offs)
    b = torch._grouped_mm(xs, P["w3"], offs=offs)
    ys = torch._grouped_mm(F.silu(a) * b, P["w2"], offs=offs)
    # back to token order: slot s = (token, k) holds the row at inv[s]
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    y_tok = ys.index_select(0, inv).view(T, top_k, H)
    w = topv.to(x.dtype).view(T, 1, top_k)
    if "s1" in P:
        shared = (F.silu(x @ P["s1"]) * (x @ P["s3"])) @ P["s2"]
        out = torch.baddbmm(shared.view(T, 1, H), w, y_tok)
    else:
        out = torch.bmm(w, y_tok)
    return out.view(T, H)


def max_rel_err(a, b, chunk=1 << 16):
    """max |a - b| / max |b| over whole tensors, in f32 by row chunks; inf if a is not finite."""
    a = a.reshape(a.shape[0], -1) if a.dim() > 1 else a.reshape(-1, 1)
    b = b.reshape(a.shape)
    diff, scale = 0.0, 0.0
    for i in range(0, a.shape[0], chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        if not bool(torch.isfinite(x).all()):
            return math.inf
        diff = max(diff, float((x - y).abs().max()))
        scale = max(scale, float(y.abs().max()))
    if diff == 0.0:
        return 0.0
    return math.inf if scale == 0.0 else diff / scale


class Timer:
    """Median ms of ``iters`` runs after ``warmups``: CUDA events on a GPU, else wall clock."""

    def __init__(self, device, iters, warmups):
        self.cuda = device.type == "cuda"
        self.iters, self.warmups = iters, warmups
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(iters)]

    def time(self, fn):
        for _ in range(self.warmups):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            for a, b in self.events:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            return mi.median([a.elapsed_time(b) for a, b in self.events])
        ts = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return mi.median(ts)


def is_oom(e):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_one(T, args, device, timer):
    inp = mi.LayerInputs(mi.inputs_path(args.inputs, T))
    row = dict(inp.shape_fields(), impl=IMPL, dispatch="sorted", fwd_ms=None, train_ms=None,
               out_err=None, gx_err=None, gw_err=None, status="error", peak_gib=None, digest=None,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__, iters=args.iters, seed=inp.seed, err_vs=None)
    state = {}
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        P = {n: to_torch_bf16(v, device).requires_grad_() for n, v in inp.params.items()}
        x = to_torch_bf16(inp.x, device).requires_grad_()
        state.update(P=P, x=x)
        k, rn = inp.top_k, inp.renormalize
        with torch.no_grad():
            row["fwd_ms"] = timer.time(lambda: moe(x, P, k, rn))
        if not args.no_train:
            if inp.dy is None:
                raise ValueError(f"{inp.path} has no dy: the train step needs it")
            dy = to_torch_bf16(inp.dy, device)
            state["dy"] = dy
            params = list(P.values()) + [x]

            def train():
                for p in params:
                    p.grad = None
                moe(x, P, k, rn).backward(dy)

            row["train_ms"] = timer.time(train)
        # one more step for the outputs (the train step's, or the forward's)
        aux = {}
        for p in list(P.values()) + [x]:
            p.grad = None
        if args.no_train:
            with torch.no_grad():
                y = moe(x, P, k, rn, aux)
        else:
            y = moe(x, P, k, rn, aux)
            y.backward(state["dy"])
            y = y.detach()
        if device.type == "cuda":
            torch.cuda.synchronize()
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["status"] = "ok"
        if args.afdep_outputs:
            compare(row, args.afdep_outputs, T, y, x, P, aux, device)
            mi.judge(row)
    except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
        row["status"] = "oom" if is_oom(e) else "error"
        row["note"] = f"{type(e).__name__}: {str(e)[:400]}"
        if row["status"] == "error":
            traceback.print_exc(file=sys.stderr)
    finally:
        state.clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def compare(row, out_dir, T, y, x, P, aux, device):
    path = mi.outputs_path(out_dir, T)
    if not os.path.exists(path):
        row["note"] = f"no afdep outputs at {path}: errors not computed"
        return
    ref = mi.LayerOutputs(path)
    row["err_vs"] = ref.label()
    row["out_err"] = max_rel_err(y, to_torch_bf16(ref.y, device))
    if x.grad is not None and ref.dx is not None:
        row["gx_err"] = max_rel_err(x.grad, to_torch_bf16(ref.dx, device))
        errs = [max_rel_err(P[n].grad, to_torch_bf16(v, device))
                for n, v in ref.dparams.items() if n in P and P[n].grad is not None]
        row["gw_err"] = max(errs) if errs else None
    if ref.topk_idx is not None and "topk_idx" in aux:
        mine = torch.sort(aux["topk_idx"], dim=-1).values
        theirs = torch.sort(torch.from_numpy(ref.topk_idx.astype(np.int64)).to(device), dim=-1).values
        row["route_mismatch_tokens"] = int((mine != theirs).any(dim=-1).sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", required=True, help="directory of moe-inputs-T.safetensors")
    ap.add_argument("--tokens", type=mi.parse_tokens, help="token counts (default: every file)")
    ap.add_argument("--afdep-outputs", help="directory of afdep's moe-outputs-T.safetensors")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--no-train", action="store_true", help="forward only")
    ap.add_argument("--json-out", help="append rows to this JSONL file")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmups < 0:
        ap.error("--iters must be at least 1 and --warmups at least 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("moe_torch.py: no CUDA device is visible to PyTorch (use --device cpu)")
    tokens = args.tokens or mi.list_inputs(args.inputs)
    if not tokens:
        sys.exit(f"moe_torch.py: no moe-inputs-T.safetensors in {args.inputs}")
    timer = Timer(device, args.iters, args.warmups)
    for T in tokens:
        if not os.path.exists(mi.inputs_path(args.inputs, T)):
            sys.exit(f"moe_torch.py: no inputs for {T} tokens in {args.inputs}")
        print(f"moe_torch.py: {T} tokens", file=sys.stderr, flush=True)
        mi.emit(run_one(T, args, device, timer), args.json_out)


if __name__ == "__main__":
    main()
