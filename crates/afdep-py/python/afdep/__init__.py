"""afdep from Python: the MoE layer as a PyTorch module.

``afdep.MoE`` is a ``torch.nn.Module`` whose parameters are ordinary ``torch.nn.Parameter``
objects; its forward and backward run afdep's layer through a ``torch.autograd.Function``:
CPU tensors on afdep-core's oracle (f32 math; float32 or bfloat16 tensors), CUDA tensors on
afdep-moe's GPU layer (bfloat16 tensors, read and written in place), queued on PyTorch's
current CUDA stream, and capturable with ``torch.cuda.graph`` after one eager step
(``afdep.CaptureError`` otherwise; ``afdep.unpin_layers`` releases what captures pinned).

Tensors reach the native module through DLPack (``torch.utils.dlpack.to_dlpack``): data
pointer, device, dtype, shape and strides are checked, and a non-contiguous tensor or a wrong
dtype is an exception naming the tensor. afdep's typed errors are exceptions with their fields
as attributes: ``afdep.RouteError`` (``kind``, ``rank``, ``token``, ``slot``, ``value``, ...),
``afdep.ConfigError`` (``field``, ``value``), ``afdep.GpuError``, ``afdep.CaptureError``, all
derived from ``afdep.AfdepError``.

``afdep.Exchange`` is one rank of the AFD exchange over a transport rendezvoused from the
environment, as under ``afdep launch``: the staged engine (``round(x, topk_idx, topk_weights,
experts)`` on CPU tensors, with afdep's SwiGLU or a Python callable as the FFN rank's experts)
or, with ``engine="fused"``, the fused engine over the nvlink transport on CUDA tensors, in
device rounds or CUDA-graph replays (``rounds="device"|"graph"``) queued on PyTorch's current
stream, its experts (``afdep.SwiGLU``, ``afdep.ScaleExperts``, ``"identity"``) on the device;
``afdep.exchange_oracle`` is afdep-core's reference of the same round.

``afdep.reference`` holds a plain-PyTorch implementation of the same function (the tests and
the training example compare against it).
"""

from ._native import (
    AfdepError,
    CaptureError,
    ConfigError,
    GpuError,
    RouteError,
    TimeoutError,
    TransportError,
)
from ._moe import MoE, moe, unpin_layers
from ._exchange import IDENTITY, Exchange, Received, ScaleExperts, SwiGLU, exchange_oracle

__all__ = [
    "AfdepError",
    "CaptureError",
    "ConfigError",
    "GpuError",
    "RouteError",
    "TimeoutError",
    "TransportError",
    "MoE",
    "moe",
    "unpin_layers",
    "Exchange",
    "Received",
    "SwiGLU",
    "ScaleExperts",
    "IDENTITY",
    "exchange_oracle",
]
