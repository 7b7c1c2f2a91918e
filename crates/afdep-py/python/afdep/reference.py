"""A plain-PyTorch MoE of the same function as ``afdep.MoE`` (no afdep code): the tests and
the training example compare afdep against it. Math in float32, one cast to x's dtype."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def moe_reference(
    x: torch.Tensor,
    params,
    shape,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
):
    """``(out, topk_idx, topk_weights)`` of the layer with torch ops (autograd gives the
    gradients; the top-K choice is not differentiated, the weights are)."""
    wr, w1, w3, w2, s1, s3, s2 = (p.float() for p in params)
    _, _, e, k, s, renorm = shape
    xf = x.float()
    if topk_idx is None:
        p = torch.softmax(xf @ wr, dim=-1)
        w, idx = torch.topk(p, k, dim=-1)
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        idx, w = topk_idx.long(), topk_weights.float()
    out = torch.zeros_like(xf)
    for ex in range(e):
        rows, slots = (idx == ex).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = xf[rows]
        y = (F.silu(xe @ w1[ex]) * (xe @ w3[ex])) @ w2[ex]
        out = out.index_add(0, rows, y * w[rows, slots].unsqueeze(-1))
    if s > 0:
        out = out + (F.silu(xf @ s1) * (xf @ s3)) @ s2
    return out.to(x.dtype), idx.to(torch.int32), w


class ReferenceMoE(torch.nn.Module):
    """``afdep.MoE``'s parameters and function in plain PyTorch."""

    def __init__(self, like) -> None:
        """A copy of ``like`` (an ``afdep.MoE``): same shape and initial weights."""
        super().__init__()
        self.shape = like.shape
        for name in ("wr", "w1", "w3", "w2", "s1", "s3", "s2"):
            self.register_parameter(
                name, torch.nn.Parameter(getattr(like, name).detach().clone())
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        params = [getattr(self, n) for n in ("wr", "w1", "w3", "w2", "s1", "s3", "s2")]
        out, _, _ = moe_reference(flat, params, self.shape)
        return out.reshape(*lead, x.shape[-1])
