"""Will the run fit? The memory a normal-mode run needs, estimated from its sizes before anything is
allocated or compiled, against what this machine has (`check`).

Per rank, the buffers the timed programs keep live at their peak (bytes; b = payload itemsize,
C = receive capacity rows, R = EP size):
- tokens: the input x, T x H x b, and combine's output, the same size;
- rows: dispatch's output, C x H x b, three at once in the timing loop (the result the combine
  loop reads, the loop's carry, the step's new output);
- where the reference backend runs (the backend under test, or its baseline): dispatch all-gathers
  every rank's tokens (R x T x H x wire row bytes), and combine (`layout.expert_partials`) holds
  the K gathered f32 row blocks, the partials and what it receives: (K + 2) x R x T x H x 4.
  These grow as R^2 over all ranks of one host: 16 emulated CPU ranks at the seed's sizes
  (T=4096, H=7168, K=8) need about 300 GB.
Peak = tokens + rows + the larger of dispatch's step (gather + 2 rows) and combine's (partials +
output). The host's routing arrays (R x T x K ids, weights, layout) are counted once, and OVERHEAD
for jax itself. Against the peak RSS of CPU runs at R = 1, 4, 8, 16 (T 256..4096, H 2048..7168,
K = 8) the estimate is within 10 %.

On CPU every rank of this process shares the host's memory (MemAvailable, or the cgroup's limit
when lower); on a GPU each device holds its own ranks, against what jax says it can still allocate.
The multi-rank runtime's NVSHMEM heap lies outside jax's pool, so it is not counted here:
`jaxep.initialize` checks that the heap fits the GPU's memory outside the pool before allocating it.
"""
from __future__ import annotations

import dataclasses
import os

# Bytes the process needs beyond the run's buffers (jax, XLA's compiled programs, Python).
OVERHEAD = 1 << 29


class BenchMemoryError(ValueError):
    """The run would not fit: raised before any allocation, naming the estimate and the flags."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    per_rank: dict          # part -> bytes, one rank
    ranks_here: int         # ranks sharing the memory compared against
    host: int               # routing arrays on the host, once

    @property
    def per_rank_bytes(self) -> int:
        p = self.per_rank
        return (p["tokens"] + p["rows"] + max(p.get("gather", 0) + p["rows_step"],
                                              p.get("partials", 0) + p["output"]))

    @property
    def total(self) -> int:
        return self.per_rank_bytes * self.ranks_here + self.host + OVERHEAD


def estimate(*, tokens, hidden, topk, itemsize, capacity, ep_size, ranks_here, reference,
             wire_row_bytes=None) -> Estimate:
    """The peak of one normal-mode run (module docstring); reference: the reference backend runs
    (under test or as the baseline); wire_row_bytes: dispatch's row on the wire (fp8) when it
    differs from hidden x itemsize."""
    T, H, R = tokens, hidden, ep_size
    row = H * itemsize
    per = dict(tokens=T * row, output=T * row, rows=capacity * row, rows_step=2 * capacity * row)
    if reference:
        per["gather"] = R * T * (wire_row_bytes or row)
        per["partials"] = (topk + 2) * R * T * H * 4
    host = R * T * topk * 4 * 6  # ids, weights, the layout's kept/dest arrays and sort keys
    return Estimate(per, ranks_here, host)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available() -> int | None:
    """cgroup v2: memory.max - memory.current when a limit is set."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError):
        return None


def host_available() -> int | None:
    """Bytes this process can still take on the host: the lower of MemAvailable and the cgroup's
    room; psutil's figure when /proc is not there; None when nothing says."""
    found = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    if not found:
        try:
            import psutil  # pylint: disable=g-import-not-at-top
            found = [psutil.virtual_memory().available]
        except ImportError:
            return None
    return min(found)


def device_available(device) -> int | None:
    """What jax's allocator on `device` can still hand out (memory_stats), or None."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  (a backend without memory_stats)
        return None
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def _need(est: Estimate, cpu: bool) -> int:
    """Host: every rank here, the host arrays and jax; a device: its own ranks' buffers."""
    return est.total if cpu else est.per_rank_bytes * est.ranks_here


def _smaller(sizes: dict, fits) -> dict | None:
    """Halves tokens (to 8), then hidden (to 128, a multiple of 128), until `fits(sizes)`."""
    s = dict(sizes)
    while not fits(s):
        if s["tokens"] > 8:
            s["tokens"] = max(8, s["tokens"] // 2)
        elif s["hidden"] > 128:
            s["hidden"] = max(128, s["hidden"] // 2 // 128 * 128)
        else:
            return None
    return s


def refusal(est: Estimate, need: int, available: int, where: str, *, ep_size, reference,
            sizes: dict, smaller: dict | None) -> str:
    """The message: the estimate, its largest parts, what is available, the flags that shrink it
    and, where halving the sizes gets there, sizes that fit."""
    parts = sorted(est.per_rank.items(), key=lambda kv: -kv[1])
    names = dict(tokens="input tokens", output="combine output", rows="dispatch rows (capacity)",
                 rows_step="timing loop's two more row buffers", gather="all-gathered tokens "
                 "(reference: every rank gathers every rank's)", partials="combine's f32 partials "
                 "and their K gathered rows (reference)")
    top = ", ".join(f"{names[k]} {_gb(v)}" for k, v in parts[:3])
    flags = [f"--tokens (now {sizes['tokens']})", f"--hidden (now {sizes['hidden']})",
             "--topk or --capacity_factor (the capacity rows)"]
    if reference and ep_size > 1:
        flags.append(f"fewer ranks: --ep_size / --cpu_devices (now {ep_size}; the reference "
                     "backend's gathers grow as ranks^2 on one host)")
    rest = need - est.per_rank_bytes * est.ranks_here
    example = (f" These fit: --tokens={smaller['tokens']} --hidden={smaller['hidden']}."
               if smaller else "")
    return (f"jaxep-bench: this run needs about {_gb(need)} of {where} memory, {_gb(available)} "
            f"available: refused before allocating anything. Per rank {_gb(est.per_rank_bytes)} x "
            f"{est.ranks_here} rank(s) here ({top})"
            f"{f' + {_gb(rest)} host arrays and jax' if rest > 0 else ''}. Shrink it with "
            f"{', '.join(flags)}.{example} --nomemory_check runs it anyway.")


def check(bc, *, ep_size, capacity_of, reference, devices, itemsize, wire_row_bytes=None) -> dict:
    """BenchMemoryError when the run's estimate exceeds what this machine has; else the estimate
    and the available bytes (JSON: `memory`). devices: this process's devices of the EP mesh;
    capacity_of(tokens): the receive rows per rank at that many tokens."""
    cpu = devices[0].platform == "cpu"
    ranks_here = len(devices) if cpu else max(1, len(devices) // len({d.id for d in devices}))

    def est_of(sizes):
        wire = wire_row_bytes(sizes["hidden"]) if wire_row_bytes else None
        return estimate(tokens=sizes["tokens"], hidden=sizes["hidden"], topk=bc.topk,
                        itemsize=itemsize, capacity=capacity_of(sizes["tokens"]),
                        ep_size=ep_size, ranks_here=ranks_here, reference=reference,
                        wire_row_bytes=wire)

    sizes = dict(tokens=bc.tokens, hidden=bc.hidden)
    est = est_of(sizes)
    need = _need(est, cpu)
    available = host_available() if cpu else device_available(devices[0])
    where = "host" if cpu else f"{devices[0].device_kind} device"
    if available is not None and need > available and bc.memory_check:
        # Sizes suggested with a margin: the estimate is within 10 % of what runs use.
        smaller = _smaller(sizes, lambda s: _need(est_of(s), cpu) <= 0.8 * available)
        raise BenchMemoryError(refusal(est, need, available, where, ep_size=ep_size,
                                       reference=reference, sizes=sizes, smaller=smaller))
    return dict(estimate_bytes=need, available_bytes=available, where=where,
                per_rank_bytes={k: int(v) for k, v in est.per_rank.items()})


def check_run(bc, mesh, ep_size: int, reference: bool) -> dict:
    """`check` for a normal-mode run of `bc` on `mesh` (this process's devices of it)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jaxep.config import fp8_row_bytes  # pylint: disable=g-import-not-at-top
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    cap = lambda t: bc.jaxep_config(max_tokens_per_rank=t).capacity(ep_size)  # noqa: E731
    return check(bc, ep_size=ep_size, capacity_of=cap, reference=reference, devices=mine,
                 itemsize=jnp.dtype(bc.dtype).itemsize,
                 wire_row_bytes=fp8_row_bytes if bc.dispatch_wire_dtype != "payload" else None)
