"""Peak bandwidths (GB/s, 1e9 bytes/s, one direction per GPU) by GPU model, overridable by flags.

Sources: vendor datasheets. NVLink is the per-GPU, per-direction figure (e.g. H100/H200 SXM:
18 links x 25 GB/s = 450 GB/s each way). RDMA is one NIC per GPU; default 400 Gb/s (ConnectX-7 /
NDR) = 50 GB/s unless /sys/class/infiniband reports another rate. These are peaks, not what a
kernel reaches: DeepEP reports ~150-160 GB/s on H800 NVLink (200 GB/s peak) and ~45-58 GB/s RDMA.
"""
from __future__ import annotations

# (substring of the device kind, lower case) -> (nvlink GB/s per direction, HBM GB/s)
GPU_PEAKS = (
    ("gb300", 900.0, 8000.0),
    ("b300", 900.0, 8000.0),
    ("gb200", 900.0, 8000.0),
    ("b200", 900.0, 8000.0),
    ("h200", 450.0, 4800.0),
    ("h100 pcie", 300.0, 2000.0),
    ("h100", 450.0, 3350.0),
    ("h800", 200.0, 3350.0),
    ("h20", 450.0, 4000.0),
    ("a100", 300.0, 2039.0),
    ("a800", 200.0, 2039.0),
)
DEFAULT_RDMA_GBPS = 50.0


def gpu_peaks(device_kind: str):
    """(nvlink, hbm) GB/s for a jax device_kind string, or (None, None) when unknown."""
    kind = device_kind.lower()
    for key, nvl, hbm in GPU_PEAKS:
        if key in kind:
            return nvl, hbm
    return None, None


def nic_gbps() -> float | None:
    """The fastest active InfiniBand/RoCE port rate in GB/s from sysfs, or None."""
    from jaxep.topology import machine  # pylint: disable=g-import-not-at-top
    rates = [p.rate_gbps for nic in machine.read_nics().values() for p in nic.ports
             if p.active and p.rate_gbps]
    return max(rates) / 8.0 if rates else None


def resolve(device_kind: str, platform: str, *, nvlink=None, rdma=None, hbm=None) -> dict:
    """{"nvlink"|"rdma"|"hbm": (GB/s or None, source)}. Flags win; then the table; on CPU none."""
    t_nvl, t_hbm = gpu_peaks(device_kind) if platform == "gpu" else (None, None)
    nic = nic_gbps() if platform == "gpu" and rdma is None else None
    return {
        "nvlink": (nvlink, "flag") if nvlink else (t_nvl, f"table:{device_kind}") if t_nvl else (None, "unknown"),
        "hbm": (hbm, "flag") if hbm else (t_hbm, f"table:{device_kind}") if t_hbm else (None, "unknown"),
        "rdma": (rdma, "flag") if rdma else (nic, "sysfs:infiniband") if nic else
                ((DEFAULT_RDMA_GBPS, "default:400Gb/s NIC") if platform == "gpu" else (None, "unknown")),
    }
