"""`python -m jaxep.doctor`: what this machine has for jaxep, and what is wrong or slow.

`facts()` returns a JSON-able dict; `problems` in it lists {"level", "what", "hint"}. Its
"infiniband" key lists the RDMA ports `jaxep.topology.machine.read_nics` finds; its "topology" key
(jaxep.topology.summary) holds the NIC NVSHMEM would give each GPU, the NVSHMEM transport
settings, the drivers' facts and the internode findings (no GPUDirect RDMA: neither dma-buf nor a
peer-memory module; no libibverbs / libmlx5 for NVSHMEM to load; NICs IBGDA skips by name; GPUs
sharing a NIC, a NIC far from its GPU, a bond at half rate, IBGDA off, IBGDA's doorbell rung by a
CPU for want of the driver's PeerMappingOverride=1, no GDRCopy for the proxy, no transport to
other nodes, RoCE on an Ethernet MTU too small for a 4096-byte RDMA MTU), each with the setting
that fixes it; they join `problems`. Its "nvlink_fabric" key (`nvlink_fabric`) holds each GPU's
NVLink fabric facts as NVML reports them (cluster UUID, clique id, registration state and status,
health conditions: jaxep.topology.fabric), the IMEX channels under /dev/nvidia-caps-imex-channels and
what would stop NVSHMEM from mapping the domain across hosts (registration not completed, no IMEX
channel, NVSHMEM_DISABLE_MNNVL), each with its fix; those join `problems` too.
Every probe tolerates a missing tool, file or device: on a machine without GPU, NVSHMEM or NICs
the doctor says so and carries on. Nothing is changed.

Sources: GPUs from NVML (nvidia-ml-py, the `cu12`/`cu13` extras) where it loads, else nvidia-smi;
processes from psutil; the NICs from sysfs (jaxep.topology.machine, the one reader: the nearest-NIC
rule is topology's); the extension from its import spec (so an editable install is found where
it really is) and its ELF dynamic section (which libnvshmem_host it links); the CUDA majors from
the installed distributions (nvidia-nvshmem-cuNN, jax-cudaNN-plugin) and the extension's
build_info().
"""
from __future__ import annotations

import argparse
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

import psutil

from jaxep import _jax_private, topology
from jaxep.doctor import qos
from jaxep.doctor.packages import (_so_major, cuda_majors, cuda_problems, elf_needed,
                                   installed_distributions)
from jaxep.topology import fabric, machine

_ENV_KEYS = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
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


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml() -> dict | None:
    """nvidia_smi()'s dict from NVML (nvidia-ml-py), or None where pynvml or libnvidia-ml is
    missing or NVML fails."""
    try:
        import pynvml  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pylint: disable=broad-except  # NVMLError_LibraryNotFound on a CPU machine
        return None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())  # e.g. 13000 for CUDA 13.0
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(dict(index=str(i), name=_text(pynvml.nvmlDeviceGetName(h)), driver=driver,
                             pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                             memory=f"{pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20} MiB"))
    except Exception:  # pylint: disable=broad-except
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # pylint: disable=broad-except
            pass
    return {"available": True, "source": "nvml", "gpus": gpus, "driver": driver,
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}"}


def nvidia_smi() -> dict:
    """GPUs: name, driver, PCI bus id, memory; the driver's CUDA version. From NVML where it loads,
    else from nvidia-smi."""
    nvml = _nvml()
    if nvml is not None:
        return nvml
    out = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,pci.bus_id,memory.total",
                "--format=csv,noheader"])
    if out is None:
        return {"available": False, "source": None, "gpus": []}
    gpus = []
    for line in out.strip().splitlines():
        f = [s.strip() for s in line.split(",")]
        if len(f) >= 5:
            gpus.append(dict(index=f[0], name=f[1], driver=f[2], pci_bus_id=f[3], memory=f[4]))
    head = _run(["nvidia-smi"]) or ""
    m = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return {"available": True, "source": "nvidia-smi", "gpus": gpus,
            "driver": gpus[0]["driver"] if gpus else None,
            "cuda_driver_version": m.group(1) if m else None}


def _arch_mismatch(device):
    """jaxep._extension.arch_mismatch(device), or None when the extension cannot tell."""
    try:
        from jaxep import _extension  # pylint: disable=g-import-not-at-top
        return _extension.arch_mismatch(device)
    except Exception:  # pylint: disable=broad-except
        return None


def jax_facts() -> dict:
    try:
        import jax
        devs = jax.devices()
        gpu = jax.default_backend() == "gpu"
        return {"version": jax.__version__, "default_backend": jax.default_backend(),
                "device_count": len(devs), "local_device_count": jax.local_device_count(),
                "process_count": jax.process_count(),
                "device_kinds": sorted({d.device_kind for d in devs}),
                "compute_capabilities": sorted({str(getattr(d, "compute_capability", "?"))
                                                for d in devs}) if gpu else [],
                # (what, fix) when no kernel of the extension's build runs on the first GPU
                "arch_mismatch": _arch_mismatch(devs[0]) if gpu else None,
                "distributed_initialized": jax.distributed.is_initialized(),
                "private_missing": _jax_private.missing()}
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


def _extension_path() -> str | None:
    """Where `import jaxep._jaxep_cuda` finds the extension (site-packages, an editable install's
    build tree, ...), without importing it; None where it is not installed."""
    try:
        spec = importlib.util.find_spec("jaxep._jaxep_cuda")
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return origin if origin and os.path.isfile(origin) else None


def extension() -> dict:
    """The jaxep CUDA extension: loaded? its file, the libnvshmem_host it links (ELF NEEDED), its
    build_info() and the CUDA major it was built for (build_info()['cuda_version'] // 1000)."""
    out = {"available": False, "reason": None, "path": None, "needed": None,
           "nvshmem_host_needed": None, "build_info": {}, "cuda_major": None}
    try:
        from jaxep import _extension  # pylint: disable=g-import-not-at-top
        out["available"] = bool(_extension.is_available())
        out["reason"] = None if out["available"] else _extension.unavailable_reason()
        out["build_info"] = {k: list(v) if isinstance(v, tuple) else v
                             for k, v in _extension.build_info().items()}
        for attr in ("nvshmem_version", "built_nvshmem_version"):
            if hasattr(_extension, attr):
                out[attr] = getattr(_extension, attr)()
    except Exception as e:  # pylint: disable=broad-except
        out["reason"] = f"{type(e).__name__}: {e}"
    cuda = out["build_info"].get("cuda_version")
    if isinstance(cuda, int) and cuda > 0:
        out["cuda_major"] = cuda // 1000
    out["path"] = _extension_path()
    if out["path"]:
        out["needed"] = elf_needed(out["path"])
        host = [n for n in out["needed"] or () if n.startswith("libnvshmem_host.so")]
        out["nvshmem_host_needed"] = host[0] if host else None
    return out


def infiniband_ports(root: str = "/") -> list:
    """Every RDMA port machine.read_nics finds under root: device, port, state, active, rate
    (Gb/s), link layer, the NIC's NUMA node (None when unknown)."""
    return [dict(device=nic.name, port=p.number, state=p.state, active=p.active,
                 rate_gbps=p.rate_gbps, link_layer=p.link_layer, numa_node=nic.numa_node)
            for nic in machine.read_nics(root).values() for p in nic.ports]


def mps() -> dict:
    """The MPS pipe directory and the live (not zombie) nvidia-cuda-mps-* processes, any user's."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    pids = sorted(p.pid for p in psutil.process_iter(["name", "status"])
                  if (p.info["name"] or "").startswith("nvidia-cuda-mps")
                  and p.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD))
    return {"pipe_directory": pipe, "control_pipe": os.path.exists(os.path.join(pipe, "control")),
            "daemon_running": bool(pids), "daemon_pids": pids}


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
        add("info", "no nvidia-smi / no NVIDIA GPU: not a GPU node", "jaxep runs the reference "
            "backend (pure JAX) here; the GPU, NVSHMEM, NIC and MPS checks apply on a GPU node")
    elif jx.get("default_backend") != "gpu":
        drv = f["cuda"]["extension"] or f["cuda"]["driver"]
        add("error", "nvidia-smi sees GPUs but jax does not use them",
            f"install the jax CUDA plugin matching the driver: pip install 'jax[cuda{drv}]'" if drv
            else "install the jax CUDA plugin matching the driver: pip install 'jax[cuda13]' (or cuda12)")
    plugins = f["cuda"]["jax_plugins"]
    if not smi["available"] and plugins and "cpu" not in (env.get("JAX_PLATFORMS") or ""):
        got = " ".join(f"jax-cuda{m}-plugin" for m in plugins)
        add("info", f"{got} is installed on a machine without an NVIDIA GPU: at import jax tries it, "
            "prints a long 'Jax plugin configuration error ... Unable to load cuPTI' (or 'no CUDA "
            "GPU') traceback and falls back to the CPU",
            "harmless; silence it with JAX_PLATFORMS=cpu, or pip uninstall -y " + got)
    if jx.get("arch_mismatch"):
        add("error", *jx["arch_mismatch"])
    for name in jx.get("private_missing") or ():
        add("error", f"jax {jx.get('version')} has no {name}, which jaxep's multi-rank runtime uses",
            "install a jax jaxep supports (pyproject.toml), or update jaxep/_jax_private.py")
    cuda = f["cuda"]
    major = cuda["extension"] or (cuda["jax_plugins"][0] if len(cuda["jax_plugins"]) == 1 else None)
    wheel = f"nvidia-nvshmem-cu{major}" if major else "nvidia-nvshmem-cu13 (or -cu12 for CUDA 12)"
    if smi["available"] and not shm["found"]:
        add("error", "NVSHMEM wheel not installed", f"pip install {wheel}")
    if smi["available"] and not ext["available"]:
        add("warn", f"jaxep CUDA extension not available ({ext['reason']})",
            "build on this machine: JAXEP_CUDA=<CUDA major> pip install --no-build-isolation --no-deps -e . (docs/build.md)")
    need = ext.get("nvshmem_host_needed")
    if need and not shm["found"]:
        add("error", f"extension links {need}, but no NVSHMEM wheel is installed",
            f"pip install {wheel}")
    if need and shm["found"] and need not in shm["host_libs"]:
        add("error", f"extension links {need}, installed NVSHMEM is {shm['version']} with "
            f"{shm['host_libs']}", f"rebuild jaxep against the installed NVSHMEM wheel, or install "
            f"the {wheel} it was built with")
    for level, what, hint in cuda_problems(cuda):  # the installed packages: any machine
        add(level, what, hint)
    if not f["gpu_node"]:  # the rest are about GPUs, NICs and their drivers
        return out
    if shm["found"] and not shm["transports"].get("ibgda") and f["infiniband"]:
        add("warn", "NICs present but no NVSHMEM IBGDA transport library",
            "use an nvidia-nvshmem build with nvshmem_transport_ibgda.so; IBRC is slower")
    if smi["available"] and len(smi["gpus"]) > 1 and not f["infiniband"]:
        add("info", "no RDMA NICs in /sys/class/infiniband", "single-node only; multi-node EP needs IB/RoCE")
    if any(not p["active"] for p in f["infiniband"]):
        add("warn", "some IB ports are not ACTIVE", "check cabling/subnet manager: ibstat")
    if env.get("NVSHMEM_DISABLE_NVLS") != "1" and smi["available"]:
        add("warn", "NVSHMEM_DISABLE_NVLS is not 1", "export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0")
    pre, frac = env.get("XLA_PYTHON_CLIENT_PREALLOCATE"), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if smi["available"] and pre != "false" and frac is None:
        add("info", "JAX preallocates 75% of GPU memory per process",
            "several ranks per GPU: XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 or XLA_PYTHON_CLIENT_PREALLOCATE=false")
    if smi["available"] and not f["mps"]["daemon_running"]:
        add("info", "CUDA MPS is not running",
            "needed only for several ranks on one GPU (jaxep.launch --share-gpu starts it)")
    for p in f["topology"]["findings"] + f.get("qos", {}).get("findings", []):
        add(**p)
    return out


def nvlink_fabric(count: int, nvml=None, root: str = "/", environ=None) -> dict:
    """Fabric facts of GPUs 0..count-1 (NVML indices; `nvml`: fabric.read's injectable library),
    the IMEX channels, and the blockers of each GPU whose fabric exists ({"gpu", "what", "fix"})."""
    gpus, blockers = [], []
    for i in range(count):
        fab = fabric.read(i, nvml=nvml)
        gpus.append(dict(index=i, **(fab.as_dict() if fab else dict(domain=None, state="no fabric"))))
        blockers += [dict(gpu=i, what=w, fix=x) for w, x in fabric.blockers(fab, environ, root)]
    domains = sorted({g["domain"] for g in gpus if g["domain"]})
    return dict(gpus=gpus, domains=domains, imex_channels=fabric.imex_channels(root),
                blockers=blockers)


def _fabric_problems(fab: dict) -> list:
    out = [dict(level="warn", what=f"GPU {b['gpu']}: {b['what']}", hint=b["fix"])
           for b in fab["blockers"]]
    out += [dict(level="warn", what=f"GPU {g['index']}: NVLink fabric health: "
                 + ", ".join(g["health"]), hint="nvidia-smi -q (Fabric) and the fabric "
                 "manager's log; expect lower NVLink bandwidth until it clears")
            for g in fab["gpus"] if g.get("health")]
    return out


def facts(nodes: int | None = None) -> dict:
    """Everything the doctor knows, as a JSON-able dict (see module docstring). `nodes`: how many
    nodes the job spans, for the internode checks that depend on it (None: unknown). "gpu_node":
    whether the GPU, NVSHMEM, NIC and MPS checks apply (an NVIDIA GPU seen by nvidia-smi/NVML, or
    GPUs in the topology it reads); "can_run" lists what this machine can run and what not."""
    smi = nvidia_smi()
    ext = extension()
    f = {
        "python": sys.version.split()[0], "os": platform.platform(), "machine": platform.machine(),
        "packages": python_packages(), "jax": jax_facts(), "nvidia_smi": smi, "nvshmem": nvshmem(),
        "extension": ext,
        "cuda": cuda_majors(installed_distributions(), ext["cuda_major"],
                            smi.get("cuda_driver_version")),
        "infiniband": infiniband_ports(), "mps": mps(), "env": environment(),
        "topology": topology.summary(nodes=nodes),
        "qos": qos.summary(nodes=nodes),  # RoCE QoS, bonds, idle near NICs (jaxep.doctor.qos)
        "nvlink_fabric": nvlink_fabric(len(smi["gpus"])),
    }
    f["gpu_node"] = bool(smi["available"] or f["topology"]["gpus"])
    f["can_run"] = can_run(f)
    f["problems"] = _problems(f) + _fabric_problems(f["nvlink_fabric"])
    return f


def can_run(f) -> dict:
    """{"yes": [...], "no": [...]}: what this machine can run with jaxep, and what not (and why)."""
    jx, ext = f["jax"], f["extension"]
    yes, no = [], []
    if "error" in jx:
        no.append(f"anything jax: it does not start ({jx['error']})")
        return {"yes": yes, "no": no}
    yes.append("the reference backend (pure JAX), any EP size: on CPU with emulated devices "
               "(XLA_FLAGS=--xla_force_host_platform_device_count=8), e.g. "
               "python examples/moe_flax.py, the test suite, jaxep-bench")
    if jx.get("default_backend") == "gpu" and ext["available"]:
        yes.append("the CUDA backend (jaxep's kernels) on this machine's GPUs")
        if ext.get("nvshmem_host_needed"):
            yes.append("several ranks through NVSHMEM (python -m jaxep.launch --nproc N)")
    elif jx.get("default_backend") == "gpu":
        no.append(f"the CUDA backend: the jaxep extension is not available ({ext['reason']})")
    else:
        no.append("the CUDA backend and several ranks through NVSHMEM: jax sees no GPU here "
                  f"(backend {jx.get('default_backend')})")
    if not f["gpu_node"]:
        no.append("the GPU, NVSHMEM, NIC and MPS checks: run the doctor on the GPU node")
    return {"yes": yes, "no": no}


def _extension_line(ext) -> str:
    """`jaxep extension: available (<path>) links libnvshmem_host.so.3, CUDA 13`, or why not."""
    if ext["available"]:
        head = f"jaxep extension: available ({ext['path']})"
    else:
        head = f"jaxep extension: not available ({ext['reason']})" + (
            f"; file {ext['path']}" if ext["path"] else "")
    if ext["path"]:
        head += f" links {ext['nvshmem_host_needed'] or 'no libnvshmem_host'}"
    if ext["cuda_major"] is not None:
        head += f", built for CUDA {ext['cuda_major']}"
    return head


def _cuda_line(c) -> str:
    """`CUDA majors: NVSHMEM wheel cu13; jax plugin cu13; extension 13; driver 13`."""
    def cu(ms):
        return " ".join(f"cu{m}" for m in ms) or "none"
    return (f"CUDA majors: NVSHMEM wheel {cu(c['nvshmem_wheels'])}; jax plugin {cu(c['jax_plugins'])}; "
            f"extension {c['extension'] or 'none'}; driver {c['driver'] or 'none'}")


def format_report(f: dict) -> str:
    smi, jx, shm, ext = f["nvidia_smi"], f["jax"], f["nvshmem"], f["extension"]
    gpus = ", ".join(sorted({g["name"] for g in smi["gpus"]})) or "none"
    lines = [
        f"python {f['python']} on {f['os']}",
        f"GPUs: {len(smi['gpus'])} x {gpus}; driver {smi.get('driver')}; CUDA (driver) "
        f"{smi.get('cuda_driver_version')}" if smi["available"] else
        "GPUs: none (no nvidia-smi / NVML): not a GPU node",
        "packages: " + ", ".join(f"{k} {v}" for k, v in f["packages"].items() if v),
        f"jax: backend {jx.get('default_backend')}, {jx.get('device_count')} devices "
        f"{jx.get('device_kinds')}"
        + (f" (compute capability {', '.join(jx['compute_capabilities'])})"
           if jx.get("compute_capabilities") else "")
        + f", {jx.get('process_count')} process(es)" if "error" not in jx
        else f"jax: {jx['error']}",
        f"XLA_FLAGS: {f['env'].get('XLA_FLAGS')!r}",
        (f"NVSHMEM: {shm['root']} version {shm['version']} host {shm['host_libs']} device lib "
         f"{shm['device_lib']}; transports " + ", ".join(k for k, v in shm["transports"].items() if v))
        if shm["found"] else "NVSHMEM: wheel not found",
        _extension_line(ext),
        _cuda_line(f["cuda"]),
        "NICs: " + (", ".join(f"{p['device']}/{p['port']} {p['state']} {p['rate_gbps']} Gb/s "
                                f"numa {p['numa_node']}" for p in f["infiniband"]) or "none"),
    ]
    lines.append("this machine can run:")
    lines += [f"  + {x}" for x in f["can_run"]["yes"]]
    lines += [f"  - not: {x}" for x in f["can_run"]["no"]]
    if not f["gpu_node"]:
        lines.append("problems:" if f["problems"] else "problems: none")
        lines += [f"  [{p['level']}] {p['what']} -> {p['hint']}" for p in f["problems"]]
        return "\n".join(lines)
    m = f["mps"]
    lines.append(f"MPS: daemon {'running, pids ' + str(m['daemon_pids']) if m['daemon_running'] else 'not running'}"
                 f", pipe {m['pipe_directory']}")
    lines.append("memory: XLA_PYTHON_CLIENT_PREALLOCATE=" + str(f["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"])
                 + " XLA_PYTHON_CLIENT_MEM_FRACTION=" + str(f["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
    fab = f["nvlink_fabric"]
    lines.append("NVLink fabric: " + ("; ".join(fab["domains"]) if fab["domains"] else
                                      "none (each host is its own NVLink domain)")
                 + f"; IMEX channels: {', '.join(fab['imex_channels']) or 'none'}")
    lines.append("GPU-NIC, as NVSHMEM would pick (jaxep.topology):")
    lines += [f"  {line}" for line in f["topology"]["report"]]
    lines += qos_lines(f.get("qos", {}).get("nics", []), shm.get("version"))
    nv = {k: v for k, v in f["env"].items() if k.startswith("NVSHMEM_")}
    lines.append(f"NVSHMEM env: {nv or 'none'}")
    lines.append("problems:" if f["problems"] else "problems: none")
    lines += [f"  [{p['level']}] {p['what']} -> {p['hint']}" for p in f["problems"]]
    return "\n".join(lines)


def qos_lines(nics: list, nvshmem_version: str | None = None) -> list[str]:
    """The RoCE NICs NVSHMEM uses: each bond's LAG port selection and how queue pairs reach its
    members under the installed NVSHMEM, then each EP stack's priority (jaxep.doctor.qos /
    .stacks / .bond)."""
    from jaxep.doctor import bond, stacks  # pylint: disable=g-import-not-at-top
    bonded = [n for n in nics if n.get("bond")]
    out = [f"  {n['nic']}: {n['bond']['name']} LAG port selection "
           f"{bond.lag_text(n['bond'].get('lag'))}" for n in bonded]
    if bonded:
        out.append("  " + bond.placement_text((bonded[0]["bond"].get("lag") or {}).get("mode"),
                                               nvshmem_version))
    return out + (["RoCE priority of each EP stack's traffic:"] + stacks.grouped_lines(nics)
                  if nics else [])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxep.doctor",
        description="What this machine has for jaxep (GPUs, JAX, NVSHMEM, the CUDA extension, "
                    "NICs, MPS, environment) and what is wrong or slow. Changes nothing.",
        epilog="Exit status: 0 when no problem of level 'error' was found (a machine without a "
               "GPU is not an error: it is told what it can run, and the GPU/NIC checks are "
               "skipped there), 1 when one was, 2 for bad arguments.")
    p.add_argument("--json", action="store_true", help="print every fact as JSON, not the report")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="nodes the job spans: 1 skips the internode checks, more adds the ones "
                        "that need it (e.g. NVSHMEM_REMOTE_TRANSPORT=none); default: unknown")
    # --- record / replay (jaxep.doctor.record) ---
    p.add_argument("--record", metavar="DIR", help="write what the doctor reads for the network "
                   "(sysfs, nvidia-smi topo -m, NVSHMEM/NCCL variables, QoS tools, counters read "
                   "twice) to DIR, or to an archive DIR.tar.gz; attach it to a bug report")
    p.add_argument("--replay", metavar="DIR", help="diagnose a record (directory or archive) "
                   "instead of this machine")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="--record: seconds between the two counter reads (default 2)")
    # --- another stack's printout (jaxep.doctor.explain, .story) ---
    e = p.add_argument_group("--explain: another EP stack's printout (DeepEP's or HybridEP's "
                             "internode test), with --replay DIR for the node's side")
    e.add_argument("--explain", metavar="FILE", help="what the GB/s in FILE mean and what really "
                   "crossed a NIC; with --replay, the whole account for that node")
    for flag, help_ in (("--tokens", "tokens per rank"), ("--hidden", "hidden size"),
                        ("--topk", "experts per token"), ("--experts", "experts in all"),
                        ("--ranks-per-node", "ranks (GPUs) per node")):
        e.add_argument(flag, type=int, default=None, metavar="N",
                       help=f"{help_}, where the printout does not say")
    e.add_argument("--nic-gbps", type=float, default=None, metavar="G", help="the NIC's line rate "
                   "in GB/s (default: the record's NIC, else 100, the seed's ConnectX-8)")
    e.add_argument("--bond-members", type=int, default=None, metavar="M", help="the bond's "
                   "members (default: the record's, else 2)")
    return p


def _explain(args) -> int:
    """--explain FILE [--replay DIR]: jaxep.doctor.story's account; 2 for a bad argument."""
    from jaxep.doctor import explain, record, story  # pylint: disable=g-import-not-at-top
    try:
        with open(args.explain) as f:
            text = f.read()
    except OSError as e:
        parser().error(f"--explain: cannot read {args.explain}: {e}")
    d = record.replay(args.replay, nodes=args.nodes) if args.replay else None
    nic, members, src = story.nic_of(d, args.nic_gbps, args.bond_members)
    given = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                 nodes=args.nodes, ranks_per_node=args.ranks_per_node)
    try:
        e = explain.explain(text, given, nic, members)
    except ValueError as err:
        parser().error(str(err))
    if args.json:
        print(json.dumps(dict(explain=e, nic_source=src, replay=d), indent=1, default=str))
    else:
        print(f"(NIC {nic:g} GB/s in {members} member(s): {src})")
        print(story.tell(e, d))
    return 0


def _record_or_replay(args) -> int | None:
    """--record / --replay: their exit status, or None when neither was asked for."""
    from jaxep.doctor import record  # pylint: disable=g-import-not-at-top
    if args.record:
        print(f"doctor record written: {record.record(args.record, interval_s=args.interval)}")
        return 0
    if args.replay:
        d = record.replay(args.replay, nodes=args.nodes)
        print(json.dumps(d, indent=1, default=str) if args.json else record.format_replay(d))
        return 1 if any(p["level"] == "error" for p in d["findings"]) else 0
    return None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.nodes is not None and args.nodes < 1:
        parser().error(f"--nodes must be at least 1, got {args.nodes}")
    if args.explain:
        return _explain(args)
    status = _record_or_replay(args)
    if status is not None:
        return status
    f = facts(nodes=args.nodes)
    print(json.dumps(f, indent=1, default=str) if args.json else format_report(f))
    return 1 if any(p["level"] == "error" for p in f["problems"]) else 0

