"""`jaxep.Config`: the frozen, validated settings of one EP communication setup.

Config is the one home of jaxep's settings (docs/design.md): every knob that changes what the
kernels do is a field here, reaches the CUDA custom calls as an FFI attribute (so it is in the HLO,
in the jit cache key, and checked equal on every rank by `jaxep.initialize`), and does something
measurable. No environment variable changes what jaxep computes or how.

The names below are THE Python definition of what the CUDA extension accepts; when the extension
is loaded, `jaxep._ffi` checks they equal its own lists (`_jaxep_cuda.constants()`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# Payload dtypes of x / y (what the kernels move); written once, imported by the ops, _ffi, bench.
PAYLOAD_DTYPES = ("bfloat16", "float16", "float32")
# Modes of SPEC.md section 3; only those in BUILT_MODES run, the others raise at construction.
MODES = ("normal", "low_latency")
BUILT_MODES = ("normal",)
# Kernel variants (same bits, different speed; docs/design.md). The first of each is the default.
DISPATCH_KERNELS = ("token", "row")    # multi-rank dispatch pull: warp per (source, token) | per row
COMBINE_KERNELS = ("warp", "thread")   # multi-rank combine pull: warp per token | thread per 16 B


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jaxep.Config: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"jaxep.Config: {name} must be >= {lo}, got {value}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"jaxep.Config: {name} must be one of {choices}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"jaxep.Config: {name} must be a bool (True or False), got "
                        f"{type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings shared by `jaxep.dispatch` and `jaxep.combine` (hashable; passed as static data).

    Sizes (they decide shapes and the buffers `jaxep.initialize` allocates):
      num_experts: E, experts in the whole model; must be divisible by the EP size.
      topk: K, experts per token.
      hidden: H, the payload width.
      max_tokens_per_rank: the largest T (tokens per rank) a call may pass.
      capacity_factor: receive capacity per rank = ceil(capacity_factor * max_tokens_per_rank * topk),
        the expected rows per rank under uniform routing times this factor (capped at the no-drop
        worst case). `None` means "never drop": capacity = ep_size * max_tokens_per_rank * topk.
      recv_capacity: explicit receive rows per rank; wins over `capacity_factor` when given.
      dtype: payload dtype the buffers are sized for (one of `PAYLOAD_DTYPES`).
      mode: "normal" (throughput: training and prefill). "low_latency" (decode) is not built yet
        and raises here rather than silently running "normal".

    Tuning knobs of the CUDA backend (the reference backend ignores them; results are bitwise the
    same for every value, only the speed changes):
      num_sms: cap on the thread blocks of the row-moving kernels (gather, pull, stage, combine):
        at most num_sms * 4 blocks per call. None (recommended) = no cap, as many blocks as the
        work needs; set it to leave SMs to overlapping compute (e.g. 16-32 on an H200).
      dispatch_kernel: the multi-rank dispatch pull, "token" (recommended: a warp per (source
        rank, token) reads the token's row once and stores it to every row it fills here) or
        "row" (a warp per received row: a token's row is read once per local expert it chose,
        about 15 % slower at 8 ranks, E = 64). Topk > 32 always runs "row". EP size 1 ignores it.
      combine_kernel: the multi-rank combine pull, "warp" (recommended: a warp per token orders
        its kept slots once, then each lane sums its 16-byte units) or "thread" (a thread per
        (token, 16 bytes) walking every rank and k itself, about 2x slower). Topk > 32 always
        runs "thread". EP size 1 ignores it.
      zero_copy: True (recommended) = multi-rank calls may let peers read x / y where XLA put them
        when `jaxep.initialize` could register XLA's pool with NVSHMEM (docs/zero_copy.md);
        False = every call stages its source rows in NVSHMEM's heap, and initialize registers
        nothing. Either way the results are the same bits.
      timeout_s: bound on every device-side wait of the multi-rank CUDA backend; after it the
        waiting rank records a diagnosis and `jaxep.check()` raises `jaxep.TimeoutError`.
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
    dispatch_kernel: str = DISPATCH_KERNELS[0]
    combine_kernel: str = COMBINE_KERNELS[0]
    zero_copy: bool = True
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
            if isinstance(self.capacity_factor, bool) or not isinstance(
                    self.capacity_factor, (int, float)) or not (
                    math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
                raise ValueError("jaxep.Config: capacity_factor must be a finite number > 0 or None, "
                                 f"got {self.capacity_factor!r}")
        if self.recv_capacity is not None:
            _check_int("recv_capacity", self.recv_capacity, 1)
        _check_choice("dtype", self.dtype, PAYLOAD_DTYPES)
        _check_choice("mode", self.mode, MODES)
        if self.mode not in BUILT_MODES:
            raise NotImplementedError(
                f"jaxep.Config: mode={self.mode!r} is not built yet: expected one of {BUILT_MODES}, "
                f"got {self.mode!r} (jaxep never runs another mode in its place)")
        if self.num_sms is not None:
            _check_int("num_sms", self.num_sms, 1)
        _check_choice("dispatch_kernel", self.dispatch_kernel, DISPATCH_KERNELS)
        _check_choice("combine_kernel", self.combine_kernel, COMBINE_KERNELS)
        _check_bool("zero_copy", self.zero_copy)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not (
                0 < self.timeout_s < 86400):
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

    def canonical(self) -> str:
        """Every field as JSON text (sorted keys): what `jaxep.initialize` publishes so that the
        ranks can compare their configs field by field."""
        import json  # pylint: disable=g-import-not-at-top
        return json.dumps({k: (v.item() if isinstance(v, np.generic) else v)
                           for k, v in dataclasses.asdict(self).items()}, sort_keys=True)
