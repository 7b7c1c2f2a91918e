"""afdep.Exchange between processes over TCP on loopback (3 attention ranks, 2 FFN ranks,
uneven and zero token counts, masked slots, a hot expert), with a Python expert callable and
with afdep's SwiGLU: bit-identical to afdep-core's exchange oracle; a rejected route raises
afdep.RouteError with its fields on every rank; a silent peer raises afdep.TimeoutError
naming phase, rank and peer."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import afdep
from exchange_common import CONFIG, expert, inputs, swiglu_weights

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, world: int, args, timeout=240):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, AFDEP_RANK=str(r), AFDEP_WORLD_SIZE=str(world),
                   AFDEP_RENDEZVOUS=f"127.0.0.1:{port}", PYTHONPATH=str(HERE))
        procs.append(subprocess.Popen([sys.executable, str(script), *args(r)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out.decode(errors="replace")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_exchange_matches_oracle(tmp_path):
    world = 5
    outs = launch(HERE / "exchange_worker.py", world, lambda r: [str(tmp_path / f"rank{r}.pt")])
    for r, (rc, text) in enumerate(outs):
        assert rc == 0, f"rank {r} failed:\n{text}"
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert [s["role"] for s in seen] == ["attention"] * 3 + ["ffn"] * 2
    w1, w3, w2 = swiglu_weights()
    for round_no, experts, slot in [(1, expert, 0), (2, afdep.SwiGLU(w1, w3, w2), 1),
                                    (4, expert, 2)]:
        want = afdep.exchange_oracle(CONFIG, inputs(round_no), experts)
        for a in range(3):
            got = seen[a]["rounds"][slot]
            assert got.shape == (CONFIG and inputs(round_no)[a][0].shape)
            assert torch.isfinite(got.float()).all()
            assert torch.equal(got.view(torch.int16), want[a].view(torch.int16)), (
                f"round {round_no}, attention rank {a}: not bit-identical to the oracle")
    # the FFN ranks received every unmasked slot of their experts, grouped by expert
    slots = sum(int((idx >= 0).sum()) for _, idx, _ in inputs(1))
    rows = sum(seen[f]["rounds"][0]["expanded"].shape[0] for f in (3, 4))
    assert rows == slots
    # round 3: every rank raised the same RouteError naming attention rank 2, token 4, slot 1
    for r, s in enumerate(seen):
        kind, rank, token, slot, value, reporter = s["route_error"]
        assert (kind, rank, token, slot, value, reporter) == ("non_finite_weight", 2, 4, 1,
                                                               "nan", r)


SILENT = textwrap.dedent("""
    import os, sys, time
    import afdep
    ex = afdep.Exchange({"topology": "1A:1F", "hidden": 8, "experts": 2, "top_k": 1,
                         "capacity": 4, "transport": {"kind": "tcp", "timeout_ms": 1500}})
    if ex.role == "ffn":
        time.sleep(6)  # never joins the round in time
        sys.exit(0)
    import torch
    try:
        ex.round(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int32),
                 torch.ones(2, 1))
    except afdep.TimeoutError as e:
        print("TIMEOUT", e.phase, e.rank, e.peer)
        sys.exit(0)
    sys.exit(3)
""")


def test_silent_peer_times_out(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    outs = launch(script, 2, lambda r: [])
    rc, text = outs[0]
    assert rc == 0, text
    line = [l for l in text.splitlines() if l.startswith("TIMEOUT")][0]
    _, phase, rank, peer = line.split()
    assert rank == "0" and peer in ("1", "None") and phase, line


def test_bad_exchange_config():
    with pytest.raises(ValueError, match="unknown knob `no_such_knob`"):
        afdep.Exchange({"topology": "1A:1F", "hidden": 8, "experts": 2, "top_k": 1,
                        "capacity": 4, "knobs": {"no_such_knob": 1}})
    with pytest.raises(afdep.ConfigError):
        afdep.Exchange({"topology": "1A:1F", "hidden": 8, "experts": 2, "top_k": 3,
                        "capacity": 4})


FAILING = textwrap.dedent("""
    import sys
    import torch
    import afdep
    ex = afdep.Exchange({"topology": "1A:1F", "hidden": 8, "experts": 2, "top_k": 1,
                         "capacity": 4, "transport": {"kind": "tcp", "timeout_ms": 20000}})
    def bad(e, rows):
        raise KeyError(f"expert {e} failed")
    if ex.role == "ffn":
        try:
            ex.round(experts=bad)
        except KeyError as e:
            print("RAISED", e)
            sys.exit(0)
        sys.exit(3)
    y = ex.round(torch.ones(3, 8, dtype=torch.bfloat16), torch.tensor([[0], [1], [-1]],
                 dtype=torch.int32), torch.ones(3, 1))
    print("ROWS", [bool(torch.isnan(y[t].float()).all()) for t in range(3)])
""")


def test_failing_expert_callable(tmp_path):
    """The FFN rank re-raises the callable's exception after the round; the attention rank's
    rows that needed it are NaN (a masked-only token combines to +0)."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    (rc0, out0), (rc1, out1) = launch(script, 2, lambda r: [])
    assert rc0 == 0 and rc1 == 0, out0 + out1
    assert "RAISED" in out1 and "expert 0 failed" in out1, out1
    assert "ROWS [True, True, False]" in out0, out0
