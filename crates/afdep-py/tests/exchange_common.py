"""The exchange test's problem, shared by the test and its rank processes: the config, each
attention rank's inputs (uneven token counts, a zero-token rank, masked slots, a hot
expert), and a Python expert callable."""

import torch

CONFIG = {
    "topology": "3A:2F",
    "hidden": 40,
    "experts": 8,
    "top_k": 3,
    "capacity": 64,
    "transport": {"kind": "tcp", "timeout_ms": 20000},
}
TOKENS = [13, 0, 29]  # per attention rank


def inputs(round_no: int, tokens=TOKENS, hidden=CONFIG["hidden"]):
    """(x, topk_idx, topk_weights) of every attention rank for round `round_no`, with
    `tokens[a]` tokens on attention rank a and rows of `hidden` channels."""
    out = []
    for a, t in enumerate(tokens):
        g = torch.Generator().manual_seed(1000 * round_no + a)
        x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
        e, k = CONFIG["experts"], CONFIG["top_k"]
        perms = [torch.randperm(e, generator=g)[:k] for _ in range(t)]
        idx = (torch.stack(perms) if t else torch.empty(0, k, dtype=torch.int64)).to(torch.int32)
        if t:
            idx[::2, 0] = 5  # expert 5 is hot: slot 0 of every other token
            dup = idx[::2, 1:] == 5
            idx[::2, 1:][dup] = -1  # (a token names an expert once: mask the repeat)
            idx[1::4, 2] = -1  # masked slots
        w = torch.rand(t, k, generator=g)
        out.append((x, idx.reshape(t, k).contiguous(), w))
    return out


def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A Python expert: any function of the expert id and the rows, returning bf16 rows."""
    r = rows.float()
    return (torch.tanh(r) * (e + 1) - 0.25 * r).to(torch.bfloat16)


def swiglu_weights():
    g = torch.Generator().manual_seed(77)
    e, h, w = CONFIG["experts"], CONFIG["hidden"], 24
    mk = lambda *s: (torch.rand(*s, generator=g) * 0.4 - 0.2).to(torch.bfloat16)  # noqa: E731
    return mk(e, h, w), mk(e, h, w), mk(e, w, h)
