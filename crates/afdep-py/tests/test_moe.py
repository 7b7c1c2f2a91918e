"""afdep.MoE (the oracle on CPU tensors, the GPU layer on CUDA tensors) against the
plain-PyTorch implementation in afdep.reference: forward, routes and every gradient, on odd
shapes, K = 1, a hot expert, given routes with masked slots; and the errors."""

import math

import pytest
import torch

import afdep
from afdep import _native
from afdep.reference import ReferenceMoE, moe_reference
from helpers import assert_close, tolerance

# (d_model, width, experts, top_k, shared, tokens): CPU shapes are odd; the GPU layer needs
# d_model, width, shared multiples of 8 (test_cuda_graph.py has its odd shapes).
CPU_CASES = {
    "odd": (24, 20, 7, 3, 12, 13),
    "k1": (17, 9, 5, 1, 0, 11),
    "no_shared": (16, 12, 6, 2, 0, 31),
    "wide_k": (8, 8, 9, 9, 4, 5),
}
GPU_CASES = {
    "odd_tokens": (64, 32, 8, 2, 32, 37),
    "k1": (64, 64, 8, 1, 0, 129),
    "no_shared": (96, 32, 16, 4, 0, 53),
    "top8": (128, 64, 16, 8, 64, 71),
}


def cases(device):
    return CPU_CASES if device == "cpu" else GPU_CASES


def dtypes(device):
    return [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16]


def build(case, device, dtype, seed, hot=None, renormalize=True):
    h, w, e, k, s, t = case
    torch.manual_seed(seed)
    m = afdep.MoE(h, w, e, k, shared=s, renormalize=renormalize)
    x = torch.randn(t, h, dtype=torch.float32)
    if hot is not None:
        # channel 0 of every token positive, and the router reads it for expert `hot`: that
        # expert is in (nearly) every token's top-K
        x[:, 0] = x[:, 0].abs() + 1.0
        with torch.no_grad():
            m.wr[0, hot] += 3.0
    m = m.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype)
    return m, x


def check_layer(m, x, device, dtype, routes=None):
    x = x.detach().requires_grad_(True)
    idx, wts = routes if routes is not None else (None, None)
    out, ridx, rw = m(x, idx, wts, return_routes=True)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_p = [p.detach().clone().requires_grad_(True) for p in m.params()]
    ref, ref_idx, ref_w = moe_reference(ref_x, ref_p, m.shape, idx, wts)
    assert out.dtype == dtype and out.device.type == device
    assert_close("out", out, ref, tolerance(device, dtype, grads=False))
    if routes is None:
        assert torch.equal(ridx.cpu(), ref_idx.cpu()), "the router chose other experts"
        assert_close("topk_weights", rw, ref_w, (1e-5, 1e-6) if device == "cpu" else (2**-7, 2**-8))
    dy = torch.randn(out.shape, dtype=torch.float32).to(device=device, dtype=dtype)
    got = torch.autograd.grad((out.float() * dy.float()).sum(), [x] + m.params())
    want = torch.autograd.grad((ref.float() * dy.float()).sum(), [ref_x] + ref_p, allow_unused=True)
    want = [torch.zeros_like(v) if g is None else g for g, v in zip(want, [ref_x] + ref_p)]
    for name, g, r in zip(["dx"] + ["d" + n for n in afdep._moe.PARAM_NAMES], got, want):
        if routes is not None and name == "dwr":
            assert torch.count_nonzero(g) == 0, "given routes: the router gradient is zero"
            continue
        if name == "dwr" and m.shape[3] == 1 and m.shape[5]:
            # K = 1 renormalised: the weight is p/p = 1, its gradient exactly 0 (the
            # reference's autograd leaves f32 noise)
            assert torch.count_nonzero(g) == 0, "K = 1: the router gradient is zero"
            assert r.abs().max() <= 1e-5 * want[0].abs().max()
            continue
        assert_close(name, g, r, tolerance(device, dtype, grads=True))


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_forward_and_gradients(device, name):
    if name not in cases(device):
        pytest.skip("CPU-only case")
    for dtype in dtypes(device):
        m, x = build(cases(device)[name], device, dtype, seed=hash(name) % 1000)
        check_layer(m, x, device, dtype)


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_forward_and_gradients_gpu_shapes(device, name):
    """The GPU shapes run on the CPU oracle too (the same code path, larger)."""
    for dtype in dtypes(device):
        m, x = build(GPU_CASES[name], device, dtype, seed=7)
        check_layer(m, x, device, dtype)


def test_hot_expert(device):
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    for dtype in dtypes(device):
        m, x = build(case, device, dtype, seed=3, hot=2)
        _, idx, _ = m(x, return_routes=True)
        share = (idx == 2).any(dim=1).float().mean().item()
        assert share > 0.8, f"expert 2 is in only {share:.0%} of the tokens' routes"
        check_layer(m, x, device, dtype)


def test_no_renormalize(device):
    case = cases(device)["no_shared"]
    for dtype in dtypes(device):
        m, x = build(case, device, dtype, seed=5, renormalize=False)
        check_layer(m, x, device, dtype)


def test_given_routes_with_masked_slots(device):
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    h, w, e, k, s, t = case
    for dtype in dtypes(device):
        m, x = build(case, device, dtype, seed=11)
        g = torch.Generator().manual_seed(1)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        idx[::3, -1] = -1  # masked slots
        wts = torch.rand(t, k, generator=g)
        check_layer(m, x, device, dtype, routes=(idx.to(device), wts.to(device)))


def test_zero_tokens_and_leading_dims(device):
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    dtype = dtypes(device)[-1]
    m, x = build(case, device, dtype, seed=2)
    empty = x[:0].detach().requires_grad_(True)
    out = m(empty)
    assert out.shape == (0, case[0])
    out.sum().backward()
    assert all(torch.count_nonzero(p.grad) == 0 for p in m.params())
    x3 = x[:12].reshape(3, 4, case[0])
    assert torch.equal(m(x3).reshape(12, -1), m(x[:12]))


def test_every_output_is_written(device):
    """Poisoned (NaN) outputs before a native step: every element must be overwritten."""
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    dtype = dtypes(device)[-1]
    m, x = build(case, device, dtype, seed=4)
    cap = afdep._moe._cap
    nan = lambda like: torch.full_like(like, float("nan"))  # noqa: E731
    out, dx, dy = nan(x), nan(x), torch.randn_like(x)
    grads = [nan(p) for p in m.params()]
    t, k = x.shape[0], case[3]
    idx = torch.full((t, k), -7, dtype=torch.int32, device=device)
    wts = torch.full((t, k), float("nan"), device=device)
    stream = afdep._moe._stream(x)
    _native.layer_step(m.shape, cap(x), [cap(p) for p in m.params()], cap(out), cap(idx),
                       cap(wts), False, stream, "auto", dy=cap(dy), dx=cap(dx),
                       grads=[cap(g) for g in grads])
    if device == "cuda":
        torch.cuda.synchronize()
    for name, v in [("out", out), ("dx", dx), ("weights", wts)] + list(zip(afdep._moe.PARAM_NAMES, grads)):
        assert torch.isfinite(v).all(), f"{name} has unwritten (NaN) elements"
    assert (idx >= 0).all() and (idx < case[2]).all()


def test_trains_like_pytorch(device):
    """Ten SGD steps of afdep.MoE and of the plain-PyTorch copy stay together.

    On the CPU (f32) the parameters' *updates* are compared, so a wrong or missing gradient
    fails (the updates are small next to the parameters). In bf16 on CUDA an update of this
    size is below the parameters' resolution, so there the final parameters are compared: a
    smoke test of the autograd wiring; the gradients themselves are judged by the gradient
    tests above."""
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    m, x = build(case, device, dtype, seed=9)
    ref = ReferenceMoE(m)
    start = [p.detach().clone() for p in m.parameters()]
    target = torch.randn_like(x)
    opt_a = torch.optim.SGD(m.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(10):
        for mod, opt in ((m, opt_a), (ref, opt_b)):
            opt.zero_grad()
            loss = ((mod(x).float() - target.float()) ** 2).mean()
            loss.backward()
            opt.step()
    if device == "cpu":
        moved = 0.0
        for (name, a), b, p0 in zip(m.named_parameters(), ref.parameters(), start):
            upd_a, upd_b = a.detach() - p0, b.detach() - p0
            moved = max(moved, upd_b.abs().max().item())
            assert_close(name + " update", upd_a, upd_b, (1e-3, 1e-3))
        assert moved > 0.0, "the reference did not move: the test would not see a gradient bug"
    else:
        for (name, a), b in zip(m.named_parameters(), ref.parameters()):
            assert_close(name, a, b, (2**-6, 2**-5))
    sd = m.state_dict()
    assert set(sd) == set(afdep._moe.PARAM_NAMES)


# --- errors -------------------------------------------------------------------------------


def small(device):
    case = cases(device)["odd" if device == "cpu" else "odd_tokens"]
    return build(case, device, dtypes(device)[-1], seed=1)


def test_bad_shape_names_the_tensor(device):
    m, x = small(device)
    with pytest.raises(ValueError, match="`x` has shape"):
        m(x[:, :-1].contiguous())
    with pytest.raises(ValueError, match="`w1` has shape"):
        afdep.moe(x, [p[..., :1].contiguous() if i == 1 else p for i, p in enumerate(m.params())], m.shape)


def test_bad_dtype_names_the_tensor(device):
    m, x = small(device)
    with pytest.raises(TypeError, match="`x` is torch.float64"):
        m(x.double())
    params = m.params()
    params[3] = params[3].float() if params[3].dtype == torch.bfloat16 else params[3].bfloat16()
    with pytest.raises(TypeError, match="`w2` is torch"):
        afdep.moe(x, params, m.shape)
    t, k = x.shape[0], m.shape[3]
    idx64 = torch.zeros(t, k, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="`topk_idx` is torch.int64"):
        m(x, idx64, torch.ones(t, k, device=device))


def test_non_contiguous_names_the_tensor(device):
    m, x = small(device)
    xt = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=device).t()
    xt.copy_(x)
    with pytest.raises(ValueError, match="`x` is not contiguous"):
        afdep.moe(xt, m.params(), m.shape)


def test_bad_config(device):
    m, x = small(device)
    h, w, e, k, s, r = m.shape
    with pytest.raises(afdep.ConfigError) as ei:
        afdep.moe(x, m.params(), (h, w, e, e + 1, s, r))
    assert ei.value.field == "top_k"


def route_case(device):
    m, x = small(device)
    t, k, e = x.shape[0], m.shape[3], m.shape[2]
    idx = torch.stack([torch.arange(k) for _ in range(t)]).to(torch.int32)
    return m, x, idx, torch.full((t, k), 1.0 / k), e


def test_non_finite_route_weight(device):
    m, x, idx, wts, _ = route_case(device)
    wts[5, 1] = float("nan")
    with pytest.raises(afdep.RouteError) as ei:
        m(x, idx.to(device), wts.to(device))
    err = ei.value
    assert (err.kind, err.rank, err.token, err.slot) == ("non_finite_weight", 0, 5, 1)
    assert math.isnan(err.value)
    wts[5, 1] = float("inf")
    with pytest.raises(afdep.RouteError) as ei:
        m(x, idx.to(device), wts.to(device))
    assert ei.value.value == math.inf and isinstance(ei.value, afdep.AfdepError)


def test_wide_and_duplicate_routes(device):
    m, x, idx, wts, e = route_case(device)
    wide = idx.clone()
    wide[3, 0] = e
    with pytest.raises(afdep.RouteError) as ei:
        m(x, wide.to(device), wts.to(device))
    assert (ei.value.kind, ei.value.token, ei.value.slot, ei.value.value) == ("wide", 3, 0, e)
    if m.shape[3] > 1:
        dup = idx.clone()
        dup[4, 1] = dup[4, 0]
        with pytest.raises(afdep.RouteError) as ei:
            m(x, dup.to(device), wts.to(device))
        assert (ei.value.kind, ei.value.token, ei.value.slot) == ("duplicate", 4, 1)


def test_outputs_sharing_memory_with_inputs_are_refused(device):
    """The GPU layer reads and writes the tensors in place: an output may not alias an input
    (nor another output); inputs may share memory."""
    m, x = small(device)
    cap = afdep._moe._cap
    t, k = x.shape[0], m.shape[3]
    idx = torch.empty(t, k, dtype=torch.int32, device=device)
    w = torch.empty(t, k, device=device)
    stream = afdep._moe._stream(x)
    ps = [cap(p) for p in m.params()]
    with pytest.raises(ValueError, match="`x` and `out` share memory and the step writes `out`"):
        _native.layer_step(m.shape, cap(x), ps, cap(x), cap(idx), cap(w), False, stream, "auto")
    out = torch.empty_like(x)
    both = torch.empty(2 * t * k, dtype=torch.int32, device=device)
    wv = both[: t * k].view(torch.float32).view(t, k)
    with pytest.raises(ValueError, match="`topk_idx` and `topk_weights` share memory"):
        _native.layer_step(m.shape, cap(x), ps, cap(out), cap(both[: t * k].view(t, k)),
                           cap(wv), False, stream, "auto")
    # given routes are read only: inputs may alias each other (here w1 and w3)
    params = m.params()
    shared = [params[0], params[1], params[1]] + params[3:]
    afdep.moe(x, shared, m.shape)


def test_cuda_stream_order():
    """Work on a side stream: afdep's step is ordered after the producer of x on that stream."""
    from conftest import cuda_or_skip

    cuda_or_skip()
    m, x = small("cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy, then write x on it
        x2 = x * 1.0
        out = m(x2)
    torch.cuda.synchronize()
    ref, _, _ = moe_reference(x, m.params(), m.shape)
    assert_close("out", out, ref, tolerance("cuda", torch.bfloat16, grads=False))


@pytest.mark.parametrize("dispatch", ["sorted", "gather", "fused", "fused_gsum"])
def test_cuda_every_dispatch(dispatch):
    """Every GPU dispatch strategy computes the same function (fused: atomics, any order)."""
    from conftest import cuda_or_skip

    cuda_or_skip()
    m, x = build(GPU_CASES["top8"], "cuda", torch.bfloat16, seed=21, hot=3)
    m.dispatch = dispatch
    check_layer(m, x, "cuda", torch.bfloat16)


def test_unknown_dispatch_is_refused():
    from conftest import cuda_or_skip

    cuda_or_skip()
    m, x = small("cuda")
    m.dispatch = "scatter"
    with pytest.raises(ValueError, match="unknown dispatch `scatter`"):
        m(x)
