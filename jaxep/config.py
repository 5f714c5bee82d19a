"""`jaxep.Config`: the frozen, validated settings of one EP communication setup."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

_DTYPES = ("bfloat16", "float16", "float32")
_MODES = ("normal", "low_latency")


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jaxep.Config: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"jaxep.Config: {name} must be >= {lo}, got {value}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings shared by `jaxep.dispatch` and `jaxep.combine` (hashable; passed as static data).

    Args:
      num_experts: E, experts in the whole model; must be divisible by the EP size.
      topk: K, experts per token.
      hidden: H, the payload width.
      max_tokens_per_rank: the largest T (tokens per rank) a call may pass.
      capacity_factor: receive capacity per rank = ceil(capacity_factor * max_tokens_per_rank * topk),
        the expected rows per rank under uniform routing times this factor (capped at the no-drop
        worst case). `None` means "never drop": capacity = ep_size * max_tokens_per_rank * topk.
      recv_capacity: explicit receive rows per rank; wins over `capacity_factor` when given.
      dtype: payload dtype the buffers are sized for ("bfloat16", "float16", "float32").
      mode: "normal" (throughput) or "low_latency" (decode; not implemented yet).
      num_sms: SMs the CUDA kernels may use; None picks the recommended default for the EP size.
      chunk_tokens: tokens per chunk in the CUDA pipeline; None picks the default.
      timeout_s: bound on every device-side wait of the CUDA backend.
    """

    num_experts: int
    topk: int
    hidden: int
    max_tokens_per_rank: int
    capacity_factor: float | None = 1.25
    recv_capacity: int | None = None
    dtype: str = "bfloat16"
    mode: str = "normal"
    num_sms: int | None = None
    chunk_tokens: int | None = None
    timeout_s: float = 100.0

    def __post_init__(self):
        _check_int("num_experts", self.num_experts, 1)
        _check_int("topk", self.topk, 1)
        _check_int("hidden", self.hidden, 1)
        _check_int("max_tokens_per_rank", self.max_tokens_per_rank, 1)
        if self.topk > self.num_experts:
            raise ValueError(
                f"jaxep.Config: topk must be <= num_experts={self.num_experts}, got {self.topk}")
        if self.capacity_factor is not None:
            if not isinstance(self.capacity_factor, (int, float)) or not (
                    math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
                raise ValueError("jaxep.Config: capacity_factor must be a finite number > 0 or None, "
                                 f"got {self.capacity_factor!r}")
        if self.recv_capacity is not None:
            _check_int("recv_capacity", self.recv_capacity, 1)
        if self.dtype not in _DTYPES:
            raise ValueError(f"jaxep.Config: dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.mode not in _MODES:
            raise ValueError(f"jaxep.Config: mode must be one of {_MODES}, got {self.mode!r}")
        if self.num_sms is not None:
            _check_int("num_sms", self.num_sms, 1)
        if self.chunk_tokens is not None:
            _check_int("chunk_tokens", self.chunk_tokens, 1)
        if not isinstance(self.timeout_s, (int, float)) or not (0 < self.timeout_s < 86400):
            raise ValueError(f"jaxep.Config: timeout_s must be in (0, 86400), got {self.timeout_s!r}")

    def local_experts(self, ep_size: int) -> int:
        """L = num_experts / ep_size; raises when the experts do not divide evenly."""
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(
                f"jaxep: num_experts must be divisible by the EP size: expected num_experts % "
                f"{ep_size} == 0, got num_experts={self.num_experts}")
        return self.num_experts // ep_size

    def no_drop_capacity(self, ep_size: int) -> int:
        """The worst case: every token of every rank sends all K slots here."""
        return ep_size * self.max_tokens_per_rank * self.topk

    def capacity(self, ep_size: int) -> int:
        """C, the receive rows per rank for this EP size (static)."""
        self.local_experts(ep_size)
        worst = self.no_drop_capacity(ep_size)
        if self.recv_capacity is not None:
            return self.recv_capacity
        if self.capacity_factor is None:
            return worst
        c = math.ceil(self.capacity_factor * self.max_tokens_per_rank * self.topk)
        c = -(-c // 8) * 8  # a multiple of 8 rows keeps row blocks aligned
        return min(c, worst)
