"""Named benchmark setups (`--preset`) and the figures they are read against.

`nvl72_ep64` / `nvl72x2_ep144` model rack-scale NVLink domains (one, or two over the NICs);
`jaxep.bench.model.uniform_prediction(name)` gives their floors without running anything.

`seed_2x8` is the setup jaxep is read against: two nodes of 8 GPUs, where a peer tool prints
"NVL 149 GB/s, RDMA 44 GB/s" for dispatch. On one GPU it runs as 16 ranks sharing it,
with the node override Config.ranks_per_node = 8:

    python -m jaxep.launch --nproc 16 --share-gpu -m jaxep.bench --preset=seed_2x8

A preset sets BenchConfig fields (`fields`); anything given explicitly (a flag on the command line)
wins (jaxep/bench/cli.py). Its modeled hardware gives the link model's peaks (docs/benchmark.md,
"Reading the seed's numbers") unless --nvlink_gbps / --rdma_gbps are given.
"""
from __future__ import annotations

# BenchConfig fields each preset sets. seed_2x8: T=4096 per rank, H=7168, top-8 of 128 experts =
# 8 local experts per rank at EP 16, bf16 (the report adds a model line for fp8 dispatch rows;
# --dispatch_wire_dtype=float8_e4m3fn runs them), 2 nodes x 8 ranks.
# nvl72_ep64: the seed's shapes at EP 64 inside ONE NVLink domain (16 trays of 4 GPUs of a GB200 /
# GB300 NVL72 rack: one node of 64; no byte crosses a NIC). nvl72x2_ep144: EP 144 over two racks,
# two nodes of 72 (the domains) joined by the NICs. Both keep 8 local experts per rank.
PRESETS = {
    "seed_2x8": dict(tokens=4096, hidden=7168, topk=8, experts=128, dtype="bfloat16", ep_size=16,
                     ranks_per_node=8),
    "nvl72_ep64": dict(tokens=4096, hidden=7168, topk=8, experts=512, dtype="bfloat16",
                       ep_size=64, ranks_per_node=64),
    "nvl72x2_ep144": dict(tokens=4096, hidden=7168, topk=8, experts=1152, dtype="bfloat16",
                          ep_size=144, ranks_per_node=72),
}

# The hardware each preset's link model assumes, GB/s (1e9 B/s) per GPU per direction:
# B300 NVLink 5 (18 links x 50 GB/s) and one ConnectX-8 (800 Gb/s = 100 GB/s) per GPU.
# GB200 NVL72 (the nvl72 presets), NVIDIA's published figures: NVLink 5 at 1.8 TB/s per GPU
# bidirectional, i.e. 900 GB/s per direction (the 130 TB/s of the rack / 72); one ConnectX-7 at
# 400 Gb/s = 50 GB/s per GPU for the scale-out network. Assumed, not published: that a rank reaches
# every peer of the domain at the full 900 GB/s whatever the routing (the NVLink switch trays are
# non-blocking) and the NIC's line rate with GPUDirect RDMA. No NVL72 machine has run jaxep.
HARDWARE = {
    "seed_2x8": dict(name="B300 NVLink 900 GB/s + ConnectX-8 800 Gb/s NIC per GPU",
                     nvlink_gbps=900.0, rdma_gbps=100.0),
    "nvl72_ep64": dict(name="GB200 NVL72: NVLink 5 900 GB/s per direction + ConnectX-7 400 Gb/s "
                       "NIC per GPU", nvlink_gbps=900.0, rdma_gbps=50.0),
    "nvl72x2_ep144": dict(name="2 x GB200 NVL72: NVLink 5 900 GB/s per direction + ConnectX-7 "
                          "400 Gb/s NIC per GPU", nvlink_gbps=900.0, rdma_gbps=50.0),
}

# What the seed's tool printed (DeepEP-style logical bytes / the dispatch time), what the seed's
# HybridEP run reached in bytes that really left the node, per GPU, and jaxep's target.
SEED = dict(nvl_gbps=149.0, rdma_gbps=44.0, hybridep_true_gbps=22.0, nic_gbps=100.0,
            target_line_fraction=0.9, nodes=2, ranks_per_node=8, experts=128, topk=8)

NAMES = tuple(PRESETS)


def fields(name: str) -> dict:
    """The BenchConfig fields preset `name` sets; ValueError naming the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"jaxep-bench: preset must be one of {NAMES}, got {name!r}")
    return dict(PRESETS[name])
