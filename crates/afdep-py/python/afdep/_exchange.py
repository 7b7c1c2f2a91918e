"""``afdep.Exchange``: one rank of the AFD exchange from Python: afdep's staged engine (CPU
tensors, any transport, Python expert callables) or its fused engine (CUDA tensors over the
nvlink transport, device rounds or CUDA-graph replays, experts on the device)."""

from __future__ import annotations

import ctypes
import json
import os
import tomllib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.dlpack import to_dlpack

from . import _native

ExpertCallable = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class SwiGLU:
    """afdep's SwiGLU experts on an FFN rank: ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``
    (f32 math, bf16 rows out: afdep-core's ``expert_rows``). ``w1``, ``w3``: ``[E, H, W]``,
    ``w2``: ``[E, W, H]``, bfloat16 CPU tensors over all E experts (global ids)."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor

    def _native(self):
        # the weights are read once (staged engine and oracle: every round; fused engine: at
        # construction, then uploaded to the device); CUDA weights are read through a CPU copy
        ws = [w.detach().cpu().contiguous() for w in (self.w1, self.w3, self.w2)]
        return ("swiglu", *(to_dlpack(w) for w in ws))


@dataclass
class ScaleExperts:
    """Experts that scale their rows: expert ``e`` maps a row ``x`` to
    ``bf16(f32(x) * scales[e])`` (one rounding, bit-reproducible on the CPU and the GPU).
    ``scales``: one finite float per global expert. The fused engine's exchange tests and
    latency runs use them; any engine and :func:`exchange_oracle` take them."""

    scales: Sequence[float]

    def _native(self):
        return ("scale", [float(s) for s in self.scales])


IDENTITY = "identity"
"""Experts that return their rows unchanged (the fused engine runs no expert kernel: a round
is the exchange alone)."""


@dataclass
class Received:
    """What an FFN rank received in a round.

    Attributes:
        expanded: the expanded rows ``[rows, H]`` bf16, grouped by local expert.
        expert_offsets: row offsets of each local expert's group (``len = local + 1``).
        compact_tokens: ``[n, 2]`` int64: (source rank index, token) of each compact row.
        compact_x: ``[n, H]`` bf16: one row per token.
        compact_ids: ``[n, K]`` int32 local expert ids (``-1`` elsewhere or masked).
        compact_weights: ``[n, K]`` float32 (0 where the id is -1).
    """

    expanded: torch.Tensor
    expert_offsets: List[int]
    compact_tokens: torch.Tensor
    compact_x: torch.Tensor
    compact_ids: torch.Tensor
    compact_weights: torch.Tensor


def _bf16_rows(data: bytes, hidden: int) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty((0, hidden), dtype=torch.bfloat16)
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(-1, hidden)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


Experts = Union[ExpertCallable, SwiGLU, ScaleExperts, str]


def _native_experts(experts: Experts, hidden: int):
    if isinstance(experts, (SwiGLU, ScaleExperts)):
        return experts._native()
    if isinstance(experts, str):
        if experts != IDENTITY:
            raise ValueError(f"experts {experts!r}: the only named experts are {IDENTITY!r}")
        return (IDENTITY,)
    if callable(experts):
        return _wrap_callable(experts, hidden)
    raise TypeError(
        f"experts: a {type(experts).__name__}; expected afdep.SwiGLU, afdep.ScaleExperts, "
        f"{IDENTITY!r} or a callable fn(expert_id, rows) -> rows"
    )


def _wrap_callable(fn: ExpertCallable, hidden: int):
    def call(expert: int, data: bytes, n: int) -> bytes:
        rows = _bf16_rows(data, hidden)
        y = fn(expert, rows)
        if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or y.device.type != "cpu":
            raise TypeError(
                f"expert {expert}: the callable must return a bfloat16 CPU tensor, got "
                f"{type(y).__name__} {getattr(y, 'dtype', '')}"
            )
        if tuple(y.shape) != (n, hidden):
            raise ValueError(f"expert {expert}: returned shape {tuple(y.shape)}, want {(n, hidden)}")
        return _tensor_bytes(y)

    return call


def load_config(config: Union[dict, str, os.PathLike]) -> dict:
    """The config dict: a dict as is, or a ``.toml``/``.json`` file of ``afdep exchange --config``."""
    if isinstance(config, dict):
        return dict(config)
    path = os.fspath(config)
    with open(path, "rb") as f:
        text = f.read()
    if path.endswith(".toml") or not text.lstrip().startswith(b"{"):
        return tomllib.loads(text.decode())
    return json.loads(text)


class Exchange:
    """One rank of the AFD exchange.

    Built from the same config as ``afdep exchange --config FILE`` (a dict or that file:
    ``topology`` such as ``"2A:1F"``, ``hidden``, ``experts``, ``top_k``, ``capacity``, optional
    ``experts_per_rank``, ``payload`` (``bf16`` | ``fp8_e4m3``), ``partials`` (``f32`` |
    ``bf16``: the combine's partials, bf16 halves their bytes and is not bit-identical to
    f32), ``knobs``, ``transport``
    (``loopback`` | ``tcp`` | ``nvlink`` | ... or a table with ``kind``, ``timeout_ms``,
    ``device``, ...; default ``tcp``, ``nvlink`` for the fused engine)). The rank, world size
    and rendezvous come from ``AFDEP_RANK``, ``AFDEP_WORLD_SIZE`` and ``AFDEP_RENDEZVOUS``, as
    ``afdep launch`` sets them; one rank per process. Construction is collective.

    ``engine="staged"`` (default): afdep's staged engine over any transport, on CPU tensors;
    the FFN rank's experts are given to each :meth:`round` (a Python callable among them).

    ``engine="fused"``: afdep's fused engine over the ``nvlink`` transport (GPU-initiated
    stores into the peers' device memory; ranks on one GPU or one per GPU, connected through
    CUDA IPC), on CUDA tensors of the rank's device. ``rounds="device"`` (default) runs each
    round as a device round (every kernel launched, no host step between them);
    ``rounds="graph"`` captures one round in a CUDA graph at construction and replays it each
    round with the new rows and routes (the token count may change from round to round, up
    to ``capacity``). ``arm``: ``auto`` (chosen on the device each round, the same on every
    rank), ``payload-first``, ``count-first`` or ``count-first-source``; the same on every
    rank. ``experts`` (required, the same on every rank; applied on the device by the FFN
    ranks): :class:`SwiGLU` (hidden size and width multiples of 8; within bf16 tolerances of
    the oracle), :class:`ScaleExperts` or ``"identity"`` (both bit-identical to the oracle).
    Each round is queued on PyTorch's current CUDA stream: the rows and routes are read from
    the tensors and the combined rows written into the output tensor on the device (copied
    device to device into and out of the round's fixed buffers), with the engine's stream
    ordered after the caller's by CUDA events; the host waits once per round for the engine's
    stream, to read the round's verdict (a rejected route raises on every rank), unless
    ``round(..., wait=False)`` defers that read (:meth:`round`, :meth:`synchronize`). Rounds
    cannot be captured by ``torch.cuda.graph`` (``afdep.CaptureError``; ``rounds="graph"`` is
    afdep's own capture).

    Raises (construction): ``ValueError`` / ``TypeError`` for bad arguments and
    ``afdep.ConfigError`` for a bad config (both before connecting), ``afdep.TransportError``
    / ``afdep.TimeoutError`` when the ranks cannot connect, ``afdep.AfdepError`` from the
    engine's set-up.
    """

    def __init__(
        self,
        config: Union[dict, str, os.PathLike],
        engine: str = "staged",
        rounds: Optional[str] = None,
        experts: Optional[Experts] = None,
        arm: str = "auto",
    ):
        cfg = load_config(config)
        if engine == "staged":
            if rounds is not None or experts is not None or arm != "auto":
                raise ValueError(
                    "rounds, experts and arm are the fused engine's (engine=\"fused\"); the "
                    "staged engine takes its experts in round()"
                )
            self._rank = _native.ExchangeRank(json.dumps(cfg))
        elif engine == "fused":
            if experts is None:
                raise ValueError(
                    "engine=\"fused\" needs experts at construction: afdep.SwiGLU, "
                    "afdep.ScaleExperts or \"identity\" (applied on the device)"
                )
            cfg.setdefault("transport", "nvlink")
            ex = _native_experts(experts, cfg.get("hidden", 0))
            self._rank = _native.FusedRank(json.dumps(cfg), rounds or "device", ex, arm)
        else:
            raise ValueError(f"engine {engine!r}: expected \"staged\" or \"fused\"")
        self.engine: str = engine
        self.config: dict = json.loads(self._rank.config_json)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank.rank

    @property
    def role(self) -> str:
        """``"attention"`` or ``"ffn"``."""
        return self._rank.role

    @property
    def rounds(self) -> Optional[str]:
        """The fused engine's ``"device"`` or ``"graph"``; None for the staged engine."""
        return self._rank.rounds if self.engine == "fused" else None

    @property
    def last_arm(self) -> Optional[str]:
        """The fused engine: the arm the last round took (``payload_first``, ``count_first``,
        ``count_first_source``); None for the staged engine."""
        return self._rank.last_arm if self.engine == "fused" else None

    def round(
        self,
        x: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        experts: Optional[Experts] = None,
        out: Optional[torch.Tensor] = None,
        wait: bool = True,
    ) -> Union[torch.Tensor, Received, None]:
        """One round (collective: every rank calls it).

        Attention ranks pass ``x`` (``[T, hidden]`` bf16), ``topk_idx`` (``[T, K]`` int32,
        global expert ids, ``-1`` masks a slot) and ``topk_weights`` (``[T, K]`` float32) and
        get the combined rows ``[T, hidden]`` bf16.

        Staged engine: CPU tensors; FFN ranks pass ``experts``: a :class:`SwiGLU`,
        :class:`ScaleExperts`, ``"identity"`` or a callable ``fn(expert_id, rows) -> rows``
        called once per local expert with its ``[n, hidden]`` bf16 expanded rows; they get a
        :class:`Received`.

        Fused engine: contiguous CUDA tensors of this rank's device, on PyTorch's current
        stream; the combined rows are written into ``out`` (``[T, hidden]`` bf16 on that
        device, sharing no memory with the inputs; allocated when None) and returned once
        queued. FFN ranks pass nothing and get None (their experts were given at
        construction). A rank whose tensors fail the checks still joins the round without
        input, so that every other rank's round is rejected (``afdep.RouteError`` of kind
        ``over_capacity`` naming it) instead of waiting, then raises its ``TypeError`` /
        ``ValueError``. The host waits for the round once, to read its verdict; with
        ``wait=False`` it does not: the round is only queued, the rows are ready when the stream
        passes it, and the verdict is read by the next ``round()`` (before it queues anything:
        it then raises the earlier round's error instead, on every rank alike) or by
        :meth:`synchronize`; a rejected round's rows read NaN.

        Raises:
            afdep.RouteError: a route was rejected on some attention rank (every rank raises
                it with the lowest rejecting rank's ``rank``, ``token``, ``slot``, ``value``;
                ``reporter`` is this rank; the engine stays usable; the fused engine's
                ``out`` then holds NaN).
            afdep.TimeoutError: a peer did not answer (``phase``, ``rank``, ``peer``).
            afdep.TransportError: the transport failed.
            afdep.CaptureError: (fused) the current stream is capturing a CUDA graph.
        """
        if self.engine == "fused":
            return self._fused_round(x, topk_idx, topk_weights, experts, out, wait)
        if out is not None or not wait:
            raise ValueError(
                "out and wait are the fused engine's (the staged engine returns new rows)"
            )
        h = self.config["hidden"]
        if self.role == "ffn":
            if experts is None:
                raise ValueError(
                    "an FFN rank needs `experts` (a callable, afdep.SwiGLU, afdep.ScaleExperts "
                    "or \"identity\")"
                )
            ex = _native_experts(experts, h)
        else:
            ex = lambda *_: b""  # noqa: E731  (attention ranks apply no experts)
        caps = [to_dlpack(t) if t is not None else None for t in (x, topk_idx, topk_weights)]
        combined, received = self._rank.round(*caps, ex)
        if combined is not None:
            return _bf16_rows(combined, h)
        return _received(received, h, self.config["top_k"])

    def synchronize(self) -> None:
        """The fused engine: reads the verdict of the last round queued with ``wait=False``
        (one host wait for the engine's stream), raising its error (``afdep.RouteError``,
        ...); nothing when none is pending. The staged engine: nothing (its rounds are done
        when they return)."""
        if self.engine == "fused":
            self._rank.finish()

    def _fused_round(self, x, topk_idx, topk_weights, experts, out, wait):
        if experts is not None:
            raise ValueError("engine=\"fused\" takes its experts at construction, not per round")
        tensors = (x, topk_idx, topk_weights)
        if out is None and isinstance(x, torch.Tensor) and x.dim() == 2:
            out = torch.empty(
                (x.shape[0], self.config["hidden"]), dtype=torch.bfloat16, device=x.device
            )
        caps = [to_dlpack(t) if t is not None else None for t in (*tensors, out)]
        stream = torch.cuda.current_stream(self._rank.device).cuda_stream
        # the tensors stay referenced (`caps`, `tensors`, `out`) until the call returns; the
        # round is joined onto `stream`, on which torch orders their reuse
        self._rank.round(*caps, stream, wait)
        return out if self.role == "attention" else None


def _received(d: dict, hidden: int, k: int) -> Received:
    return Received(
        expanded=_bf16_rows(d["expanded"], hidden),
        expert_offsets=list(d["expert_offsets"]),
        compact_tokens=torch.tensor(d["compact_tokens"], dtype=torch.int64).view(-1, 2),
        compact_x=_bf16_rows(d["compact_x"], hidden),
        compact_ids=torch.tensor(d["compact_ids"], dtype=torch.int32).view(-1, k),
        compact_weights=torch.tensor(d["compact_weights"], dtype=torch.float32).view(-1, k),
    )


def exchange_oracle(
    config: Union[dict, str, os.PathLike],
    inputs: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    experts: Experts,
) -> List[torch.Tensor]:
    """afdep-core's reference of one round: each attention rank's combined rows, from every
    attention rank's ``(x, topk_idx, topk_weights)`` (CPU tensors): bit-identical to
    :class:`Exchange`'s staged engine, and to its fused engine with :class:`ScaleExperts` or
    ``"identity"`` (within bf16 tolerances with :class:`SwiGLU`)."""
    cfg = load_config(config)
    h = cfg["hidden"]
    ex = _native_experts(experts, h)
    caps = [tuple(to_dlpack(t) for t in inp) for inp in inputs]
    return [_bf16_rows(b, h) for b in _native.exchange_oracle(json.dumps(cfg), caps, ex)]
