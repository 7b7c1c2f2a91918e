"""One rank of the exchange test (run by test_exchange.py with AFDEP_RANK etc. set): round 1
with a Python expert callable, round 2 with afdep's SwiGLU, round 3 with a non-finite route
weight on attention rank 2 (every rank must raise afdep.RouteError), round 4 after it (the
engine stays usable). Writes what it saw to argv[1] (torch.save)."""

import sys

import torch

import afdep
from exchange_common import CONFIG, expert, inputs, swiglu_weights

ex = afdep.Exchange(CONFIG)
mine = {"rank": ex.rank, "role": ex.role, "rounds": []}
w1, w3, w2 = swiglu_weights()
attn = ex.role == "attention"


def run(round_no, experts, poison=False):
    if attn:
        x, idx, w = inputs(round_no)[ex.rank]
        if poison and ex.rank == 2:
            w = w.clone()
            w[4, 1] = float("nan")
        return ex.round(x, idx, w, experts=experts)
    return ex.round(experts=experts)


for round_no, experts in [(1, expert), (2, afdep.SwiGLU(w1, w3, w2))]:
    r = run(round_no, experts)
    mine["rounds"].append(r if attn else {"expanded": r.expanded, "offsets": r.expert_offsets,
                                          "compact_tokens": r.compact_tokens})
try:
    run(3, expert, poison=True)
    mine["route_error"] = None
except afdep.RouteError as e:
    mine["route_error"] = (e.kind, e.rank, e.token, e.slot, str(e.value), e.reporter)
r = run(4, expert)
mine["rounds"].append(r if attn else None)
torch.save(mine, sys.argv[1])
