"""``afdep.Exchange``: one rank of the AFD exchange (afdep's staged engine) from Python."""

from __future__ import annotations

import ctypes
import json
import os
import tomllib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

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
        return ("swiglu", to_dlpack(self.w1), to_dlpack(self.w3), to_dlpack(self.w2))


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
    """One rank of the AFD exchange over afdep's staged engine.

    Built from the same config as ``afdep exchange --config FILE`` (a dict or that file:
    ``topology`` such as ``"2A:1F"``, ``hidden``, ``experts``, ``top_k``, ``capacity``, optional
    ``experts_per_rank``, ``payload`` (``bf16`` | ``fp8_e4m3``), ``knobs``, ``transport``
    (``loopback`` | ``tcp`` | ... or a table with ``kind`` and ``timeout_ms``; default ``tcp``)).
    The rank, world size and rendezvous come from ``AFDEP_RANK``, ``AFDEP_WORLD_SIZE`` and
    ``AFDEP_RENDEZVOUS``, as ``afdep launch`` sets them. Construction is collective.
    """

    def __init__(self, config: Union[dict, str, os.PathLike]):
        self._rank = _native.ExchangeRank(json.dumps(load_config(config)))
        self.config: dict = json.loads(self._rank.config_json)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank.rank

    @property
    def role(self) -> str:
        """``"attention"`` or ``"ffn"``."""
        return self._rank.role

    def round(
        self,
        x: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        experts: Union[ExpertCallable, SwiGLU, None] = None,
    ) -> Union[torch.Tensor, Received]:
        """One round (collective: every rank calls it).

        Attention ranks pass ``x`` (``[T, hidden]`` bf16), ``topk_idx`` (``[T, K]`` int32,
        global expert ids, ``-1`` masks a slot) and ``topk_weights`` (``[T, K]`` float32), CPU
        tensors, and get the combined rows ``[T, hidden]`` bf16. FFN ranks pass ``experts``:
        a :class:`SwiGLU`, or a callable ``fn(expert_id, rows) -> rows`` called once per local
        expert with its ``[n, hidden]`` bf16 expanded rows; they get a :class:`Received`.

        Raises:
            afdep.RouteError: a route was rejected on some attention rank (every rank raises
                it; ``reporter`` is this rank; the engine stays usable).
            afdep.TimeoutError: a peer did not answer (``phase``, ``rank``, ``peer``).
            afdep.TransportError: the transport failed.
        """
        h = self.config["hidden"]
        if self.role == "ffn":
            if experts is None:
                raise ValueError("an FFN rank needs `experts` (a callable or afdep.SwiGLU)")
            ex = experts._native() if isinstance(experts, SwiGLU) else _wrap_callable(experts, h)
        else:
            ex = lambda *_: b""  # noqa: E731  (attention ranks apply no experts)
        caps = [to_dlpack(t) if t is not None else None for t in (x, topk_idx, topk_weights)]
        combined, received = self._rank.round(*caps, ex)
        if combined is not None:
            return _bf16_rows(combined, h)
        return _received(received, h, self.config["top_k"])


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
    experts: Union[ExpertCallable, SwiGLU],
) -> List[torch.Tensor]:
    """afdep-core's reference of one round: each attention rank's combined rows, from every
    attention rank's ``(x, topk_idx, topk_weights)`` (bit-identical to :class:`Exchange`)."""
    cfg = load_config(config)
    h = cfg["hidden"]
    ex = experts._native() if isinstance(experts, SwiGLU) else _wrap_callable(experts, h)
    caps = [tuple(to_dlpack(t) for t in inp) for inp in inputs]
    return [_bf16_rows(b, h) for b in _native.exchange_oracle(json.dumps(cfg), caps, ex)]
