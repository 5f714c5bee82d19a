"""What the multi-rank runtime's symmetric buffers are sized for, and the record of parameters the
extension's runtime takes (`Params`: it crosses into C++ once, at `runtime_init`).

The buffers are sized once, at `jaxep.initialize`, so that a call of any of its configs fits; the
CUDA backend checks every call against them at trace time (`jaxep.backends.cuda_calls`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxep.config import Config

NVSHMEM_DEFAULT_HEAP = 1 << 30  # NVSHMEM_SYMMETRIC_SIZE default
HEAP_RESERVE = 128 << 20        # NVSHMEM's own allocations from the symmetric heap
MEM_MARGIN = 512 << 20          # contexts, NVSHMEM internals outside the heap

# Config fields the runtime holds once for all of initialize's configs: they must agree.
SHARED_FIELDS = ("ranks_per_node", "timeout_s", "zero_copy")


def recv_rows(config: Config, ep_size: int) -> int:
    """Receive rows per rank of the normal-mode calls: C (normal), or L * M (low_latency: its
    backward runs combine, dispatch_rows and gather_back on the flat rows l * M + m; its forward
    uses the low-latency area, `ll_area_sizes`)."""
    if config.mode == "normal":
        return config.capacity(ep_size)
    return config.local_experts(ep_size) * config.expert_rows(ep_size)


def _row_bytes(config: Config) -> int:
    # Every staged row (x, y, cotangents) is at most hidden x the widest payload dtype accepted
    # for this config's dtype: the config's dtype, or f32 (gradients of f32 payloads).
    return config.hidden * np.dtype(config.dtype).itemsize


def runtime_sizes(configs, ep_size: int) -> dict:
    """What the symmetric buffers are sized for, so that a call of ANY of `configs` fits: the
    largest tokens per rank, topk, experts, receive rows and row bytes among them."""
    return dict(max_tokens=max(c.max_tokens_per_rank for c in configs),
                topk=max(c.topk for c in configs),
                experts=max(c.num_experts for c in configs),
                capacity=max(recv_rows(c, ep_size) for c in configs),
                row_bytes=max(_row_bytes(c) for c in configs),
                return_row_bytes=max(c.hidden * 4 for c in configs))


def ll_area_sizes(configs, ep_size: int) -> dict:
    """The low-latency area (ffi/cuda/low_latency.h) for the mode="low_latency" configs among
    `configs`: L local experts and the rows per (expert, source), min(M, T_max): a token reaches
    an expert at most once (a repeat of its expert is dropped at the source, docs/design.md), so
    no source sends an expert more than T rows. Zeros when there is none. (The staging the area
    adds with several nodes the C++ layout sizes itself.)"""
    ll = [c for c in configs if c.mode == "low_latency"]
    if not ll:
        return dict(ll_experts=0, ll_cap=0)
    return dict(ll_experts=max(c.local_experts(ep_size) for c in ll),
                ll_cap=max(min(c.expert_rows(ep_size), c.max_tokens_per_rank) for c in ll))


def ll_area_bytes(configs, ep_size: int) -> int:
    """Bytes of the low-latency area's rows and their flags (ffi/cuda/sync.cu, ll_rows and
    ll_row_flag): 2 halves x L x R x ll_cap rows of the widest row (16-byte aligned) and a u64 flag
    each. The counts messages and the combine's rows (O(R*E) and O(T*K)) are not counted."""
    ll = ll_area_sizes(configs, ep_size)
    if not ll["ll_experts"]:
        return 0
    row = -(-max(_row_bytes(c) for c in configs) // 16) * 16
    return 2 * ll["ll_experts"] * ep_size * ll["ll_cap"] * (row + 8)


@dataclasses.dataclass(frozen=True)
class Params:
    """The extension runtime's parameters, one record (the extension's `RuntimeParams`,
    ffi/cuda/runtime.h InitParams): where this process runs (device, rank, size, node_size), the
    buffer sizes, the timeout (Config.timeout_s: its one default)."""
    device: int
    rank: int
    size: int
    node_size: int
    max_tokens: int
    topk: int
    experts: int
    capacity: int
    row_bytes: int
    return_row_bytes: int
    ll_experts: int
    ll_cap: int
    timeout_s: float

    @classmethod
    def of(cls, configs, *, device: int, rank: int, size: int, node_size: int) -> "Params":
        return cls(device=device, rank=rank, size=size, node_size=node_size,
                   **runtime_sizes(configs, size), **ll_area_sizes(configs, size),
                   timeout_s=float(configs[0].timeout_s))

    def sizes_text(self, n_configs: int) -> str:
        ll = (f", low-latency area for L={self.ll_experts} experts x {self.size} sources x "
              f"{self.ll_cap} rows x 2 halves" if self.ll_experts else "")
        return (f"T={self.max_tokens}, K={self.topk}, E={self.experts}, C={self.capacity}, row "
                f"{self.row_bytes} B{ll}, over {n_configs} config(s)")


def parse_size(text: str) -> int:
    """NVSHMEM's size syntax: an integer with an optional K/M/G/T suffix (powers of 2)."""
    t = text.strip().upper().rstrip("B")
    mult = 1
    for i, suffix in enumerate("KMGT"):
        if t.endswith(suffix):
            mult, t = 1024 ** (i + 1), t[:-1]
    return int(float(t) * mult)


def recommended_env(sym_bytes: int, ranks_on_gpu: int = 1, hosts: int = 1,
                    nodes: int | None = None) -> dict:
    """NVSHMEM settings jaxep recommends for this run (printed, never set). `nodes`: NVLink domains
    (default: one per host); one domain over several hosts (NVL72) reaches every peer by NVLink,
    so neither the one-host nor the network setting applies."""
    heap = sym_bytes + HEAP_RESERVE
    rec = {
        "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink multicast
        "NVSHMEM_SYMMETRIC_SIZE": str(max(heap, NVSHMEM_DEFAULT_HEAP)),
    }
    if hosts == 1:
        rec["NVSHMEM_REMOTE_TRANSPORT"] = "none"  # one host: peers by NVLink/P2P only
    elif (hosts if nodes is None else nodes) > 1:
        rec["NVSHMEM_IB_ENABLE_IBGDA"] = "1"  # GPU-initiated RDMA, no CPU proxy thread
    if ranks_on_gpu > 1:
        rec["NVSHMEM_DISABLE_NCCL"] = "1"
        rec["NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "1"
    return rec
