"""``afdep.MoE`` and ``afdep.moe``: afdep's MoE layer as a torch module and a function."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.utils.dlpack import to_dlpack

from . import _native

PARAM_NAMES = ("wr", "w1", "w3", "w2", "s1", "s3", "s2")
"""The layer's parameters, in the order the native module takes them."""

ShapeTuple = Tuple[int, int, int, int, int, bool]


def _cap(t: torch.Tensor):
    """A DLPack capsule of ``t`` (no copy; non-contiguous tensors are refused natively)."""
    return to_dlpack(t.detach())


def _stream(x: torch.Tensor) -> int:
    """PyTorch's current CUDA stream on ``x``'s device as an integer (0 for CPU tensors).

    Under ``torch.cuda.graph`` this is the capturing stream: the native step sees the capture
    on it and only queues its work (see :class:`MoE`)."""
    if not x.is_cuda:
        return 0
    return torch.cuda.current_stream(x.device).cuda_stream


class _MoEFunction(torch.autograd.Function):
    """Forward: the layer step; backward: the train step (which recomputes the forward).

    Outputs are allocated here with torch (under capture: in the graph's memory pool) and
    written in place by the native step; nothing here waits on the host."""

    @staticmethod
    def forward(ctx, shape, dispatch, x, topk_idx, topk_weights, *params):
        stream = _stream(x)
        t, k = x.shape[0], shape[3]
        given = topk_idx is not None
        if given != (topk_weights is not None):
            raise ValueError("topk_idx and topk_weights are given together or not at all")
        out = torch.empty_like(x)
        if given:
            idx, w = topk_idx, topk_weights
        else:
            idx = torch.empty((t, k), dtype=torch.int32, device=x.device)
            w = torch.empty((t, k), dtype=torch.float32, device=x.device)
        if t > 0:
            _native.layer_step(
                shape,
                _cap(x),
                [_cap(p) for p in params],
                _cap(out),
                _cap(idx),
                _cap(w),
                given,
                stream,
                dispatch,
            )
        ctx.shape, ctx.dispatch, ctx.given = shape, dispatch, given
        ctx.save_for_backward(x, idx, w, *params)
        if not given:
            ctx.mark_non_differentiable(idx, w)
        return out, idx, w

    @staticmethod
    def backward(ctx, dout, _didx, _dw):
        x, idx, w, *params = ctx.saved_tensors
        dx = torch.empty_like(x)
        grads = [torch.empty_like(p) for p in params]
        if x.shape[0] == 0 or dout is None:
            dx.zero_()
            for g in grads:
                g.zero_()
        else:
            out = torch.empty_like(x)
            # the train step writes the router's routes again: give it scratch copies
            ridx, rw = (idx, w) if ctx.given else (torch.empty_like(idx), torch.empty_like(w))
            _native.layer_step(
                ctx.shape,
                _cap(x),
                [_cap(p) for p in params],
                _cap(out),
                _cap(ridx),
                _cap(rw),
                ctx.given,
                _stream(x),
                ctx.dispatch,
                dy=_cap(dout.contiguous()),
                dx=_cap(dx),
                grads=[_cap(g) for g in grads],
            )
        return (None, None, dx, None, None, *grads)


def moe(
    x: torch.Tensor,
    params,
    shape: ShapeTuple,
    topk_idx: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    dispatch: str = "auto",
):
    """afdep's MoE layer as a differentiable function.

    Args:
        x: tokens, ``[T, d_model]``, contiguous; float32 or bfloat16 on the CPU, bfloat16 on CUDA
            (capturable in a CUDA graph: see :class:`MoE`).
        params: the seven tensors ``wr [H, E]``, ``w1 [E, H, W]``, ``w3 [E, H, W]``,
            ``w2 [E, W, H]``, ``s1 [H, S]``, ``s3 [H, S]``, ``s2 [S, H]``, of x's dtype and device.
        shape: ``(d_model, width, experts, top_k, shared, renormalize)``.
        topk_idx, topk_weights: given routes (``[T, K]`` int32, ``-1`` masks a slot; ``[T, K]``
            float32): validated (``afdep.RouteError``), constants for the gradient. Without
            them the layer's router routes (softmax, top-K, renormalised) and is differentiated.
        dispatch: the GPU dispatch strategy: ``auto``, ``sorted``, ``gather``, ``fused``,
            ``fused_gsum``.

    Returns:
        ``(out, topk_idx, topk_weights)``: the output ``[T, d_model]`` and the routes used.
    """
    return _MoEFunction.apply(
        tuple(shape), dispatch, x, topk_idx, topk_weights, *params
    )


def unpin_layers(device: Optional[int] = None) -> int:
    """Releases the GPU layers that ``torch.cuda.graph`` captures of afdep steps pinned.

    A captured graph refers to the device buffers of the layers it used, so those stay
    allocated (outside the cache's bound of ``afdep._native.MAX_LAYERS`` layers per device)
    until this is called: call it once those graphs are destroyed (after it, replaying one is
    undefined). It waits for each device that has pinned layers (all its streams), so replays
    launched before it may still be running. ``device`` is a CUDA ordinal (all devices when
    None). Returns how many layers were pinned."""
    return _native.unpin_layers(device)


class MoE(torch.nn.Module):
    """A dropless MoE layer (router, ``experts`` SwiGLU experts, top-K, optional shared expert).

    ``out = sum_k w_k * SwiGLU_{e_k}(x) + SharedSwiGLU(x)`` per token, with the router
    ``softmax(x @ wr)``, its top-K experts ``e_k`` and weights ``w_k`` (renormalised to sum to
    one unless ``renormalize=False``), ``SwiGLU_e(x) = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``.

    The parameters (``wr``, ``w1``, ``w3``, ``w2``, ``s1``, ``s3``, ``s2``) are plain
    ``torch.nn.Parameter`` objects: any optimizer, ``state_dict``, ``.to(device, dtype)``. On
    the CPU the layer runs afdep's oracle (float32 or bfloat16), on CUDA afdep's GPU layer
    (bfloat16; ``d_model``, ``width`` and ``shared`` multiples of 8, any ``experts`` and
    ``top_k <= experts`` within the kernels' limits, any token count including 0). The GPU
    layer reads and writes the torch tensors in place (no copies), queued on PyTorch's current
    stream; an eager step then waits once on the host to read the route check (to raise
    :class:`afdep.RouteError`).

    CUDA graphs: forward and backward can be captured with ``torch.cuda.graph`` and replayed
    after copying new inputs into the static tensors, provided one eager forward and backward
    step with the same shapes ran first (it compiles the kernels and allocates the layer's
    buffers; a capture without it raises :class:`afdep.CaptureError`). Under capture the layer's
    router must route (given ``topk_idx``/``topk_weights`` raise ``CaptureError``: their check
    is read on the host), and no route error is raised: a token with a non-finite router logit
    gets ``-1`` ids (``return_routes=True`` shows them) and no routed expert. The GPU layers a
    capture used stay allocated (pinned) until :func:`afdep.unpin_layers` is called after the
    graphs are destroyed; replays and eager steps of the same shapes must be ordered on the
    device (the same stream, as for any tensors a graph shares).

    Args:
        d_model: H, the token width.
        width: W, each expert's hidden width.
        experts: E, the number of routed experts.
        top_k: K, experts per token.
        shared: S, the shared expert's hidden width (0: none).
        dispatch: the GPU dispatch strategy (see :func:`afdep.moe`).
        renormalize: renormalise the top-K probabilities (default True).
    """

    def __init__(
        self,
        d_model: int,
        width: int,
        experts: int,
        top_k: int,
        shared: int = 0,
        dispatch: str = "auto",
        renormalize: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.shape: ShapeTuple = (d_model, width, experts, top_k, shared, renormalize)
        self.dispatch = dispatch
        h, w, e, s = d_model, width, experts, shared
        dims = {
            "wr": (h, e),
            "w1": (e, h, w),
            "w3": (e, h, w),
            "w2": (e, w, h),
            "s1": (h, s),
            "s3": (h, s),
            "s2": (s, h),
        }
        kw = {"device": device, "dtype": dtype}
        for name in PARAM_NAMES:
            self.register_parameter(name, torch.nn.Parameter(torch.empty(dims[name], **kw)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(fan_in)`` (fan_in: H for wr, w1, w3, s1, s3; W for w2; S for s2)."""
        h, w, _, _, s, _ = self.shape
        fan = {"wr": h, "w1": h, "w3": h, "w2": w, "s1": h, "s3": h, "s2": max(s, 1)}
        with torch.no_grad():
            for name in PARAM_NAMES:
                b = 1.0 / math.sqrt(fan[name])
                getattr(self, name).uniform_(-b, b)

    def params(self):
        """The seven parameters in the native order."""
        return [getattr(self, n) for n in PARAM_NAMES]

    def forward(
        self,
        x: torch.Tensor,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        return_routes: bool = False,
    ):
        """The layer on ``x`` of shape ``[..., d_model]`` (flattened to tokens, contiguous).

        With ``topk_idx``/``topk_weights`` (``[T, K]`` int32 / float32, T the flattened token
        count) the routes are given instead of routed. ``return_routes`` also returns them.
        """
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        out, idx, w = moe(flat, self.params(), self.shape, topk_idx, topk_weights, self.dispatch)
        out = out.reshape(*lead, x.shape[-1])
        return (out, idx, w) if return_routes else out

    def extra_repr(self) -> str:
        h, w, e, k, s, r = self.shape
        return (
            f"d_model={h}, width={w}, experts={e}, top_k={k}, shared={s}, "
            f"renormalize={r}, dispatch={self.dispatch!r}"
        )
