#!/usr/bin/env python3
"""Peer of afdep's MoE layer in PyTorch: experts through ``torch._grouped_mm``.

The function is the one of docs/design.md, "Specification: Layer and train step", on the
inputs afdep wrote (``afdep moe --write-inputs DIR``):

- router: ``logits = x . Wr`` in f32, softmax in f32, top-k (``torch.topk``), weights
  renormalised over the k when the inputs say so;
- dispatch "sorted": the (token, slot) pairs sorted by expert (stable), x gathered into
  expert-sorted rows, per-expert row offsets: counts by ``scatter_add_`` into E bins and their
  ``cumsum``, all on the device (no ``bincount``, ``nonzero``, ``.item()`` or ``.cpu()``: the
  step queues no host synchronisation, see ``--check-syncs``);
- experts: ``torch._grouped_mm`` for W1 and W3, SwiGLU ``silu(a) * b``, ``torch._grouped_mm``
  for W2 (bf16 in and out, f32 accumulation inside the GEMMs);
- shared expert: dense bf16 matmuls;
- combine: each token's K expert rows gathered back to token order and summed with their
  weights by one batched GEMM (``baddbmm``, f32 accumulation) onto the shared expert's output.

The train step is the forward plus ``backward(dy)`` through autograd (gradients of x and of
every parameter). ``--impls eager,compile`` runs the same function eagerly (impl
``torch_grouped_mm``) and through ``torch.compile`` (impl ``torch_compile``; compiled in the
warm-ups), one row each, in one process.

Correctness: after the timed runs, one more train step's outputs (y, dx, every parameter
gradient) are compared with the oracle's function computed by this script independently, in
f32 (:func:`oracle_errors`: the same router, then expert by expert the f32 SwiGLU forward and
its hand-written backward, the shared expert by token chunks, the router's softmax and top-k
renormalisation backward; no autograd, no f32 copy of all the weights at once):
``oracle_out_err``, ``oracle_gx_err``, ``oracle_gw_err`` = ``max |peer - oracle| / max |oracle|``
per tensor (the weight gradients: the largest over the tensors), judged against afdep's
tolerances (moe_inputs.ORACLE_TOL; ``--no-oracle`` skips it).

``--check-syncs`` makes any host synchronisation inside the timed runs an error: on a GPU
through ``torch.cuda.set_sync_debug_mode("error")``, on the CPU by making the calls that
synchronise on a GPU (``Tensor.item``, ``.cpu``, ``.tolist``, ``.numpy``, ``nonzero``,
``bincount``, ``unique``, ``masked_select``, ``Tensor.__bool__``) raise; the row's status is
``error`` with the call in ``note`` (the test mode). ``--check-syncs count`` (the suite's)
counts them into the row's ``host_syncs`` instead (``set_sync_debug_mode("warn")``), so that a
sync costs the check, not the measurement. Each measurement is the median (element n // 2 of the sorted times, as afdep
reports it) of ``--iters`` runs, each between its own pair of CUDA events, created before the
runs and recorded back to back with no host sync in between, after ``--warmups`` runs. Then one
more train step gives the outputs that are compared with afdep's (``--afdep-outputs DIR``,
written by ``afdep moe --write-outputs DIR``): ``max |peer - afdep| / max |afdep|``.

One JSON row per token count on stdout (and appended to ``--json-out``), with afdep's fields;
``status`` is ``ok``, ``error_too_large`` (errors against the f32 oracle above afdep's
tolerances, or against afdep's outputs above twice them, see moe_inputs.PEER_TOL), ``oom``
(out of memory, caught: the sweep goes on) or ``error``.
Needs no network and no ``safetensors`` package. ``--device cpu`` runs on the CPU (for tests;
times by the wall clock).

    python3 moe_torch.py --inputs DIR [--tokens 16384,131072] [--afdep-outputs DIR]
                         [--iters 10] [--warmups 3] [--json-out FILE] [--device cuda]
                         [--impls eager,compile] [--check-syncs] [--no-oracle]
"""

import argparse
import contextlib
import math
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_inputs as mi  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IMPL = "torch_grouped_mm"
IMPLS = {"eager": IMPL, "compile": "torch_compile"}


def to_torch_bf16(bits, device):
    """numpy uint16 bf16 bits -> a bf16 tensor on ``device``."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    return t.to(device)


def moe(x, P, top_k, renormalize, aux=None):
    """The layer's output, T x H bf16. ``aux`` (a dict) receives the routes' expert ids.
    Queues no host synchronisation (the shapes of every tensor follow from x and P alone)."""
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
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if aux is not None and aux.get("inject_sync"):
        offs = offs + int(counts.sum().item()) * 0  # a host sync, for the test of --check-syncs
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

    def __init__(self, device, iters, warmups, check_syncs=None):
        self.cuda = device.type == "cuda"
        self.iters, self.warmups = iters, warmups
        self.check_syncs = check_syncs  # None, "error" or "count"
        self.syncs = 0  # host synchronisations counted in timed runs ("count")
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(iters)]

    def time(self, fn):
        for _ in range(self.warmups):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            with no_syncs(self.check_syncs, True, self):
                for a, b in self.events:
                    a.record()
                    fn()
                    b.record()
            torch.cuda.synchronize()
            return mi.median([a.elapsed_time(b) for a, b in self.events])
        ts = []
        with no_syncs(self.check_syncs, False, self):
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
        return mi.median(ts)


class HostSync(RuntimeError):
    """A host synchronisation inside a region that must have none."""


# calls that make the host wait for the GPU (the CPU stand-in of set_sync_debug_mode)
SYNCING = [(torch.Tensor, n) for n in ("item", "cpu", "tolist", "numpy", "nonzero", "bincount",
                                       "unique", "masked_select", "__bool__")] + \
          [(torch, n) for n in ("nonzero", "bincount", "unique", "masked_select")]


@contextlib.contextmanager
def no_syncs(mode, cuda, counter):
    """Inside, a host synchronisation raises HostSync (``mode`` "error") or is counted in
    ``counter.syncs`` (``mode`` "count"); ``mode`` None checks nothing."""
    if not mode:
        yield
        return
    if cuda:
        if mode == "error":
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
            return
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counter.syncs += sum("synchroniz" in str(w.message) for w in seen)
        return
    saved = [(owner, name, getattr(owner, name)) for owner, name in SYNCING]

    def refuse(what, f):
        def g(*a, **k):
            if mode == "error":
                raise HostSync(f"host synchronisation inside the timed region: {what}")
            counter.syncs += 1
            return f(*a, **k)
        return g

    try:
        for owner, name, f in saved:
            setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}", f))
        yield
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)


def is_oom(e):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_one(T, args, device, timer, impl="eager"):
    """One row: ``impl`` (eager or compile) at ``T`` tokens."""
    inp = mi.LayerInputs(mi.inputs_path(args.inputs, T))
    row = dict(inp.shape_fields(), impl=IMPLS[impl], dispatch="sorted", fwd_ms=None,
               train_ms=None, out_err=None, gx_err=None, gw_err=None, oracle_out_err=None,
               oracle_gx_err=None, oracle_gw_err=None, status="error", peak_gib=None,
               digest=None,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__, iters=args.iters, seed=inp.seed, err_vs=None,
               syncs_checked=args.check_syncs or None, host_syncs=None)
    state = {}
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        P = {n: to_torch_bf16(v, device).requires_grad_() for n, v in inp.params.items()}
        x = to_torch_bf16(inp.x, device).requires_grad_()
        state.update(P=P, x=x)
        k, rn = inp.top_k, inp.renormalize
        opts = {"inject_sync": True} if args.debug_inject_sync else None
        fn = moe if impl == "eager" else torch.compile(moe)
        timer.syncs = 0
        with torch.no_grad():
            row["fwd_ms"] = timer.time(lambda: fn(x, P, k, rn, opts))
        if not args.no_train:
            if inp.dy is None:
                raise ValueError(f"{inp.path} has no dy: the train step needs it")
            dy = to_torch_bf16(inp.dy, device)
            state["dy"] = dy
            params = list(P.values()) + [x]

            def train():
                for p in params:
                    p.grad = None
                fn(x, P, k, rn, opts).backward(dy)

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
        if args.check_syncs == "count":
            row["host_syncs"] = timer.syncs
        if not args.no_oracle:
            grads = None if args.no_train else {n: t.grad for n, t in P.items()}
            e = oracle_errors(x.detach(), {n: t.detach() for n, t in P.items()},
                              state.get("dy"), k, rn, y, None if args.no_train else x.grad,
                              grads)
            row.update(e)
            mi.judge_oracle(row)
        if args.afdep_outputs:
            compare(row, args.afdep_outputs, T, y, x, P, aux, device)
            mi.judge(row)
    except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
        mi.record_failure(row, e, is_oom(e))
    finally:
        state.clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


class MaxRel:
    """Running ``max |a - b|`` and ``max |b|`` of one tensor compared in pieces."""

    def __init__(self):
        self.diff, self.scale, self.bad = 0.0, 0.0, False

    def add(self, got, want):
        got, want = got.float(), want.float()
        if not bool(torch.isfinite(got).all()):
            self.bad = True
            return
        if got.numel():
            self.diff = max(self.diff, float((got - want).abs().max()))
            self.scale = max(self.scale, float(want.abs().max()))

    def value(self):
        if self.bad:
            return math.inf
        if self.diff == 0.0:
            return 0.0
        return math.inf if self.scale == 0.0 else self.diff / self.scale


def oracle_errors(x, P, dy, top_k, renormalize, y, dx, grads, chunk=1 << 15):
    """The peer's outputs against the Specification's function (docs/design.md) computed here
    in f32, independently of :func:`moe`: ``oracle_out_err``, and with ``dy`` the train step's ``oracle_gx_err`` and
    ``oracle_gw_err`` (max over the parameter gradients). Expert by expert (one expert's weights
    in f32 at a time) and the shared expert by token chunks, so that the largest shapes fit next
    to the peer's own tensors; the backward is written out (SwiGLU, the weighted sum, the top-k
    renormalisation and the softmax), not taken from autograd."""
    T, H = x.shape
    E = P["wr"].shape[1]
    f32 = torch.float32
    train = dy is not None
    xf = x.float()
    wr = P["wr"].float()
    probs = torch.softmax(xf @ wr, dim=-1)
    topv, topi = torch.topk(probs, top_k, dim=-1)
    ssum = topv.sum(dim=-1, keepdim=True)
    g = topv / ssum if renormalize else topv
    out = torch.zeros(T, H, dtype=f32, device=x.device)
    dyf = dy.float() if train else None
    dxf = torch.zeros(T, H, dtype=f32, device=x.device) if train else None
    dg = torch.zeros(T, top_k, dtype=f32, device=x.device) if train else None
    gw = {n: MaxRel() for n in P}
    flat = topi.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts.tolist()
    start = 0
    for e in range(E):
        n = counts[e]
        if n == 0:
            if train:
                for name in ("w1", "w3", "w2"):
                    gw[name].add(grads[name][e], torch.zeros_like(grads[name][e], dtype=f32))
            continue
        slots = order[start:start + n]
        start += n
        tok, kk = slots // top_k, slots % top_k
        xe = xf.index_select(0, tok)
        w1, w3, w2 = P["w1"][e].float(), P["w3"][e].float(), P["w2"][e].float()
        a, b = xe @ w1, xe @ w3
        sig = torch.sigmoid(a)
        sa = a * sig
        h = sa * b
        ye = h @ w2
        ge = g[tok, kk].unsqueeze(1)
        out.index_add_(0, tok, ge * ye)
        if train:
            dye = dyf.index_select(0, tok)
            dg[tok, kk] = (dye * ye).sum(dim=1)
            dyw = dye * ge
            dh = dyw @ w2.t()
            da = dh * b * (sig * (1 + a * (1 - sig)))
            db = dh * sa
            dxf.index_add_(0, tok, da @ w1.t() + db @ w3.t())
            gw["w1"].add(grads["w1"][e], xe.t() @ da)
            gw["w3"].add(grads["w3"][e], xe.t() @ db)
            gw["w2"].add(grads["w2"][e], h.t() @ dyw)
    if "s1" in P:
        s1, s3, s2 = P["s1"].float(), P["s3"].float(), P["s2"].float()
        ds1 = torch.zeros_like(s1) if train else None
        ds3 = torch.zeros_like(s3) if train else None
        ds2 = torch.zeros_like(s2) if train else None
        for i in range(0, T, chunk):
            xc = xf[i:i + chunk]
            a, b = xc @ s1, xc @ s3
            sig = torch.sigmoid(a)
            sa = a * sig
            h = sa * b
            out[i:i + chunk] += h @ s2
            if train:
                dyc = dyf[i:i + chunk]
                dh = dyc @ s2.t()
                da = dh * b * (sig * (1 + a * (1 - sig)))
                db = dh * sa
                dxf[i:i + chunk] += da @ s1.t() + db @ s3.t()
                ds1 += xc.t() @ da
                ds3 += xc.t() @ db
                ds2 += h.t() @ dyc
        if train:
            gw["s1"].add(grads["s1"], ds1)
            gw["s3"].add(grads["s3"], ds3)
            gw["s2"].add(grads["s2"], ds2)
    r = {"oracle_out_err": None, "oracle_gx_err": None, "oracle_gw_err": None}
    m = MaxRel()
    m.add(y, out)
    r["oracle_out_err"] = m.value()
    if train:
        # top-k weights: g_k = p_k / sum_j p_j (renormalised) -> dp_k = (dg_k - sum_j g_j dg_j) / S
        dtop = (dg - (g * dg).sum(dim=1, keepdim=True)) / ssum if renormalize else dg
        dp = torch.zeros_like(probs).scatter_(1, topi, dtop)
        dlogits = probs * (dp - (probs * dp).sum(dim=1, keepdim=True))
        dxf += dlogits @ wr.t()
        gw["wr"].add(grads["wr"], xf.t() @ dlogits)
        m = MaxRel()
        m.add(dx, dxf)
        r["oracle_gx_err"] = m.value()
        r["oracle_gw_err"] = max(v.value() for v in gw.values())
    return r


def compare(row, out_dir, T, y, x, P, aux, device):
    ref = mi.afdep_outputs(row, out_dir, T)
    if ref is None:
        return
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


def self_test():
    """:func:`oracle_errors`' hand-written f32 backward against autograd in f64 on a dense
    loop over (token, slot), at a small shape with and without renormalisation (``--self-test``;
    raises AssertionError on a mismatch)."""
    torch.manual_seed(0)
    T, H, W, E, K, S = 37, 16, 8, 6, 3, 12
    f64 = torch.float64
    for rn in (True, False):
        P = {"wr": (H, E), "w1": (E, H, W), "w3": (E, H, W), "w2": (E, W, H), "s1": (H, S),
             "s3": (H, S), "s2": (S, H)}
        P = {n: (torch.randn(*d, dtype=f64) * 0.3).requires_grad_() for n, d in P.items()}
        x = torch.randn(T, H, dtype=f64, requires_grad=True)
        dy = torch.randn(T, H, dtype=f64)
        p = torch.softmax(x @ P["wr"], dim=-1)
        tv, ti = torch.topk(p, K, dim=-1)
        g = tv / tv.sum(dim=-1, keepdim=True) if rn else tv
        rows = []
        for t in range(T):
            acc = (F.silu(x[t] @ P["s1"]) * (x[t] @ P["s3"])) @ P["s2"]
            for j in range(K):
                e = int(ti[t, j])
                acc = acc + g[t, j] * ((F.silu(x[t] @ P["w1"][e]) * (x[t] @ P["w3"][e])) @ P["w2"][e])
            rows.append(acc)
        y = torch.stack(rows)
        y.backward(dy)
        r = oracle_errors(x.detach().float(), {n: v.detach().float() for n, v in P.items()},
                          dy.float(), K, rn, y.detach().float(), x.grad.float(),
                          {n: v.grad.float() for n, v in P.items()})
        assert all(v < 1e-5 for v in r.values()), f"renormalize={rn}: {r}"
        print(f"self-test, renormalize={rn}: {r}")
    print("moe_torch.py self-test: the f32 oracle matches autograd")


def main(argv=None):
    # --inputs is checked after --self-test, which needs none
    ap = mi.peer_arg_parser(__doc__, inputs_required=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--impls", default="eager",
                    help="comma-separated: eager (torch_grouped_mm), compile (torch_compile)")
    ap.add_argument("--check-syncs", nargs="?", const="error", choices=["error", "count"],
                    help="host syncs in the timed runs: fail the row (error, the default) or "
                         "count them into host_syncs (count)")
    ap.add_argument("--no-oracle", action="store_true",
                    help="skip the comparison with the f32 oracle computed here")
    ap.add_argument("--debug-inject-sync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--self-test", action="store_true",
                    help="check the f32 oracle's backward against autograd, then exit")
    args = ap.parse_args(argv)
    if args.self_test:
        self_test()
        return
    if not args.inputs:
        ap.error("--inputs is required")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        ap.error(f"--impls: {bad or 'none'} (choose from {', '.join(IMPLS)})")
    if args.iters < 1 or args.warmups < 0:
        ap.error("--iters must be at least 1 and --warmups at least 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("moe_torch.py: no CUDA device is visible to PyTorch (use --device cpu)")
    tokens = args.tokens or mi.list_inputs(args.inputs)
    if not tokens:
        sys.exit(f"moe_torch.py: no moe-inputs-T.safetensors in {args.inputs}")
    timer = Timer(device, args.iters, args.warmups, args.check_syncs)
    for T in tokens:
        if not os.path.exists(mi.inputs_path(args.inputs, T)):
            sys.exit(f"moe_torch.py: no inputs for {T} tokens in {args.inputs}")
        for impl in impls:
            print(f"moe_torch.py: {T} tokens, {impl}", file=sys.stderr, flush=True)
            mi.emit(run_one(T, args, device, timer, impl), args.json_out)


if __name__ == "__main__":
    main()
