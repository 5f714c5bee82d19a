"""`jaxep.Config`: the frozen, validated settings of one EP communication setup.

Config is the one home of jaxep's settings (docs/design.md): every knob that changes what the
kernels do is a field here, reaches the CUDA custom calls as an FFI attribute (so it is in the HLO,
in the jit cache key, and checked equal on every rank by `jaxep.initialize`), and does something
measurable. No environment variable changes what jaxep computes or how.

The names below are THE Python definition of what the CUDA extension accepts; when the extension
is loaded, `jaxep._extension` checks they equal its own lists (`_jaxep_cuda.constants()`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# Payload dtypes of x / y (what the kernels move); written once, imported by the ops, the backends,
# the bench.
PAYLOAD_DTYPES = ("bfloat16", "float16", "float32")
# The modes: normal (throughput: training, prefill) and low_latency (decode), both built.
MODES = ("normal", "low_latency")
# FP8 dispatch (low_latency): one f32 scale per FP8_BLOCK channels of a token, e4m3 codes up to
# FP8_MAX (jaxep.fp8.quantize).
FP8_BLOCK = 128
FP8_MAX = 448.0
# The normal-mode dispatch wire in fp8 (Config.dispatch_wire_dtype): the same quantization.
FP8_WIRE = "float8_e4m3fn"


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one fp8 row as every fp8 path moves it (the low-latency kernels' rows,
    ffi/cuda/fp8.h Fp8RowBytes, and the fp8 wire's, jaxep/fp8.py): H e4m3 codes, then one f32
    scale per FP8_BLOCK channels."""
    return hidden + hidden // FP8_BLOCK * 4
# Kernel variants (same bits, different speed; docs/design.md). The first of each is the default.
DISPATCH_KERNELS = ("token", "row")    # multi-rank dispatch pull: warp per (source, token) | per row
COMBINE_KERNELS = ("warp", "thread")   # multi-rank combine pull: warp per token | thread per 16 B


# Rows and global slot ids are int32 on every backend (the CUDA kernels', XLA's index arrays).
INT32_MAX = 2**31 - 1


def _set(cfg, name: str, value) -> None:
    object.__setattr__(cfg, name, value)  # normalising a frozen dataclass's own fields


def _int(cfg, name: str, lo: int, why: str = "int32") -> None:
    """An int field (Python or numpy integer, not bool) in [lo, 2**31-1], stored as a Python int."""
    value = getattr(cfg, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jaxep.Config: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < lo:
        raise ValueError(f"jaxep.Config: {name} must be >= {lo}, got {value}")
    if value > INT32_MAX:
        raise ValueError(f"jaxep.Config: {name} must be <= {INT32_MAX} ({why}), got {value}")
    _set(cfg, name, value)


def _number(cfg, name: str, what: str = "") -> float:
    """A real number field (Python or numpy, not bool), stored as a Python float."""
    value = getattr(cfg, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"jaxep.Config: {name} must be a number (int or float){what}, got "
                        f"{type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # a Python int beyond float's range
        raise ValueError(f"jaxep.Config: {name} must be a finite number, got {value!r}") from None
    _set(cfg, name, value)
    return value


def _choice(cfg, name: str, choices: tuple) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, str) or str(value) not in choices:
        raise ValueError(f"jaxep.Config: {name} must be one of {choices}, got {value!r}")
    _set(cfg, name, str(value))


def _dtype_name(value):
    """A dtype's name from any spelling numpy knows ('f4', np.float32, jnp.bfloat16,
    jnp.float8_e4m3fn); other values (None, unknown strings) come back as they are."""
    if value is None:
        return None
    try:
        return np.dtype(value).name
    except (TypeError, ValueError):
        return value


def _dtype(cfg) -> None:
    """dtype: any spelling of a payload dtype ('float32', np.dtype, jnp.float32, ...) -> its name."""
    value = cfg.dtype
    name = _dtype_name(value)  # None stays None (np.dtype(None) would be float64)
    if name not in PAYLOAD_DTYPES:
        shown = name if isinstance(name, str) and not isinstance(value, str) else repr(value)
        raise ValueError(f"jaxep.Config: dtype must be one of {PAYLOAD_DTYPES}, got {shown}")
    _set(cfg, "dtype", name)


def _bool(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jaxep.Config: {name} must be a bool (True or False), got "
                        f"{type(value).__name__} {value!r}")
    _set(cfg, name, bool(value))


def field_diff(expected: "Config", got: "Config") -> str:
    """'expected a=1, b=2, got a=3, b=4' over the fields that differ (for error messages)."""
    names = [f.name for f in dataclasses.fields(Config)
             if getattr(expected, f.name) != getattr(got, f.name)]
    show = lambda c: ", ".join(f"{n}={getattr(c, n)!r}" for n in names)  # noqa: E731
    return f"expected {show(expected)}, got {show(got)}"


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
        Bounded so that the capacity fits int32 rows: 0 < factor <= (2**31-1) / (max_tokens *
        topk); a factor >= the EP size already never drops.
      recv_capacity: explicit receive rows per rank (<= 2**31-1); wins over `capacity_factor` when
        given. Capped at the no-drop worst case of the EP size it runs with (known only at trace
        time): `capacity(ep_size) = min(recv_capacity, ep_size * max_tokens_per_rank * topk)`.
      dtype: payload dtype the buffers are sized for: one of `PAYLOAD_DTYPES`, spelled as a name,
        a numpy/JAX dtype or scalar type (np.dtype('float32'), jnp.float32); stored as the name.
      mode: "normal" (throughput: training and prefill) or "low_latency" (decode: dispatch
        returns `jaxep.LowLatencyDispatchResult`, x [L, M, H] per local expert, and each op has
        a send and a receive half; docs/design.md "Low-latency mode"), on both backends. The
        capacity fields (capacity_factor, recv_capacity) are normal-mode settings: recv_capacity
        with low_latency raises (it would do nothing).
      rows_per_expert: low_latency only (raises with "normal"): M, the rows per local expert of
        dispatch's x [L, M, H]. None = ep_size * max_tokens_per_rank, the no-drop worst case when
        no token names an expert twice (`expert_rows(ep_size)`; a token that does reaches that
        expert once, the repeat dropped and counted). Rows of an expert past M are dropped (the
        last in layout order first) and counted. Bounded so that L * M rows fit int32.
      fp8_dispatch: low_latency only (raises with "normal"): dispatch quantizes each token to
        float8_e4m3fn with one f32 scale per 128 channels (`jaxep.fp8.quantize`) and returns x_fp8 and
        scales [L, M, H/128]; needs hidden % 128 == 0. Its outputs are not differentiable.
      ranks_per_node: the node layout G (ranks r = node * G + local index). None (recommended on
        real clusters) = read from the machine at `jaxep.initialize` (processes per host, agreed
        by every rank; the reference backend without a runtime: one node). An int overrides it,
        e.g. 8 ranks sharing one GPU as 2 nodes x 4, 16 as the seed's 2 x 8; the EP size must be a
        multiple of it. Decides the combine's reduction order (docs/design.md) on every backend,
        and on the CUDA backend which peers are reached over NVLink and which over the network.
      dispatch_wire_dtype: normal mode only: the dtype dispatch's rows cross the links in. None
        (default) = the payload dtype. "float8_e4m3fn": each source quantizes its tokens once
        (fp8_dispatch's rule, `jaxep.fp8.quantize`: e4m3 codes and one f32 scale per 128 channels,
        H + H/32 bytes a row instead of H x itemsize) and every destination dequantizes the rows
        it receives to the payload dtype (f32(code) x scale, cast once), so x_rows keep their
        dtype and shape and feed ragged_dot as before, on every backend alike. Gradients pass
        straight through the quantization: dx is the payload-dtype combine of the rows'
        cotangents, as without it. Needs hidden % 128 == 0; mode="low_latency" has fp8_dispatch.
      combine_wire_dtype: the dtype the per-(token, node) combine partials cross the network in:
        "float32" (default) or the payload dtype (half the bytes on the scarcest link for bf16 /
        f16; each partial of another node is then rounded to it once, on every backend alike).
        With one node nothing crosses a network and it changes nothing.

    Every field is normalised at construction: numpy integers and floats become Python ints and
    floats, dtypes their names, so equal settings make equal, equally hashed configs. Bools are
    not numbers here (capacity_factor=True raises). Sizes are bounded so that every row index
    and global slot id fits int32: max_tokens_per_rank * topk <= 2**31-1 here, and
    ep_size * max_tokens_per_rank * topk <= 2**31-1 in `capacity(ep_size)` (`max_ep_size()`).

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
    rows_per_expert: int | None = None
    fp8_dispatch: bool = False
    ranks_per_node: int | None = None
    dispatch_wire_dtype: str | None = None
    combine_wire_dtype: str = "float32"
    num_sms: int | None = None
    dispatch_kernel: str = DISPATCH_KERNELS[0]
    combine_kernel: str = COMBINE_KERNELS[0]
    zero_copy: bool = True
    timeout_s: float = 100.0

    def __post_init__(self):
        # Normalised here (numpy scalars -> Python numbers, dtype spellings -> one name), so that
        # equal configs are equal, hash equal (one jit cache entry) and give one canonical() text.
        _int(self, "num_experts", 1)
        _int(self, "topk", 1)
        _int(self, "hidden", 1)
        _int(self, "max_tokens_per_rank", 1)
        if self.topk > self.num_experts:
            raise ValueError(
                f"jaxep.Config: topk must be <= num_experts={self.num_experts}, got {self.topk}")
        slots = self.max_tokens_per_rank * self.topk
        if slots > INT32_MAX:  # even one rank's slot ids would overflow
            raise ValueError(f"jaxep.Config: max_tokens_per_rank * topk must be <= {INT32_MAX} "
                             f"(int32 slot ids), got {self.max_tokens_per_rank} * {self.topk} = "
                             f"{slots}")
        if self.capacity_factor is not None:
            most = INT32_MAX / slots  # ceil(factor * slots) must fit int32 rows
            f = _number(self, "capacity_factor", " or None")
            if not (math.isfinite(f) and 0 < f <= most):
                raise ValueError(
                    f"jaxep.Config: capacity_factor must be a finite number in (0, {most!r}] "
                    f"(so that ceil(capacity_factor * max_tokens_per_rank * topk) fits int32 rows; "
                    f"any factor >= the EP size never drops, like None), got {f!r}")
        if self.recv_capacity is not None:
            _int(self, "recv_capacity", 1, "int32 rows")
        _dtype(self)
        _choice(self, "mode", MODES)
        self._check_low_latency()
        if self.ranks_per_node is not None:
            _int(self, "ranks_per_node", 1)
        self._check_dispatch_wire()
        wire = _dtype_name(self.combine_wire_dtype)  # any dtype spelling, like `dtype`
        if wire not in ("float32", self.dtype):
            raise ValueError(f"jaxep.Config: combine_wire_dtype must be 'float32' or the payload "
                             f"dtype {self.dtype!r}, got {self.combine_wire_dtype!r}")
        _set(self, "combine_wire_dtype", str(wire))
        if self.num_sms is not None:
            _int(self, "num_sms", 1)
        _choice(self, "dispatch_kernel", DISPATCH_KERNELS)
        _choice(self, "combine_kernel", COMBINE_KERNELS)
        _bool(self, "zero_copy")
        t = _number(self, "timeout_s")
        if not 0 < t < 86400:
            raise ValueError(f"jaxep.Config: timeout_s must be in (0, 86400), got {t!r}")

    def _check_dispatch_wire(self) -> None:
        """dispatch_wire_dtype: None (the payload dtype; that dtype spelled out is stored as None)
        or FP8_WIRE, normal mode, hidden % FP8_BLOCK == 0."""
        wire = _dtype_name(self.dispatch_wire_dtype)
        if wire in (None, self.dtype):
            _set(self, "dispatch_wire_dtype", None)
            return
        if wire != FP8_WIRE:
            raise ValueError(f"jaxep.Config: dispatch_wire_dtype must be None (the payload dtype "
                             f"{self.dtype!r}) or {FP8_WIRE!r}, got {self.dispatch_wire_dtype!r}")
        if self.mode != "normal":
            raise ValueError(f"jaxep.Config: dispatch_wire_dtype is a mode='normal' setting: "
                             f"expected None with mode={self.mode!r} (set fp8_dispatch=True), "
                             f"got {self.dispatch_wire_dtype!r}")
        if self.hidden % FP8_BLOCK:
            raise ValueError(f"jaxep.Config: dispatch_wire_dtype={FP8_WIRE!r} needs hidden to be "
                             f"a multiple of {FP8_BLOCK} (one scale per {FP8_BLOCK} channels): "
                             f"expected a multiple of {FP8_BLOCK}, got hidden={self.hidden}")
        _set(self, "dispatch_wire_dtype", FP8_WIRE)

    def _check_low_latency(self) -> None:
        """rows_per_expert and fp8_dispatch: low_latency settings, refused with another mode."""
        ll = self.mode == "low_latency"
        if self.rows_per_expert is not None:
            if not ll:
                raise ValueError(f"jaxep.Config: rows_per_expert is a mode='low_latency' setting: "
                                 f"expected None with mode={self.mode!r}, got "
                                 f"{self.rows_per_expert!r} (it would do nothing)")
            _int(self, "rows_per_expert", 1, "int32 rows")
            rows = self.num_experts * self.rows_per_expert  # L * M <= E * M for every EP size
            if rows > INT32_MAX:
                raise ValueError(f"jaxep.Config: num_experts * rows_per_expert must be <= "
                                 f"{INT32_MAX} (int32 rows of L * M on one rank), got "
                                 f"{self.num_experts} * {self.rows_per_expert} = {rows}")
        _bool(self, "fp8_dispatch")
        if self.fp8_dispatch:
            if not ll:
                raise ValueError(f"jaxep.Config: fp8_dispatch is a mode='low_latency' setting: "
                                 f"expected False with mode={self.mode!r}, got True")
            if self.hidden % FP8_BLOCK:
                raise ValueError(f"jaxep.Config: fp8_dispatch needs hidden to be a multiple of "
                                 f"{FP8_BLOCK} (one scale per {FP8_BLOCK} channels): expected a "
                                 f"multiple of {FP8_BLOCK}, got hidden={self.hidden}")
        if ll and self.recv_capacity is not None:
            raise ValueError(f"jaxep.Config: recv_capacity is a mode='normal' setting: expected "
                             f"None with mode='low_latency' (set rows_per_expert), got "
                             f"{self.recv_capacity!r}")

    def expert_rows(self, ep_size: int) -> int:
        """M, the rows per local expert of low_latency dispatch on `ep_size` ranks (static):
        rows_per_expert, else ep_size * max_tokens_per_rank (no drop when no token names an
        expert twice). Raises when the experts do not divide evenly, when the global slot ids of
        this EP size do not fit int32 (as `capacity`), or when L * M rows do not."""
        L = self.local_experts(ep_size)
        self._slot_ids_fit(ep_size)  # raises when the slot ids of this EP size overflow int32
        M = (self.rows_per_expert if self.rows_per_expert is not None
             else ep_size * self.max_tokens_per_rank)
        if L * M > INT32_MAX:
            raise ValueError(f"jaxep: L * M rows (local experts times rows per expert) must be <= "
                             f"{INT32_MAX} (int32 rows), got {L} * {M} = {L * M}: set a smaller "
                             f"rows_per_expert")
        return M

    def local_experts(self, ep_size: int) -> int:
        """L = num_experts / ep_size; raises when the experts do not divide evenly."""
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(
                f"jaxep: num_experts must be divisible by the EP size: expected num_experts % "
                f"{ep_size} == 0, got num_experts={self.num_experts}")
        return self.num_experts // ep_size

    def node_size(self, ep_size: int, machine: int | None = None) -> int:
        """G, ranks per node for this EP size: `ranks_per_node` when set, else `machine` (the layout
        `jaxep.initialize` read), else ep_size (one node). Raises when G does not divide ep_size."""
        g = self.ranks_per_node if self.ranks_per_node is not None else (machine or ep_size)
        if g < 1 or ep_size % g:
            where = ("Config.ranks_per_node" if self.ranks_per_node is not None
                     else "the machine's processes per host")
            raise ValueError(
                f"jaxep: the EP size must be a multiple of the ranks per node: expected ep_size % "
                f"{g} == 0 ({where} = {g}), got ep_size={ep_size}")
        return g

    def max_ep_size(self) -> int:
        """The largest EP size whose global slot ids (ep_size * max_tokens_per_rank * topk) fit
        int32; `capacity` raises beyond it."""
        return INT32_MAX // (self.max_tokens_per_rank * self.topk)

    def _slot_ids_fit(self, ep_size: int) -> int:
        """no_drop_capacity(ep_size), after checking that this EP size's global slot ids
        (ep_size * max_tokens_per_rank * topk) fit int32."""
        worst = self.no_drop_capacity(ep_size)
        if worst > INT32_MAX:
            raise ValueError(
                f"jaxep: ep_size * max_tokens_per_rank * topk must be <= {INT32_MAX} (int32 slot "
                f"ids), got {ep_size} * {self.max_tokens_per_rank} * {self.topk} = {worst}: this "
                f"config supports EP sizes up to {self.max_ep_size()}; lower max_tokens_per_rank")
        return worst

    def no_drop_capacity(self, ep_size: int) -> int:
        """The worst case: every token of every rank sends all K slots here."""
        return ep_size * self.max_tokens_per_rank * self.topk

    def capacity(self, ep_size: int) -> int:
        """C, the receive rows per rank for this EP size (static); always <= no_drop_capacity.

        recv_capacity given: min(recv_capacity, no_drop_capacity(ep_size)) (rows past the worst
        case could never be filled, so they are not allocated). Else capacity_factor: ceil(factor *
        max_tokens_per_rank * topk) rounded up to a multiple of 8, capped the same way; None: the
        worst case. Raises ValueError when num_experts is not divisible by ep_size or when the
        global slot ids of this EP size do not fit int32 (ep_size > `max_ep_size()`).
        """
        self.local_experts(ep_size)
        worst = self._slot_ids_fit(ep_size)
        if self.recv_capacity is not None:
            return min(self.recv_capacity, worst)
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
