"""What the GPU-tier tests need from the machine, checked once: one place for the skip reasons."""
from __future__ import annotations

import os
import shutil
import subprocess

from jaxep import _extension
from jaxep.launch.env import ranks_share_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_reason() -> str | None:
    """Why the CUDA extension cannot run here, or None."""
    if not _extension.is_available():
        return f"jaxep CUDA extension unavailable: {_extension.unavailable_reason()}"
    if shutil.which("nvidia-smi") is None or subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True).returncode != 0:
        return "no NVIDIA GPU (nvidia-smi -L failed)"
    return None


def multirank_reason() -> str | None:
    """Why several ranks cannot share the GPU here (`jaxep.launch --share-gpu`), or None."""
    if (reason := gpu_reason()) is not None:
        return reason
    if not _extension.multi_rank_built():
        return "jaxep CUDA extension built without NVSHMEM (no multi-rank path)"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return "nvidia-cuda-mps-control not on PATH (needed by --share-gpu)"
    return None


def launch_gpu_flags(nproc: int) -> list[str]:
    """`jaxep.launch`'s GPU flags for `nproc` ranks here: one GPU per rank where at least `nproc`
    GPUs are visible (a multi-GPU node: peers over NVLink), else every rank on one GPU under CUDA
    MPS (`--share-gpu`, the one-GPU machine's emulation)."""
    return ["--share-gpu"] if ranks_share_gpu(nproc, os.environ) else []
