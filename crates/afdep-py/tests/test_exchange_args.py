"""afdep.Exchange's arguments and the device experts' host twins, without a GPU or a peer
(these run in CI): engine, rounds, arm and experts are checked, and the fused engine's
transport, before any connection; afdep.ScaleExperts and "identity" in the oracle are
bit-identical to the same experts as Python callables."""

import pytest
import torch

import afdep
from exchange_common import CONFIG, expert, inputs

NVLINK = dict(CONFIG, transport={"kind": "nvlink", "device": 0})
SCALES = [0.5 + 0.25 * e for e in range(CONFIG["experts"])]


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch):
    """No rendezvous in the environment: a check that did not stop the constructor fails
    at once with afdep.TransportError instead of waiting for peers."""
    for k in ("AFDEP_RANK", "AFDEP_WORLD_SIZE", "AFDEP_RENDEZVOUS"):
        monkeypatch.delenv(k, raising=False)


def test_engine_and_rounds():
    with pytest.raises(ValueError, match="engine 'nccl'"):
        afdep.Exchange(CONFIG, engine="nccl")
    with pytest.raises(ValueError, match="fused engine's"):
        afdep.Exchange(CONFIG, rounds="graph")
    with pytest.raises(ValueError, match="fused engine's"):
        afdep.Exchange(CONFIG, experts=afdep.IDENTITY)
    with pytest.raises(ValueError, match="rounds `eager`"):
        afdep.Exchange(NVLINK, engine="fused", rounds="eager", experts=afdep.IDENTITY)
    with pytest.raises(ValueError, match="arm `fastest`"):
        afdep.Exchange(NVLINK, engine="fused", arm="fastest", experts=afdep.IDENTITY)


def test_fused_needs_nvlink():
    with pytest.raises(afdep.ConfigError, match="needs the nvlink transport") as e:
        afdep.Exchange(CONFIG, engine="fused", experts=afdep.IDENTITY)  # CONFIG says tcp
    assert (e.value.field, e.value.value) == ("transport", "tcp")


def test_fused_experts():
    with pytest.raises(ValueError, match="needs experts at construction"):
        afdep.Exchange(NVLINK, engine="fused")
    with pytest.raises(TypeError, match="a Python callable cannot be one"):
        afdep.Exchange(NVLINK, engine="fused", experts=expert)
    with pytest.raises(ValueError, match="7 scales for 8 experts"):
        afdep.Exchange(NVLINK, engine="fused", experts=afdep.ScaleExperts(SCALES[:7]))
    bad = list(SCALES)
    bad[5] = float("inf")
    with pytest.raises(ValueError, match="the scale of expert 5 is inf"):
        afdep.Exchange(NVLINK, engine="fused", experts=afdep.ScaleExperts(bad))
    with pytest.raises(ValueError, match="the only named experts"):
        afdep.Exchange(NVLINK, engine="fused", experts="relu")
    with pytest.raises(TypeError, match="expected afdep.SwiGLU"):
        afdep.Exchange(NVLINK, engine="fused", experts=3)


def test_fused_without_launch_environment():
    """Every argument is fine: the constructor gets as far as the rendezvous, which the
    environment does not name (a typed error, no wait)."""
    with pytest.raises(afdep.TransportError, match="AFDEP_RANK"):
        afdep.Exchange(NVLINK, engine="fused", experts=afdep.ScaleExperts(SCALES))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_device_experts_host_twins():
    """The oracle with afdep.ScaleExperts and "identity" (afdep-moe's host twins of the
    device experts) against the same experts as Python callables: bit for bit."""
    inp = inputs(11)
    scaled = afdep.exchange_oracle(CONFIG, inp, afdep.ScaleExperts(SCALES))
    by_hand = afdep.exchange_oracle(
        CONFIG, inp, lambda e, rows: (rows.float() * SCALES[e]).to(torch.bfloat16))
    ident = afdep.exchange_oracle(CONFIG, inp, afdep.IDENTITY)
    by_hand_ident = afdep.exchange_oracle(CONFIG, inp, lambda e, rows: rows.clone())
    for a in range(len(inp)):
        assert torch.equal(bits(scaled[a]), bits(by_hand[a])), a
        assert torch.equal(bits(ident[a]), bits(by_hand_ident[a])), a
        assert torch.isfinite(scaled[a].float()).all()
    # the scales matter: not the identity's rows
    assert not torch.equal(bits(scaled[0]), bits(ident[0]))
