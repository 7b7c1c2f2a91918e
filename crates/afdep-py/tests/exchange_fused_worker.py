"""One rank of the fused-engine exchange test (run by test_exchange_fused.py with AFDEP_RANK
etc. set; every rank on CUDA device 0): argv = out_path rounds arm payload experts wait.
Runs the rounds of PLAN on CUDA tensors (wait "nowait": each queued without waiting for its
verdict, read by `synchronize()` after it, or for round 1 by round 2's call), with `out`
filled with NaN before each good round (so a row the round did not write shows), a
non-finite route weight on attention rank 2 in round 3 and a CPU tensor on attention rank 1
in round 6 (both must fail every rank's round with a typed error, `out` must then read NaN,
and the next round must work). Writes what it saw to out_path (torch.save)."""

import sys

import torch

import afdep
from exchange_common import CONFIG, inputs, swiglu_weights

# per round: tokens of each attention rank (odd counts, a zero-token rank, the full capacity,
# an all-empty round); the graph replays every one of them with new rows and routes
PLAN = {
    1: [13, 0, 29],
    2: [1, 7, 0],
    3: [13, 0, 29],  # rank 2 sends a NaN weight: rejected everywhere
    4: [64, 3, 0],
    5: [0, 0, 0],
    6: [5, 6, 7],  # rank 1 passes a CPU tensor: rejected everywhere
    7: [29, 13, 1],
}
BAD_WEIGHT = 3
BAD_DEVICE = 6
SCALES = [0.5 + 0.25 * e for e in range(CONFIG["experts"])]


def config(payload: str) -> dict:
    """The test's config with `payload`; fp8 rows need a multiple of 128 channels."""
    hidden = 128 if payload == "fp8_e4m3" else CONFIG["hidden"]
    return dict(CONFIG, payload=payload, hidden=hidden,
                transport={"kind": "nvlink", "device": 0, "timeout_ms": 20000})


def experts_of(kind: str):
    if kind == "scale":
        return afdep.ScaleExperts(SCALES)
    if kind == "identity":
        return afdep.IDENTITY
    return afdep.SwiGLU(*swiglu_weights())


def main():
    out_path, rounds, arm, payload, kind, wait_mode = sys.argv[1:7]
    wait = wait_mode == "wait"
    cfg = config(payload)
    ex = afdep.Exchange(cfg, engine="fused", rounds=rounds, arm=arm, experts=experts_of(kind))
    attn = ex.role == "attention"
    dev = torch.device("cuda", 0)
    seen = {"rank": ex.rank, "role": ex.role, "rounds_mode": ex.rounds, "out": {},
            "errors": {}, "arms": {}}
    for r, tokens in PLAN.items():
        try:
            if attn:
                x, idx, w = inputs(r, tokens, cfg["hidden"])[ex.rank]
                if r == BAD_WEIGHT and ex.rank == 2:
                    w = w.clone()
                    w[4, 1] = float("nan")
                x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
                if r == BAD_DEVICE and ex.rank == 1:
                    x = x.cpu()
                fill = 0.0 if r in (BAD_WEIGHT, BAD_DEVICE) else float("nan")
                out = torch.full((tokens[ex.rank], cfg["hidden"]), fill, dtype=torch.bfloat16,
                                 device=dev)
                got = ex.round(x, idx, w, out=out, wait=wait)
                assert got is out, "round() returns the given out tensor"
            else:
                got = ex.round(wait=wait)
                assert got is None
            if wait or r != 1:
                ex.synchronize()  # (waiting: nothing left to read)
                seen["arms"][r] = ex.last_arm
        except afdep.RouteError as e:
            seen["errors"][r] = ("RouteError", e.kind, e.rank, e.token, e.slot, str(e.value),
                                 e.reporter)
        except (TypeError, ValueError) as e:
            seen["errors"][r] = (type(e).__name__, str(e))
        if attn:
            torch.cuda.current_stream().synchronize()
            seen["out"][r] = out.cpu()
    torch.save(seen, out_path)


if __name__ == "__main__":
    main()
