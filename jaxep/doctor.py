"""`python -m jaxep.doctor`: what this machine has for jaxep, and what is wrong or slow.

`facts()` returns a JSON-able dict (also logged by `jaxep.initialize` at INFO when asked); `problems`
in it lists {"level", "what", "hint"}. Every probe tolerates a missing tool, file or device: on a
machine without GPU, NVSHMEM or NICs the doctor says so and carries on. Nothing is changed.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

_ENV_KEYS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
             "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY",
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "NCCL_NVLS_ENABLE", "LD_LIBRARY_PATH",
             "JAXEP_LOG_LEVEL")
_TRANSPORTS = ("ibgda", "ibrc", "ucx", "libfabric", "ibdevx")


def _run(cmd, timeout=10.0):
    """stdout of a command, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_packages() -> dict:
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12", "flax", "numpy", "jaxep")
    return {n: _version(n) for n in names}


def nvidia_smi() -> dict:
    """GPUs from nvidia-smi: name, driver, PCI bus id, memory; the driver's CUDA version."""
    out = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,pci.bus_id,memory.total",
                "--format=csv,noheader"])
    if out is None:
        return {"available": False, "gpus": []}
    gpus = []
    for line in out.strip().splitlines():
        f = [s.strip() for s in line.split(",")]
        if len(f) >= 5:
            gpus.append(dict(index=f[0], name=f[1], driver=f[2], pci_bus_id=f[3], memory=f[4]))
    head = _run(["nvidia-smi"]) or ""
    m = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return {"available": True, "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None,
            "cuda_driver_version": m.group(1) if m else None}


def jax_facts() -> dict:
    try:
        import jax
        devs = jax.devices()
        return {"version": jax.__version__, "default_backend": jax.default_backend(),
                "device_count": len(devs), "local_device_count": jax.local_device_count(),
                "process_count": jax.process_count(),
                "device_kinds": sorted({d.device_kind for d in devs})}
    except Exception as e:  # a broken plugin must not crash the doctor
        return {"error": f"{type(e).__name__}: {e}"}


def nvshmem() -> dict:
    """The NVSHMEM wheel: root, host/device libraries (versioned names), header version, transports."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {"found": False}
    root = list(spec.submodule_search_locations)[0]
    libs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "lib", "*")))
    host = [n for n in libs if n.startswith("libnvshmem_host.so")]
    version = None
    for hdr in ("include/non_abi/nvshmem_version.h", "include/nvshmem_version.h"):
        text = _read(os.path.join(root, hdr))
        if text:
            parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{k}_VERSION\s+(\d+)", text)
                     for k in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                version = ".".join(p.group(1) for p in parts)
                break
    transports = {t: any(n.startswith(f"nvshmem_transport_{t}.so") for n in libs) for t in _TRANSPORTS}
    transports["p2p"] = bool(host)  # NVLink/P2P is built into the host library
    return {"found": True, "root": root, "host_libs": host, "version": version,
            "host_soname_major": _so_major(host[0]) if host else None,
            "device_lib": "libnvshmem_device.a" in libs,
            "bootstrap_uid": any(n.startswith("nvshmem_bootstrap_uid.so") for n in libs),
            "transports": transports}


def _so_major(name):
    m = re.search(r"\.so\.(\d+)", name)
    return int(m.group(1)) if m else None


def extension() -> dict:
    """The jaxep CUDA extension: built? which libnvshmem_host it links (from its ELF strings)."""
    out = {"available": False, "reason": None, "files": [], "nvshmem_host_needed": None}
    try:
        from jaxep import _ffi
        out["available"] = bool(_ffi.is_available())
        out["reason"] = None if out["available"] else _ffi.unavailable_reason()
        for attr in ("nvshmem_version", "built_nvshmem_version"):
            if hasattr(_ffi, attr):
                out[attr] = getattr(_ffi, attr)()
    except Exception as e:
        out["reason"] = f"{type(e).__name__}: {e}"
    pkg = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(pkg, "**", "*.so"), recursive=True))
    out["files"] = [os.path.relpath(f, pkg) for f in files]
    for f in files:
        try:
            with open(f, "rb") as fh:
                m = re.search(rb"libnvshmem_host\.so\.(\d+)", fh.read())
        except OSError:
            m = None
        if m:
            out["nvshmem_host_needed"] = f"libnvshmem_host.so.{m.group(1).decode()}"
    return out


def infiniband_ports() -> list:
    """Every /sys/class/infiniband port: device, port, state, rate (Gb/s), link layer, PCI, NUMA."""
    ports = []
    for dev in sorted(glob.glob("/sys/class/infiniband/*")):
        pci = os.path.realpath(os.path.join(dev, "device"))
        for port in sorted(glob.glob(os.path.join(dev, "ports", "*"))):
            rate = _read(os.path.join(port, "rate")) or ""
            m = re.match(r"([\d.]+)\s*Gb", rate)
            state = _read(os.path.join(port, "state")) or ""
            ports.append(dict(device=os.path.basename(dev), port=os.path.basename(port),
                              state=state, active="ACTIVE" in state,
                              rate_gbps=float(m.group(1)) if m else None,
                              link_layer=_read(os.path.join(port, "link_layer")),
                              pci_path=pci, numa_node=_read(os.path.join(pci, "numa_node"))))
    return ports


def _pci_path(bus_id):
    """sysfs path of a GPU from nvidia-smi's bus id (00000000:18:00.0 -> 0000:18:00.0)."""
    m = re.match(r"(?:[0-9A-Fa-f]{4})?([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)$", bus_id)
    if not m:
        return None
    path = f"/sys/bus/pci/devices/{m.group(1).lower()}"
    return os.path.realpath(path) if os.path.exists(path) else None


def gpu_nic_affinity(gpus, ports) -> list:
    """Per GPU: NUMA node and the NIC sharing the longest PCI path prefix (same switch = best)."""
    rows = []
    for g in gpus:
        path = _pci_path(g.get("pci_bus_id", ""))
        numa = _read(os.path.join(path, "numa_node")) if path else None
        best, best_len = None, -1
        for p in ports:
            n = len(os.path.commonpath([path, p["pci_path"]]).split("/")) if path else 0
            if n > best_len:
                best, best_len = p, n
        rows.append(dict(gpu=g.get("index"), pci_path=path, numa_node=numa,
                         nearest_nic=best["device"] if best else None,
                         nic_numa_node=best["numa_node"] if best else None,
                         shared_pci_depth=best_len if best else None))
    return rows


def mps() -> dict:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    daemon = False
    for comm in glob.glob("/proc/[0-9]*/comm"):
        if (_read(comm) or "").startswith("nvidia-cuda-mps"):
            daemon = True
            break
    return {"pipe_directory": pipe, "control_pipe": os.path.exists(os.path.join(pipe, "control")),
            "daemon_running": daemon}


def environment() -> dict:
    env = {k: os.environ.get(k) for k in _ENV_KEYS}
    env.update({k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")})
    return env


def _problems(f) -> list:
    out = []

    def add(level, what, hint):
        out.append(dict(level=level, what=what, hint=hint))

    smi, jx, shm, ext, env = f["nvidia_smi"], f["jax"], f["nvshmem"], f["extension"], f["env"]
    if "error" in jx:
        add("error", f"jax failed to start: {jx['error']}", "check the jax/jaxlib/plugin versions below match")
    if not smi["available"]:
        add("info", "no nvidia-smi / no NVIDIA GPU", "jaxep runs the reference backend (pure JAX) here")
    elif jx.get("default_backend") != "gpu":
        add("error", "nvidia-smi sees GPUs but jax does not use them",
            "install the jax CUDA plugin matching the driver: pip install 'jax[cuda13]' (or cuda12)")
    if smi["available"] and not shm["found"]:
        add("error", "NVSHMEM wheel not installed", "pip install nvidia-nvshmem-cu13 (or -cu12 for CUDA 12)")
    if smi["available"] and not ext["available"]:
        add("warn", f"jaxep CUDA extension not available ({ext['reason']})",
            "build on this machine: pip install --no-build-isolation --no-deps -e .")
    need = ext.get("nvshmem_host_needed")
    if need and shm["found"] and need not in shm["host_libs"]:
        add("error", f"extension links {need}, the wheel has {shm['host_libs']}",
            "rebuild jaxep against the installed nvidia-nvshmem wheel")
    if shm["found"] and not shm["transports"].get("ibgda") and f["infiniband"]:
        add("warn", "NICs present but no NVSHMEM IBGDA transport library",
            "use an nvidia-nvshmem build with nvshmem_transport_ibgda.so; IBRC is slower")
    if smi["available"] and len(smi["gpus"]) > 1 and not f["infiniband"]:
        add("info", "no RDMA NICs in /sys/class/infiniband", "single-node only; multi-node EP needs IB/RoCE")
    if any(not p["active"] for p in f["infiniband"]):
        add("warn", "some IB ports are not ACTIVE", "check cabling/subnet manager: ibstat")
    for a in f["gpu_nic_affinity"]:
        if a["numa_node"] not in (None, "-1") and a["nic_numa_node"] not in (None, "-1") \
                and a["numa_node"] != a["nic_numa_node"]:
            add("warn", f"GPU {a['gpu']} nearest NIC {a['nearest_nic']} is on another NUMA node",
                "RDMA crosses the CPU interconnect; pin ranks to GPUs with a NIC on their switch")
    if env.get("NVSHMEM_DISABLE_NVLS") != "1" and smi["available"]:
        add("warn", "NVSHMEM_DISABLE_NVLS is not 1", "export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0")
    pre, frac = env.get("XLA_PYTHON_CLIENT_PREALLOCATE"), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if smi["available"] and pre != "false" and frac is None:
        add("info", "JAX preallocates 75% of GPU memory per process",
            "several ranks per GPU: XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 or XLA_PYTHON_CLIENT_PREALLOCATE=false")
    if smi["available"] and not f["mps"]["daemon_running"]:
        add("info", "CUDA MPS is not running",
            "needed only for several ranks on one GPU (jaxep.launch --share-gpu starts it)")
    return out


def facts() -> dict:
    """Everything the doctor knows, as a JSON-able dict (see module docstring)."""
    smi = nvidia_smi()
    ports = infiniband_ports()
    f = {
        "python": sys.version.split()[0], "os": platform.platform(), "machine": platform.machine(),
        "packages": python_packages(), "jax": jax_facts(), "nvidia_smi": smi, "nvshmem": nvshmem(),
        "extension": extension(), "infiniband": ports,
        "gpu_nic_affinity": gpu_nic_affinity(smi["gpus"], ports), "mps": mps(), "env": environment(),
    }
    f["problems"] = _problems(f)
    return f


def format_report(f: dict) -> str:
    smi, jx, shm, ext = f["nvidia_smi"], f["jax"], f["nvshmem"], f["extension"]
    gpus = ", ".join(sorted({g["name"] for g in smi["gpus"]})) or "none"
    lines = [
        f"python {f['python']} on {f['os']}",
        f"GPUs: {len(smi['gpus'])} x {gpus}; driver {smi.get('driver')}; CUDA (driver) "
        f"{smi.get('cuda_driver_version')}",
        "packages: " + ", ".join(f"{k} {v}" for k, v in f["packages"].items() if v),
        f"jax: backend {jx.get('default_backend')}, {jx.get('device_count')} devices "
        f"{jx.get('device_kinds')}, {jx.get('process_count')} process(es)" if "error" not in jx
        else f"jax: {jx['error']}",
        f"XLA_FLAGS: {f['env'].get('XLA_FLAGS')!r}",
        (f"NVSHMEM: {shm['root']} version {shm['version']} host {shm['host_libs']} device lib "
         f"{shm['device_lib']}; transports " + ", ".join(k for k, v in shm["transports"].items() if v))
        if shm["found"] else "NVSHMEM: wheel not found",
        f"jaxep extension: {'available' if ext['available'] else 'not available'}"
        f" ({ext['reason'] or ''}) links {ext['nvshmem_host_needed']}",
        "NICs: " + (", ".join(f"{p['device']}/{p['port']} {p['state']} {p['rate_gbps']} Gb/s "
                                f"numa {p['numa_node']}" for p in f["infiniband"]) or "none"),
    ]
    lines += [f"GPU {a['gpu']}: numa {a['numa_node']}, nearest NIC {a['nearest_nic']} "
              f"(numa {a['nic_numa_node']})" for a in f["gpu_nic_affinity"]]
    lines.append(f"MPS: daemon {'running' if f['mps']['daemon_running'] else 'not running'}, "
                 f"pipe {f['mps']['pipe_directory']}")
    lines.append("memory: XLA_PYTHON_CLIENT_PREALLOCATE=" + str(f["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"])
                 + " XLA_PYTHON_CLIENT_MEM_FRACTION=" + str(f["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
    nv = {k: v for k, v in f["env"].items() if k.startswith("NVSHMEM_")}
    lines.append(f"NVSHMEM env: {nv or 'none'}")
    lines.append("problems:" if f["problems"] else "problems: none")
    lines += [f"  [{p['level']}] {p['what']} -> {p['hint']}" for p in f["problems"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    f = facts()
    print(json.dumps(f, indent=1, default=str) if "--json" in argv else format_report(f))
    return 1 if any(p["level"] == "error" for p in f["problems"]) else 0


if __name__ == "__main__":
    sys.exit(main())
