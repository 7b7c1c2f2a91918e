"""Type stubs of ``afdep._native``, the native part of afdep (PyO3, abi3). Use the package's
Python API (``afdep.MoE``, ``afdep.moe``, ``afdep.Exchange``); these are its building blocks.
Every tensor argument is a DLPack capsule (``torch.utils.dlpack.to_dlpack``) of a contiguous
tensor."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

Capsule = Any
ShapeTuple = Tuple[int, int, int, int, int, bool]
# a callable, ("swiglu", w1, w3, w2), ("scale", [one float per expert]) or ("identity",)
ExpertsArg = Union[Callable[[int, bytes, int], bytes], Tuple[Any, ...]]

class AfdepError(Exception):
    """The base of every afdep exception."""

class ConfigError(AfdepError):
    """An unusable layer shape or exchange config."""

    field: Optional[str]
    value: Optional[str]

class RouteError(AfdepError):
    """A rejected route (nothing ran; outputs are not returned).

    ``kind`` is one of duplicate, negative, wide, dummy, non_finite_logit, non_finite_weight, over_capacity,
    non_finite_payload, malformed; ``rank`` the attention rank (0 for the layer); the other
    attributes are None where the kind has no such field. ``reporter``: the exchange rank that
    raised it (exchange only)."""

    kind: str
    rank: int
    token: Optional[int]
    slot: Optional[int]
    value: Union[int, float, None]
    expert: Optional[int]
    first_slot: Optional[int]
    experts: Optional[int]
    owned: Optional[int]
    tokens: Optional[int]
    capacity: Optional[int]
    channel: Optional[int]
    what: Optional[str]
    reporter: int

class GpuError(AfdepError):
    """The GPU layer failed (no driver, a launch, an unsupported shape)."""

    device_fault: bool

class CaptureError(AfdepError):
    """A GPU step refused under CUDA graph capture: the layer has not run one eager step with
    its router yet (that step compiles the kernels and allocates the layer), or the routes are
    given (their check is read on the host)."""

class TimeoutError(AfdepError):
    """An exchange timed out: ``phase`` (the operation), ``rank`` (who waited), ``peer`` (who
    is late, None if unknown), ``round`` (device waits) or ``waited_s`` (transport waits)."""

    phase: str
    rank: Optional[int]
    peer: Optional[int]
    round: Optional[int]
    waited_s: float

class TransportError(AfdepError):
    """The exchange's transport failed: ``rank``, ``peer`` (None if unknown)."""

    rank: Optional[int]
    peer: Optional[int]

def layer_step(
    shape: ShapeTuple,
    x: Capsule,
    params: Sequence[Capsule],
    out: Capsule,
    topk_idx: Capsule,
    topk_weights: Capsule,
    given: bool,
    stream: int = 0,
    dispatch: str = "auto",
    dy: Optional[Capsule] = None,
    dx: Optional[Capsule] = None,
    grads: Optional[Sequence[Capsule]] = None,
) -> None:
    """One step of the MoE layer, writing ``out`` (and with ``dy``: ``dx`` and ``grads``, the
    gradients of ``sum(out * dy)``) in place.

    ``shape`` is (d_model, width, experts, top_k, shared, renormalize). ``x`` is [T, H];
    ``params`` the seven tensors wr [H, E], w1 [E, H, W], w3 [E, H, W], w2 [E, W, H],
    s1 [H, S], s3 [H, S], s2 [S, H]; ``topk_idx`` [T, K] int32 and ``topk_weights`` [T, K]
    float32 are read when ``given`` and written by the router otherwise. No tensor written
    may share memory with another argument. CPU tensors (float32 or bfloat16) run afdep-core's
    oracle; CUDA tensors (bfloat16) the GPU layer, which reads and writes them in place (a
    tensor whose address is not 256-byte aligned is copied instead), ordered on ``stream`` (a
    ``cudaStream_t`` as an int), with ``dispatch`` one of auto, sorted, gather, fused,
    fused_gsum. The tensors must stay alive and untouched until ``stream`` passes the step.
    When ``stream`` is capturing a CUDA graph the step is only queued (no host wait, no
    route error raised) on a layer that ran an eager step with its router before, which is
    then pinned (see ``unpin_layers``). Raises TypeError / ValueError naming the tensor
    (dtype, shape, contiguity, device, shared memory), ConfigError, RouteError, GpuError,
    CaptureError.
    """

MAX_LAYERS: int
"""GPU layers kept per device, pinned ones not counted (least recently used dropped first)."""

def unpin_layers(device: Optional[int] = None) -> int:
    """Unpins the GPU layers CUDA graph captures used (all devices when ``device`` is None),
    after waiting for each device that has some (all its streams), and trims the cache to
    ``MAX_LAYERS``; returns how many were pinned."""

def layer_cache(
    device: int,
) -> List[Tuple[ShapeTuple, int, str, bool, bool, bool]]:
    """The GPU layer cache of CUDA device ``device``, least recently used first: (shape,
    tokens, dispatch, train, warm, pinned); ``warm``: an eager step with the router ran."""

class ExchangeRank:
    """One rank of the AFD exchange (staged engine); see ``afdep.Exchange``."""

    def __init__(self, config_json: str) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def config_json(self) -> str: ...
    def round(
        self,
        x: Optional[Capsule],
        topk_idx: Optional[Capsule],
        topk_weights: Optional[Capsule],
        experts: ExpertsArg,
    ) -> Tuple[Optional[bytes], Optional[Dict[str, Any]]]: ...

class FusedRank:
    """One rank of the AFD exchange on the fused engine (nvlink transport); see
    ``afdep.Exchange(engine="fused")``. ``experts`` is a device expert: ("swiglu", w1, w3,
    w2), ("scale", scales) or ("identity",); ``rounds`` "device" or "graph" (one round of
    ``arm`` captured at construction); ``arm`` auto, payload-first, count-first or
    count-first-source."""

    def __init__(
        self, config_json: str, rounds: str, experts: ExpertsArg, arm: str = "auto"
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def config_json(self) -> str: ...
    @property
    def device(self) -> int:
        """This rank's CUDA device."""
    @property
    def rounds(self) -> str: ...
    @property
    def arm(self) -> str: ...
    @property
    def last_arm(self) -> str:
        """The arm the last round took."""
    def round(
        self,
        x: Optional[Capsule],
        topk_idx: Optional[Capsule],
        topk_weights: Optional[Capsule],
        out: Optional[Capsule],
        stream: int,
        wait: bool = True,
    ) -> None:
        """One round queued on ``stream`` (a ``cudaStream_t`` as an int): attention ranks pass
        capsules of CUDA tensors x [T, H] bf16, topk_idx [T, K] int32, topk_weights [T, K]
        float32 and out [T, H] bf16 (written); FFN ranks pass None. Waits on the host for the
        engine's stream once, for the round's verdict; with ``wait=False`` the verdict is read
        by the next round or ``finish`` (which raise its error)."""
    def finish(self) -> None:
        """Reads the verdict of a round queued with ``wait=False`` (raising its error)."""

def exchange_oracle(
    config_json: str, inputs: List[Tuple[Capsule, Capsule, Capsule]], experts: ExpertsArg
) -> List[bytes]:
    """afdep-core's exchange oracle: each attention rank's combined bf16 rows as bytes."""
