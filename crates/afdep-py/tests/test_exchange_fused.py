"""afdep.Exchange(engine="fused"): the fused engine's device rounds and CUDA-graph replays
from Python, between 5 processes (3 attention ranks, 2 FFN ranks) on CUDA device 0 over the
nvlink transport (CUDA IPC), on torch CUDA tensors: odd token counts, a zero-token rank, a
full and an empty round, masked slots, a hot expert, outputs filled with NaN first; the
combined rows bit-identical to afdep-core's exchange oracle (scale experts) or within bf16
tolerances of it (SwiGLU on the device), also with rounds queued without waiting for their
verdict (`wait=False`, read by `synchronize()` or the next round); a rejected route and a bad
tensor on one rank fail every rank's round with typed errors, the outputs read NaN, and the
next round works. Every test here needs CUDA (SKIP without it, a failure with
AFDEP_REQUIRE_GPU=1); the argument checks that need no GPU are in test_exchange_args.py."""

from pathlib import Path

import pytest
import torch

import afdep
from conftest import cuda_or_skip
from exchange_common import inputs, swiglu_weights
from exchange_fused_worker import BAD_DEVICE, BAD_WEIGHT, PLAN, SCALES, config
from helpers import assert_close, tolerance
from test_exchange import launch

HERE = Path(__file__).parent
WORLD = 5


@pytest.fixture(autouse=True)
def cuda():
    cuda_or_skip()


def run_ranks(tmp_path, rounds, arm, payload, experts, wait):
    outs = launch(HERE / "exchange_fused_worker.py", WORLD,
                  lambda r: [str(tmp_path / f"rank{r}.pt"), rounds, arm, payload, experts, wait])
    for r, (rc, text) in enumerate(outs):
        assert rc == 0, f"rank {r} failed:\n{text}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("rounds,arm,payload,experts,wait", [
    ("device", "auto", "bf16", "scale", "wait"),
    ("graph", "auto", "bf16", "scale", "wait"),
    ("graph", "auto", "bf16", "scale", "nowait"),
    ("graph", "count-first-source", "fp8_e4m3", "scale", "wait"),
    ("device", "payload-first", "bf16", "swiglu", "wait"),
])
def test_fused_exchange(tmp_path, rounds, arm, payload, experts, wait):
    seen = run_ranks(tmp_path, rounds, arm, payload, experts, wait)
    assert [s["role"] for s in seen] == ["attention"] * 3 + ["ffn"] * 2
    assert all(s["rounds_mode"] == rounds for s in seen)
    cfg = config(payload)
    del cfg["transport"]
    host = afdep.ScaleExperts(SCALES) if experts == "scale" else afdep.SwiGLU(*swiglu_weights())
    for r, tokens in PLAN.items():
        if r in (BAD_WEIGHT, BAD_DEVICE):
            continue
        want = afdep.exchange_oracle(cfg, inputs(r, tokens, cfg["hidden"]), host)
        for a in range(3):
            assert seen[a]["errors"].get(r) is None, (r, a, seen[a]["errors"][r])
            got = seen[a]["out"][r]
            assert got.shape == (tokens[a], cfg["hidden"]), (r, a, got.shape)
            assert torch.isfinite(got.float()).all(), f"round {r}, rank {a}: unwritten rows"
            if experts == "scale":
                assert torch.equal(got.view(torch.int16), want[a].view(torch.int16)), (
                    f"round {r}, attention rank {a}: not bit-identical to the oracle")
            else:
                assert_close(f"round {r}, rank {a}", got, want[a],
                             tolerance("cuda", torch.bfloat16, grads=False))
        for s in seen:
            assert s["errors"].get(r) is None, (r, s["rank"], s["errors"][r])
        arms = {s["arms"][r] for s in seen if r in s["arms"]}  # (nowait: not round 1's)
        assert len(arms) == (0 if wait == "nowait" and r == 1 else 1), (
            f"round {r}: ranks took different arms {arms}")
        if arm != "auto":
            assert arms == {arm.replace("-", "_")}
    # round 3: every rank raised the same RouteError naming attention rank 2, token 4, slot 1;
    # the outputs (zeros before) read NaN: the poisoned rows
    for r, s in enumerate(seen):
        assert s["errors"][BAD_WEIGHT] == ("RouteError", "non_finite_weight", 2, 4, 1, "nan", r)
    for a in range(3):
        out = seen[a]["out"][BAD_WEIGHT]
        assert out.shape[0] == PLAN[BAD_WEIGHT][a]
        assert torch.isnan(out.float()).all(), f"rank {a}: a rejected round's rows are NaN"
    # round 6: rank 1's CPU tensor is its ValueError; every other rank's round is rejected
    # (over capacity, naming rank 1) instead of waiting for it
    bad = seen[1]["errors"][BAD_DEVICE]
    assert bad[0] == "ValueError" and "`x`" in bad[1] and "CUDA device 0" in bad[1], bad
    for r, s in enumerate(seen):
        if r == 1:
            continue
        e = s["errors"][BAD_DEVICE]
        assert e[:3] == ("RouteError", "over_capacity", 1) and e[6] == r, e
    for a in (0, 2):
        assert torch.isnan(seen[a]["out"][BAD_DEVICE].float()).all(), a


def test_capture_by_torch_graph_is_refused():
    """A round under torch.cuda.graph is refused before anything is queued (checked in a
    world of one process: an EP1 rank is attention and FFN rank at once)."""
    import os
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AFDEP_RANK": "0", "AFDEP_WORLD_SIZE": "1", "AFDEP_RENDEZVOUS": f"127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ex = afdep.Exchange({"topology": "EP1", "hidden": 16, "experts": 4, "top_k": 2,
                             "capacity": 8, "transport": {"kind": "nvlink", "device": 0}},
                            engine="fused", rounds="graph", experts=afdep.IDENTITY)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    dev = torch.device("cuda", 0)
    x = torch.randn(3, 16, device=dev).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int32, device=dev)
    w = torch.rand(3, 2, device=dev)
    eager = ex.round(x, idx, w)
    torch.cuda.synchronize()
    want = afdep.exchange_oracle({"topology": "EP1", "hidden": 16, "experts": 4, "top_k": 2,
                                  "capacity": 8},
                                 [(x.cpu(), idx.cpu(), w.cpu())], afdep.IDENTITY)[0]
    assert torch.equal(eager.cpu().view(torch.int16), want.view(torch.int16))
    g = torch.cuda.CUDAGraph()
    with pytest.raises(afdep.CaptureError, match="rounds=\"graph\""):
        with torch.cuda.graph(g):
            ex.round(x, idx, w)
