"""afdep.MoE on CUDA beyond the shared cases: torch.cuda.graph capture and replay of forward
and backward (bit for bit the eager step, within bf16 tolerance of the plain-PyTorch MoE),
what capture refuses, the layers a capture pins, odd shapes, and tensors read and written in
place or, at unaligned addresses, copied. Every test here needs CUDA (SKIP without it, a
failure with AFDEP_REQUIRE_GPU=1)."""

import pytest
import torch

import afdep
from afdep import _native
from afdep.reference import moe_reference
from conftest import cuda_or_skip
from helpers import assert_close, tolerance
from test_moe import build, check_layer

BF16 = torch.bfloat16
# (d_model, width, experts, top_k, shared, tokens)
GRAPH_CASE = (64, 40, 12, 3, 24, 57)


@pytest.fixture(autouse=True)
def cuda():
    cuda_or_skip()


def eager_step(m, x, dy):
    """Forward and backward on fresh tensors: (out, idx, weights, dx, [grads])."""
    xe = x.detach().clone().requires_grad_(True)
    out, idx, w = m(xe, return_routes=True)
    grads = torch.autograd.grad(out, [xe] + m.params(), dy)
    return out.detach(), idx, w, grads[0], list(grads[1:])


def capture(m, static_x, static_dy):
    """Warm-up (eager, on a side stream, as torch's documentation does), then one captured
    forward and backward; returns the graph and its static outputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager_step(m, static_x, static_dy)
    torch.cuda.current_stream().wait_stream(s)
    m.zero_grad(set_to_none=True)
    static_x.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, idx, w = m(static_x, return_routes=True)
        out.backward(static_dy)
    return g, (out, idx, w, static_x.grad, [p.grad for p in m.params()])


def bits_equal(name, a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    as_bits = lambda v: v.view(torch.int16) if v.dtype == BF16 else v  # noqa: E731
    assert torch.equal(as_bits(a), as_bits(b)), f"{name}: the bits differ"


def reference_check(m, x, dy, out, idx, w, dx, grads):
    """Within bf16 tolerance of the plain-PyTorch MoE; False when the router tied (other
    experts than the reference's), in which case nothing is compared."""
    ref_x = x.detach().clone().requires_grad_(True)
    ref_p = [p.detach().clone().requires_grad_(True) for p in m.params()]
    ref, ref_idx, _ = moe_reference(ref_x, ref_p, m.shape)
    if not torch.equal(idx.cpu(), ref_idx.cpu()):
        return False
    assert_close("out", out, ref, tolerance("cuda", BF16, grads=False))
    want = torch.autograd.grad((ref.float() * dy.float()).sum(), [ref_x] + ref_p, allow_unused=True)
    want = [torch.zeros_like(v) if g is None else g for g, v in zip(want, [ref_x] + ref_p)]
    for name, g, r in zip(["dx"] + ["d" + n for n in afdep._moe.PARAM_NAMES], [dx] + grads, want):
        assert_close(name, g, r, tolerance("cuda", BF16, grads=True))
    return True


def test_graph_replay_equals_eager_and_reference():
    m, x = build(GRAPH_CASE, "cuda", BF16, seed=31)
    static_x = x.detach().clone().requires_grad_(True)
    static_dy = torch.randn_like(x)
    g, (s_out, s_idx, s_w, s_dx, s_grads) = capture(m, static_x, static_dy)
    try:
        assert s_dx is not None and all(v is not None for v in s_grads)
        compared = 0
        for seed in range(5):
            gen = torch.Generator().manual_seed(100 + seed)
            x_new = torch.randn(x.shape, generator=gen).to("cuda", BF16)
            dy_new = torch.randn(x.shape, generator=gen).to("cuda", BF16)
            with torch.no_grad():
                static_x.copy_(x_new)
                static_dy.copy_(dy_new)
            g.replay()
            got = [s_out.clone(), s_idx.clone(), s_w.clone(), s_dx.clone(), [v.clone() for v in s_grads]]
            e_out, e_idx, e_w, e_dx, e_grads = eager_step(m, x_new, dy_new)
            torch.cuda.synchronize()
            bits_equal("out", got[0], e_out)
            bits_equal("topk_idx", got[1], e_idx)
            bits_equal("topk_weights", got[2], e_w)
            bits_equal("dx", got[3], e_dx)
            for n, a, b in zip(afdep._moe.PARAM_NAMES, got[4], e_grads):
                bits_equal("d" + n, a, b)
            compared += reference_check(m, x_new, dy_new, *got)
        assert compared >= 3, f"only {compared} of 5 replays had the reference's routes"
    finally:
        del g
        afdep.unpin_layers()


def test_capture_before_an_eager_step_is_refused():
    # a shape no other test uses, so no layer of it is cached yet
    m, x = build((48, 24, 5, 2, 0, 23), "cuda", BF16, seed=2)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(afdep.CaptureError, match="eager forward and backward step"):
        with torch.cuda.graph(g):
            m(x)
    # after the refusal the layer works eagerly
    check_layer(m, x, "cuda", BF16)


def test_given_routes_under_capture_are_refused():
    m, x = build(GRAPH_CASE, "cuda", BF16, seed=3)
    t, k, e = x.shape[0], m.shape[3], m.shape[2]
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to("cuda", torch.int32)
    wts = torch.full((t, k), 1.0 / k, device="cuda")
    m(x, idx, wts)  # eager: fine
    m(x)  # eager with the router: the layer is warm
    g = torch.cuda.CUDAGraph()
    with pytest.raises(afdep.CaptureError, match="given routes"):
        with torch.cuda.graph(g):
            m(x, idx, wts)


def test_captured_layers_stay_pinned():
    """The cache drops its least recently used layers past MAX_LAYERS, never the ones a graph
    uses: after steps of many other token counts the replay still equals the eager step."""
    case = (32, 24, 5, 1, 16, 29)
    m, x = build(case, "cuda", BF16, seed=4)
    static_x = x.detach().clone().requires_grad_(True)
    static_dy = torch.randn_like(x)
    g, (s_out, _, _, s_dx, s_grads) = capture(m, static_x, static_dy)
    dev = torch.cuda.current_device()
    try:
        for t in range(1, _native.MAX_LAYERS + 4):  # more token counts than the cache holds
            m(torch.randn(t, case[0], device="cuda", dtype=BF16))
        cache = _native.layer_cache(dev)
        mine = [row for row in cache if row[0][:5] == case[:5] and row[1] == case[5]]
        assert sorted(row[3] for row in mine) == [False, True], cache  # forward and train
        assert all(row[4] and row[5] for row in mine), "warm and pinned"
        assert sum(1 for row in cache if not row[5]) <= _native.MAX_LAYERS
        x_new = torch.randn_like(x)
        with torch.no_grad():
            static_x.copy_(x_new)
        g.replay()
        e_out, _, _, e_dx, e_grads = eager_step(m, x_new, static_dy)
        torch.cuda.synchronize()
        bits_equal("out", s_out, e_out)
        bits_equal("dx", s_dx, e_dx)
        for n, a, b in zip(afdep._moe.PARAM_NAMES, s_grads, e_grads):
            bits_equal("d" + n, a, b)
    finally:
        del g
        assert afdep.unpin_layers() >= 2
    cache = _native.layer_cache(dev)
    assert not any(row[5] for row in cache) and len(cache) <= _native.MAX_LAYERS


# (d_model, width, experts, top_k, shared, tokens): experts 5 and 12, widths 24 and 40, K 1
# and 3, T 1, 257 and 0 (rows of 8 bf16 values are all the GPU layer needs)
ODD_CUDA = {
    "e5_w24_k1_t1": (32, 24, 5, 1, 0, 1),
    "e12_w40_k3_t257": (48, 40, 12, 3, 24, 257),
    "e12_w24_k1_t257": (40, 24, 12, 1, 40, 257),
    "e5_w40_k3_t1": (24, 40, 5, 3, 8, 1),
    "e5_w24_k3_t0": (32, 24, 5, 3, 16, 0),
}


@pytest.mark.parametrize("name", list(ODD_CUDA))
def test_odd_shapes(name):
    m, x = build(ODD_CUDA[name], "cuda", BF16, seed=13)
    check_layer(m, x, "cuda", BF16)


def test_unaligned_tensors_are_copied():
    """Tensors at addresses the layer does not borrow (not 256-byte aligned) are copied in and
    out: the same bits as aligned tensors read and written in place."""
    m, x = build(GRAPH_CASE, "cuda", BF16, seed=6)
    cap = afdep._moe._cap
    t, k = x.shape[0], m.shape[3]

    def run(offset):
        def place(v, fill=None):
            # a view `offset` elements into a fresh flat buffer (torch's allocations are
            # 512-byte aligned: offset 0 is lent, offset 3 is copied)
            flat = torch.empty(v.numel() + offset, dtype=v.dtype, device="cuda")
            view = flat[offset:].view(v.shape)
            return view.copy_(v) if fill is None else view.fill_(fill)

        nan = float("nan")
        xin = place(x)
        params = [place(p.detach()) for p in m.params()]
        dy = place(torch.full_like(x, 0.5))
        out, dx = place(x, nan), place(x, nan)
        grads = [place(p.detach(), nan) for p in m.params()]
        idx = place(torch.empty(t, k, dtype=torch.int32, device="cuda"), -7)
        w = place(torch.empty(t, k, device="cuda"), nan)
        _native.layer_step(m.shape, cap(xin), [cap(p) for p in params], cap(out), cap(idx),
                           cap(w), False, afdep._moe._stream(x), "auto", dy=cap(dy), dx=cap(dx),
                           grads=[cap(v) for v in grads])
        torch.cuda.synchronize()
        aligned = offset == 0
        assert (xin.data_ptr() % 256 == 0) == aligned and (out.data_ptr() % 256 == 0) == aligned
        return [out, idx, w, dx] + grads

    aligned, unaligned = run(0), run(3)
    for i, (a, b) in enumerate(zip(aligned, unaligned)):
        assert torch.isfinite(a.float()).all(), f"output {i} has unwritten (NaN) elements"
        bits_equal(f"output {i}", a, b)
