#!/usr/bin/env python3
"""Peer of afdep's MoE layer in JAX: experts through ``jax.lax.ragged_dot``.

The same function as ``moe_torch.py`` (docs/design.md, "Specification: Layer and train
step"), on the inputs afdep wrote (``afdep moe --write-inputs DIR``):

- router: ``logits = x . Wr`` in f32 (precision HIGHEST: no TF32), softmax, ``lax.top_k``,
  weights renormalised over the k when the inputs say so;
- dispatch "sorted": (token, slot) pairs sorted by expert (stable), x gathered into
  expert-sorted rows, per-expert group sizes;
- experts: ``lax.ragged_dot`` for W1 and W3, SwiGLU, ``lax.ragged_dot`` for W2 (bf16);
- shared expert: dense bf16 dots;
- combine: each token's K rows gathered back to token order and summed with their weights in
  f32 (``einsum`` with ``preferred_element_type=float32``), plus the shared expert, one cast.

Forward: ``jax.jit(moe)``; train step: ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))``
with ``loss = sum(moe(P, x) * dy)`` in f32 (gradients of every parameter and of x). Each
measurement is the median (element n // 2 of the sorted times, as afdep reports it) of
``--iters`` runs timed by the wall clock around the call and ``jax.block_until_ready``, after
``--warmups`` runs (the first compiles). One more train step gives the outputs compared with
afdep's (``--afdep-outputs DIR``): ``max |peer - afdep| / max |afdep|``.

``peak_gib`` is the device's ``peak_bytes_in_use`` since the process started (JAX cannot reset
it): run one token count per process for a per-configuration peak, as
``run_moe_comparison.sh`` does. ``status`` is ``ok``, ``error_too_large`` (errors against afdep's
outputs above twice afdep's tolerances, see moe_inputs.PEER_TOL), ``oom`` (RESOURCE_EXHAUSTED,
caught) or ``error``. Needs no network and no ``safetensors`` package.

    python3 moe_jax.py --inputs DIR [--tokens 16384] [--afdep-outputs DIR] [--iters 10]
                       [--warmups 3] [--json-out FILE] [--platform gpu|cpu]
"""

import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_inputs as mi  # noqa: E402

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

IMPL = "jax_ragged_dot"
BF16 = jnp.bfloat16
F32 = jnp.float32


def to_jax_bf16(bits, device):
    """numpy uint16 bf16 bits -> a bf16 array on ``device``."""
    u = jax.device_put(np.ascontiguousarray(bits), device)
    return jax.lax.bitcast_convert_type(u, BF16)


def to_bits(a):
    """A bf16 jax array -> numpy uint16 bits on the host."""
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def moe(P, x, top_k, renormalize, with_routes=False):
    T, H = x.shape
    E = P["wr"].shape[1]
    logits = jnp.dot(x.astype(F32), P["wr"].astype(F32), precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    topv, topi = jax.lax.top_k(probs, top_k)
    if renormalize:
        topv = topv / topv.sum(axis=-1, keepdims=True)
    flat = topi.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    tok = order // top_k
    xs = x[tok]
    a = jax.lax.ragged_dot(xs, P["w1"], sizes)
    b = jax.lax.ragged_dot(xs, P["w3"], sizes)
    ys = jax.lax.ragged_dot(jax.nn.silu(a) * b, P["w2"], sizes)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    y_tok = ys[inv].reshape(T, top_k, H)
    out = jnp.einsum("tk,tkh->th", topv.astype(BF16), y_tok, preferred_element_type=F32)
    if "s1" in P:
        shared = jnp.dot(jax.nn.silu(jnp.dot(x, P["s1"])) * jnp.dot(x, P["s3"]), P["s2"])
        out = out + shared.astype(F32)
    out = out.astype(BF16)
    return (out, topi) if with_routes else out


def loss(P, x, dy, top_k, renormalize):
    return jnp.sum(moe(P, x, top_k, renormalize).astype(F32) * dy.astype(F32))


def max_rel_err(a_bits, b_bits, chunk=1 << 16):
    """max |a - b| / max |b| of two bf16 tensors given as uint16 bits; inf if a is not finite."""
    a = a_bits.reshape(a_bits.shape[0], -1) if a_bits.ndim > 1 else a_bits.reshape(-1, 1)
    b = b_bits.reshape(a.shape)
    diff, scale = 0.0, 0.0
    for i in range(0, a.shape[0], chunk):
        x, y = mi.bf16_to_f32(a[i:i + chunk]), mi.bf16_to_f32(b[i:i + chunk])
        if not np.isfinite(x).all():
            return math.inf
        diff = max(diff, float(np.abs(x - y).max(initial=0.0)))
        scale = max(scale, float(np.abs(y).max(initial=0.0)))
    if diff == 0.0:
        return 0.0
    return math.inf if scale == 0.0 else diff / scale


def bench(fn, iters, warmups):
    for _ in range(warmups):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return mi.median(ts)


def is_oom(e):
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower()


def peak_gib(device):
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has memory stats
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**30


def run_one(T, args, device):
    inp = mi.LayerInputs(mi.inputs_path(args.inputs, T))
    row = dict(inp.shape_fields(), impl=IMPL, dispatch="sorted", fwd_ms=None, train_ms=None,
               out_err=None, gx_err=None, gw_err=None, status="error", peak_gib=None, digest=None,
               device=getattr(device, "device_kind", str(device)), jax=jax.__version__,
               iters=args.iters, seed=inp.seed, err_vs=None)
    try:
        P = {n: to_jax_bf16(v, device) for n, v in inp.params.items()}
        x = to_jax_bf16(inp.x, device)
        k, rn = inp.top_k, inp.renormalize
        fwd = jax.jit(functools.partial(moe, top_k=k, renormalize=rn))
        row["fwd_ms"] = bench(lambda: fwd(P, x), args.iters, args.warmups)
        if args.no_train:
            y, topi = jax.jit(functools.partial(moe, top_k=k, renormalize=rn, with_routes=True))(P, x)
            grads = None
        else:
            if inp.dy is None:
                raise ValueError(f"{inp.path} has no dy: the train step needs it")
            dy = to_jax_bf16(inp.dy, device)
            step = jax.jit(jax.value_and_grad(functools.partial(loss, top_k=k, renormalize=rn),
                                              argnums=(0, 1)))
            row["train_ms"] = bench(lambda: step(P, x, dy), args.iters, args.warmups)
            # one more step for the outputs: the gradients, and the forward for y and routes
            _, grads = step(P, x, dy)
            y, topi = jax.jit(functools.partial(moe, top_k=k, renormalize=rn, with_routes=True))(P, x)
        jax.block_until_ready((y, grads))
        row["peak_gib"] = peak_gib(device)
        row["status"] = "ok"
        if args.afdep_outputs:
            compare(row, args.afdep_outputs, T, y, topi, grads)
            mi.judge(row)
    except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
        mi.record_failure(row, e, is_oom(e))
    return row


def compare(row, out_dir, T, y, topi, grads):
    ref = mi.afdep_outputs(row, out_dir, T)
    if ref is None:
        return
    row["out_err"] = max_rel_err(to_bits(y), ref.y)
    if grads is not None and ref.dx is not None:
        dP, dx = grads
        row["gx_err"] = max_rel_err(to_bits(dx), ref.dx)
        errs = [max_rel_err(to_bits(dP[n]), v) for n, v in ref.dparams.items() if n in dP]
        row["gw_err"] = max(errs) if errs else None
    if ref.topk_idx is not None:
        mine = np.sort(np.asarray(topi), axis=-1)
        theirs = np.sort(ref.topk_idx, axis=-1)
        row["route_mismatch_tokens"] = int((mine != theirs).any(axis=-1).sum())


def main(argv=None):
    ap = mi.peer_arg_parser(__doc__, inputs_required=True)
    ap.add_argument("--platform", help="jax platform (gpu, cpu); default: JAX's default device")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmups < 1:
        ap.error("--iters and --warmups must be at least 1 (the first warm-up compiles)")
    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    tokens = args.tokens or mi.list_inputs(args.inputs)
    if not tokens:
        sys.exit(f"moe_jax.py: no moe-inputs-T.safetensors in {args.inputs}")
    with jax.default_device(device):
        for T in tokens:
            if not os.path.exists(mi.inputs_path(args.inputs, T)):
                sys.exit(f"moe_jax.py: no inputs for {T} tokens in {args.inputs}")
            print(f"moe_jax.py: {T} tokens on {device}", file=sys.stderr, flush=True)
            mi.emit(run_one(T, args, device), args.json_out)


if __name__ == "__main__":
    main()
