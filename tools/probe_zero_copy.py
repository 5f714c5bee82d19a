"""Probe for docs/zero_copy.md section 5, experiment 1: does option B1 work?

B1 = register XLA's preallocated device memory pool (one CUDA VMM allocation) into NVSHMEM's
symmetric heap with `nvshmemx_buffer_register_symmetric`, so that peers reach XLA's own buffers
through `nvshmem_ptr`. Test-only; nothing in jaxep uses it. Run on the GPU machine:

    NVSHMEM_CUMEM_GRANULARITY=2097152 python -m jaxep.launch --nproc 8 --share-gpu --timeout 200 \
        tools/probe_zero_copy.py [--size_mb 4] [--timeout_s 120] [--force]

Every rank (one process each):
  1. puts an int32 array filled with MAGIC + rank on its GPU and takes its device pointer;
  2. asks the CUDA driver (ctypes on libcuda.so.1) which allocation holds it: base and size
     (cuMemGetAddressRange), whether it is VMM (cuMemRetainAllocationHandle), its handle types and
     location (cuMemGetAllocationPropertiesFromHandle); prints `POOL ...`;
  3. jaxep.initialize (NVSHMEM up), then opens the NVSHMEM host library already loaded in this
     process (from /proc/self/maps, RTLD_NOLOAD: the same instance jaxep initialized) and prints
     `NVSHMEM ...` with its version;
  4. exchanges everything through JAX's key-value store and takes one decision, identical on all
     ranks: `RESULT B1 SKIP <why>` (exit 0), or register the pool (timed), read 16 bytes at the
     head and the tail of every rank's array through nvshmem_ptr(reg + offset_p, p), print
     `RESULT B1 rank=r peer=p ok|FAIL got=..` per peer (p = r too: the local alias) and
     `RESULT B1 rank=r ok|FAIL registered_in=<ms> size=<MiB>`; unregister; jaxep.finalize().

Exit codes: 0 ok or SKIP, 1 a check failed, 2 setup error (no launcher, no NVSHMEM, ...),
3 watchdog timeout. Nothing may hang: a watchdog thread prints `RESULT B1 rank=r FAIL timeout`
and leaves with os._exit(3); faulthandler kills the process 15 s later in any case (it needs no
GIL, should a C call hold it). A failing rank makes jaxep.launch stop the others.

Imports only the standard library at module level: `--help` and `import` work without a GPU.
Symbols and struct layouts are those of CUDA 13.0's cuda.h and the NVSHMEM 3.8.0 wheel's headers
(include/host/nvshmem_api.h, include/host/nvshmemx_api.h; the same declarations in v3.4.5's
src/include/host/); what NVSHMEM checks was read in NVIDIA/nvshmem v3.4.5
src/host/mem/mem_heap.cpp (see docs/zero_copy.md section 5).
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import sys
import threading
import time

MAGIC = 0x2B1D0000          # array value = MAGIC + rank: zeros or stale memory never pass
PROBE_BYTES = 16            # bytes read from each peer's array, at its head and at its tail
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
NVSHMEM_STATUS_IS_INITIALIZED = 2          # nvshmemx_init_status_t (nvshmem_constants.h)
NVSHMEM_DEFAULT_GRANULARITY = 1 << 29      # NVSHMEM_CUMEM_GRANULARITY default (env_defs.h)
NVSHMEMI_MAX_HANDLE_LENGTH = 1 << 31       # granularity cap (nvshmem_internal.h)
NVSHMEMI_DMA_BUF_MAX_LENGTH = 1 << 32      # assert(size < this) in register_heap_memory (3.4.5)

RANK = -1
_phase = "start"
_done = threading.Event()  # set when the probe ends: disarms the watchdog


def say(line: str) -> None:
    print(line, flush=True)


def fail(msg: str, code: int = 2):
    """A setup error or a failed check that ends this rank now (the launcher stops the others)."""
    say(f"RESULT B1 rank={RANK} FAIL {msg}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no jax.distributed shutdown barrier: peers may be stuck


def set_phase(name: str) -> None:
    global _phase
    _phase = name


def start_watchdog(timeout_s: float) -> None:
    """Python thread (prints a RESULT line) + faulthandler (kills the process even if the GIL is
    held, e.g. inside a nanobind call that does not release it)."""
    def bark():
        if not _done.wait(timeout_s):
            fail(f"timeout: not done within {timeout_s:g} s, stuck in phase '{_phase}' (a peer "
                 "died or hangs, or an NVSHMEM collective is mismatched)", code=3)
    threading.Thread(target=bark, name="probe-watchdog", daemon=True).start()
    faulthandler.dump_traceback_later(timeout_s + 15, exit=True)


def stop_watchdog() -> None:
    _done.set()
    faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- CUDA driver API

class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):  # CUmemAllocationProp_v1, cuda.h (CUDA 13.0)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _PropBuf(ctypes.Structure):  # spare room in case a newer driver writes a longer struct
    _fields_ = [("prop", CUmemAllocationProp), ("_pad", ctypes.c_ubyte * 64)]


class Cuda:
    """The few driver entry points the probe needs; `call` raises with the CUresult name."""
    SIGS = {  # name: argtypes (all return CUresult = int)
        "cuInit": [ctypes.c_uint],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceTotalMem_v2": [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int],
        "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuMemGetAddressRange_v2": [ctypes.POINTER(ctypes.c_uint64),
                                    ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64],
        "cuMemRetainAllocationHandle": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p],
        "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(CUmemAllocationProp),
                                                   ctypes.c_uint64],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(CUmemAllocationProp), ctypes.c_int],
        "cuMemGetAccess": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(CUmemLocation),
                           ctypes.c_uint64],
        "cuMemRelease": [ctypes.c_uint64],
        "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64],
        "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
    }

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name, args in self.SIGS.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def err(self, rc: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(s))
        return f"{(s.value or b'?').decode()}({rc})"

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: {self.err(rc)}")

    def try_call(self, name: str, *args) -> str | None:
        rc = getattr(self.lib, name)(*args)
        return None if rc == 0 else self.err(rc)

    def ensure_context(self, ordinal: int) -> str:
        """Makes jax's primary context current on this thread; says whether it already was."""
        self.call("cuInit", 0)
        ctx = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(ctx))
        if ctx.value:
            return "current"
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)  # kept until exit
        self.call("cuCtxSetCurrent", ctx)
        return "primary_retained"

    def retain(self, addr: int) -> tuple[int | None, str | None]:
        h = ctypes.c_uint64()
        e = self.try_call("cuMemRetainAllocationHandle", ctypes.byref(h), ctypes.c_void_p(addr))
        return (h.value, None) if e is None else (None, e)

    def read(self, addr: int, n: int) -> bytes:
        buf = (ctypes.c_ubyte * n)()
        self.call("cuMemcpyDtoH_v2", buf, addr, n)
        return bytes(buf)


def pool_info(cu: Cuda, ptr: int, ordinal: int) -> dict:
    """Which allocation holds `ptr`, and whether NVSHMEM could register it."""
    info = {"ptr": ptr, "vmm": 0, "why": ""}
    dev = ctypes.c_int()
    cu.call("cuDeviceGet", ctypes.byref(dev), ordinal)
    total = ctypes.c_size_t()
    cu.call("cuDeviceTotalMem_v2", ctypes.byref(total), dev)
    info["total"] = total.value
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    e = cu.try_call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
    if e is not None:
        info.update(base=ptr, size=0, offset=0, dev=-1, why=f"cuMemGetAddressRange: {e}")
        return info
    info.update(base=base.value, size=size.value, offset=ptr - base.value)
    d = ctypes.c_int()
    info["dev"] = d.value if cu.try_call("cuPointerGetAttribute", ctypes.byref(d),
                                         CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) is None else -1
    handle, e = cu.retain(ptr)
    if handle is None:
        info["why"] = f"not VMM (cuMemRetainAllocationHandle: {e})"
        return info
    try:
        pb = _PropBuf()
        cu.call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(pb.prop), handle)
        p = pb.prop
        info.update(vmm=1, handle_types=p.requestedHandleTypes,
                    loc=f"{p.location.type}:{p.location.id}", rdma=p.allocFlags.gpuDirectRDMACapable)
        g = ctypes.c_size_t()
        info["gran_rec"] = g.value if cu.try_call(
            "cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(p),
            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) is None else 0
        flags = ctypes.c_ulonglong()
        loc = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
        info["access"] = flags.value if cu.try_call(
            "cuMemGetAccess", ctypes.byref(flags), ctypes.byref(loc), base.value) is None else -1
        # One allocation from base to base+size? (NVSHMEM maps handle offset 0 .. size.) Handle
        # values of the same allocation are expected to be equal; informative only.
        same = []
        for a in (base.value, base.value + size.value - 1):
            h2, _ = cu.retain(a)
            same.append(int(h2 == handle))
            if h2 is not None:
                cu.call("cuMemRelease", h2)
        info["same_handle"] = "".join(map(str, same))
    finally:
        cu.call("cuMemRelease", handle)
    return info


# ----------------------------------------------------------------------------- NVSHMEM

def nvshmem_library(rank: int):
    """The libnvshmem_host this process loaded and jaxep initialized (checked: init status and
    my_pe), as a ctypes.CDLL with the probe's signatures; (lib, path, candidates)."""
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libnvshmem_host.so" in os.path.basename(p) and p not in paths:
                paths.append(p)
    for p in paths:
        try:  # RTLD_NOLOAD: the already loaded instance or nothing, never a second copy
            lib = ctypes.CDLL(p, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            continue
        lib.nvshmemx_init_status.restype = ctypes.c_int
        lib.nvshmem_my_pe.restype = ctypes.c_int
        if lib.nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED and lib.nvshmem_my_pe() == rank:
            lib.nvshmem_n_pes.restype = ctypes.c_int
            lib.nvshmemx_vendor_get_version_info.argtypes = [ctypes.POINTER(ctypes.c_int)] * 3
            lib.nvshmemx_vendor_get_version_info.restype = None
            lib.nvshmem_ptr.argtypes, lib.nvshmem_ptr.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
            fn = lib.nvshmemx_buffer_register_symmetric  # AttributeError: older than 3.3.9
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_void_p
            fn = lib.nvshmemx_buffer_unregister_symmetric
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
            return lib, p, paths
    return None, None, paths


def nvshmem_version(lib) -> str:
    v = [ctypes.c_int() for _ in range(3)]
    lib.nvshmemx_vendor_get_version_info(*(ctypes.byref(x) for x in v))
    return ".".join(str(x.value) for x in v)


def has_live_asserts(path: str) -> bool:
    """True if the library imports __assert_fail (built without NDEBUG): then 3.4.5's
    assert(size < NVSHMEMI_DMA_BUF_MAX_LENGTH) aborts registrations of 4 GiB or more."""
    with open(path, "rb") as f:
        return b"__assert_fail\0" in f.read()


def parse_size(text: str) -> int:
    """NVSHMEM size syntax: integer with optional k/m/g/t suffix (powers of 2)."""
    t = text.strip().lower().rstrip("b")
    mult = 1
    for i, s in enumerate("kmgt"):
        if t.endswith(s):
            t, mult = t[:-1], 1024 ** (i + 1)
    return int(float(t) * mult)


def env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


# ----------------------------------------------------------------------------- decision

def decide(infos: list[dict], force: bool) -> tuple[str, str] | None:
    """("FAIL" | "SKIP", why) when registration must not be tried, else None. A pure function of
    every rank's exchanged values, so that every rank takes the same decision."""
    bad = {i["rank"]: i["lib_problem"] for i in infos if i["lib_problem"]}
    if bad:
        return "FAIL", f"NVSHMEM library problem on ranks {bad}"
    notvmm = {i["rank"]: i["why"] for i in infos if not i["vmm"]}
    if notvmm:
        return "SKIP", (f"XLA's buffer is not in a VMM allocation on ranks {sorted(notvmm)}: "
                        f"{next(iter(notvmm.values()))} (XLA_PYTHON_CLIENT_ALLOCATOR, "
                        "XLA_PYTHON_CLIENT_PREALLOCATE, TF_GPU_ALLOCATOR, jax version?)")
    sizes = sorted({i["size"] for i in infos})
    if len(sizes) > 1:
        return "SKIP", f"pool sizes differ across ranks: {[i['size'] for i in infos]}"
    size = sizes[0]
    grans = sorted({i["nvshmem_gran"] for i in infos})
    if len(grans) > 1 or size % grans[0]:
        return "SKIP", (f"pool size {size} B is not a multiple of NVSHMEM's granularity {grans} B: "
                        "NVSHMEM would round it up and map past the allocation; set "
                        "NVSHMEM_CUMEM_GRANULARITY=2097152 on every rank")
    want = infos[0]["want_handle"]
    wrong = {i["rank"]: hex(i["handle_types"]) for i in infos if not i["handle_types"] & want}
    if wrong and not force:
        return "SKIP", (f"pool handle types {wrong} lack the heap's type {hex(want)} (NVSHMEM "
                        "exports the allocation with it); --force tries anyway")
    if any(i["asserts"] for i in infos) and size >= NVSHMEMI_DMA_BUF_MAX_LENGTH and not force:
        return "SKIP", (f"this NVSHMEM build has live assert()s and the pool ({size} B) is >= 4 GiB: "
                        "assert(size < NVSHMEMI_DMA_BUF_MAX_LENGTH) would abort; set "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION so that the pool is < 4 GiB, or --force")
    if any(i["error_checks"] for i in infos) and infos[0]["shared_gpu"]:
        return "SKIP", ("NVSHMEM_ENABLE_ERROR_CHECKS is on and all ranks share one GPU: NVSHMEM's "
                        "check_buffers_on_same_device refuses that; unset it")
    return None


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Zero-copy probe (docs/zero_copy.md section 5, experiment 1, option B1): "
                    "register XLA's VMM pool into NVSHMEM's symmetric heap and read every "
                    "peer's array through nvshmem_ptr. Run under `python -m jaxep.launch "
                    "--nproc N --share-gpu` with NVSHMEM_CUMEM_GRANULARITY=2097152.")
    p.add_argument("--size_mb", type=float, default=4.0,
                   help="size of each rank's int32 test array in MiB (default 4)")
    p.add_argument("--timeout_s", type=float, default=120.0,
                   help="watchdog: the rank prints FAIL and exits 3 after this many seconds")
    p.add_argument("--force", action="store_true",
                   help="register even when the handle-type or assert checks say it would fail")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global RANK
    a = parse_args(argv)
    start_watchdog(a.timeout_s)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    set_phase("import")
    import jax
    import numpy as np
    from jax._src import distributed
    import jaxep
    from jaxep import _ffi, runtime

    client = distributed.global_state.client
    if client is None:
        fail("jax.distributed is not initialized: run under python -m jaxep.launch")
    n, RANK = jax.process_count(), jax.process_index()
    if n < 2:
        fail(f"needs at least 2 ranks (--nproc), got {n}")
    if jax.default_backend() != "gpu":
        fail(f"needs the GPU backend, got {jax.default_backend()!r}")
    if RANK == 0:
        say("ENV " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in (
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_GPU_ALLOCATOR", "NVSHMEM_CUMEM_GRANULARITY",
            "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_MAX_MEMORY_PER_GPU", "NVSHMEM_DISABLE_CUDA_VMM",
            "NVSHMEM_CUMEM_HANDLE_TYPE", "NVSHMEM_DISABLE_NVLS")) + f" jax={jax.__version__}")
    kv_ms = int(a.timeout_s * 1000 * 0.75)

    # 1. The test array, alive until the end (XLA must not reuse it while peers read).
    set_phase("array")
    dev = jax.local_devices()[0]
    ordinal = getattr(dev, "local_hardware_id", None)
    ordinal = dev.id if ordinal is None else int(ordinal)
    count = max(PROBE_BYTES // 4, int(a.size_mb * 2**20) // 4)
    arr = jax.device_put(np.full(count, MAGIC + RANK, np.int32), dev).block_until_ready()
    try:
        ptr = arr.addressable_data(0).unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except
        ptr = arr.unsafe_buffer_pointer()
    nbytes = count * 4

    # 2. Which allocation holds it.
    set_phase("cuda queries")
    cu = Cuda()
    ctx = cu.ensure_context(ordinal)
    info = pool_info(cu, ptr, ordinal)
    head = cu.read(ptr, PROBE_BYTES)  # sanity: our own array through our own pointer
    if np.frombuffer(head, np.int32).tolist() != [MAGIC + RANK] * (PROBE_BYTES // 4):
        fail(f"own array reads {head.hex()} through its own pointer (ctypes/context problem)")
    say(f"POOL rank={RANK} base={info['base']:#x} size={info['size']} "
        f"({info['size'] / 2**20:.1f} MiB, {info['size'] / info['total']:.4f} of {info['total']}) "
        f"offset={info['offset']:#x} vmm={info['vmm']} handle_types={info.get('handle_types', -1):#x} "
        f"loc={info.get('loc', '-')} dev={info['dev']} rdma={info.get('rdma', '-')} "
        f"access={info.get('access', '-')} same_handle={info.get('same_handle', '-')} "
        f"gran_rec={info.get('gran_rec', '-')} array={nbytes}B ptr={ptr:#x} ctx={ctx}"
        + (f" why={info['why']}" if info["why"] else ""))

    # 3. NVSHMEM up, through jaxep, and the same library instance here.
    set_phase("jaxep.initialize")
    cfg = jaxep.Config(num_experts=2 * n, topk=2, hidden=128, max_tokens_per_rank=64,
                       capacity_factor=None, dtype="float32", timeout_s=30.0)
    try:
        jaxep.initialize(cfg, axis_name="ep")
    except Exception as e:  # pylint: disable=broad-except
        fail(f"jaxep.initialize raised {type(e).__name__}: {e}".replace("\n", " "))
    if runtime.multi_rank_size() != n:
        fail("jaxep.initialize did not start the NVSHMEM runtime (extension: "
             f"{_ffi.unavailable_reason() or 'available'}, multi-rank build: "
             f"{_ffi.multi_rank_built() if _ffi.is_available() else '-'})")
    cu.ensure_context(ordinal)  # jaxep made the primary context current on this thread
    set_phase("nvshmem library")
    problem = ""
    try:
        lib, path, paths = nvshmem_library(RANK)
    except AttributeError as e:  # reported through the exchange, so every rank stops alike
        lib, paths = None, []
        problem = f"the loaded NVSHMEM lacks a symbol ({e}); B1 needs NVSHMEM >= 3.3.9"
    if lib is None:
        problem = problem or f"no initialized libnvshmem_host with my_pe={RANK} among {paths}"
        version = asserts = "-"
    else:
        version = nvshmem_version(lib)
        ext_version = _ffi._module.nvshmem_version()  # pylint: disable=protected-access
        if version != ext_version:
            problem = f"version {version} here but {ext_version} in jaxep's extension"
        asserts = has_live_asserts(path)
        say(f"NVSHMEM rank={RANK} version={version} lib={path} mapped={len(paths)} "
            f"init_status={lib.nvshmemx_init_status()} my_pe={lib.nvshmem_my_pe()} "
            f"n_pes={lib.nvshmem_n_pes()} asserts={int(asserts)}")
    env_gran = os.environ.get("NVSHMEM_CUMEM_GRANULARITY")
    gran = parse_size(env_gran) if env_gran else NVSHMEM_DEFAULT_GRANULARITY
    gran = min(max(gran, info.get("gran_rec") or 0), NVSHMEMI_MAX_HANDLE_LENGTH)  # as reserve_heap
    want = (CU_MEM_HANDLE_TYPE_FABRIC
            if os.environ.get("NVSHMEM_CUMEM_HANDLE_TYPE", "").upper() == "FABRIC"
            else CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)

    # 4. Exchange, decide (same decision everywhere), register, read, unregister.
    set_phase("exchange")
    mine = dict(rank=RANK, vmm=info["vmm"], why=info["why"], size=info["size"],
                offset=info["offset"], handle_types=info.get("handle_types", 0),
                nvshmem_gran=gran, want_handle=want, asserts=bool(asserts is True),
                error_checks=env_true("NVSHMEM_ENABLE_ERROR_CHECKS"),
                shared_gpu=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                lib_problem=problem, version=version)
    client.key_value_set(f"jaxep_probe/info/{RANK}", json.dumps(mine))
    infos = [json.loads(client.blocking_key_value_get(f"jaxep_probe/info/{r}", kv_ms))
             for r in range(n)]
    if RANK == 0:
        offs = [i["offset"] for i in infos]
        say(f"OFFSETS {'equal' if len(set(offs)) == 1 else 'differ'}: {[hex(o) for o in offs]}")
    verdict = decide(infos, a.force)
    if verdict:
        kind, why = verdict
        say(f"RESULT B1 {kind} {why}" if kind == "SKIP" else f"RESULT B1 rank={RANK} {kind} {why}")
        set_phase("jaxep.finalize")
        jaxep.finalize()
        return 0 if kind == "SKIP" else 2

    size = info["size"]
    set_phase("barrier before register")
    client.wait_at_barrier("jaxep_probe/before_register", kv_ms)
    set_phase("nvshmemx_buffer_register_symmetric")
    t0 = time.perf_counter()
    reg = lib.nvshmemx_buffer_register_symmetric(ctypes.c_void_p(info["base"]), size, 0)
    ms = (time.perf_counter() - t0) * 1e3
    if not reg:
        # NVSHMEM tore its heap down on this path (mmap_mem: cleanup_symmetric_heap): no
        # unregister, no finalize; leave at once.
        fail(f"nvshmemx_buffer_register_symmetric returned NULL after {ms:.1f} ms (size {size}; "
             "see NVSHMEM's WARN/ERROR lines above; NVSHMEM_DEBUG=INFO for more)", code=1)
    say(f"REGISTERED rank={RANK} sym={reg:#x} in {ms:.1f} ms")

    set_phase("peer reads")
    ok_all = True
    for p, ip in enumerate(infos):
        want_v = [MAGIC + p] * (PROBE_BYTES // 4)
        got = []
        for where in (ip["offset"], ip["offset"] + nbytes - PROBE_BYTES):
            q = lib.nvshmem_ptr(ctypes.c_void_p(reg + where), p)
            if not q:
                got.append("nvshmem_ptr=NULL")
                continue
            try:
                got.append(np.frombuffer(cu.read(q, PROBE_BYTES), np.int32).tolist())
            except RuntimeError as e:
                got.append(str(e))
        ok = all(g == want_v for g in got)
        ok_all &= ok
        shown = [[v - MAGIC if 0 <= v - MAGIC < 1 << 16 else hex(v) for v in g]
                 if isinstance(g, list) else g for g in got]
        say(f"RESULT B1 rank={RANK} peer={p} {'ok' if ok else 'FAIL'} got={shown}"
            + ("" if ok else f" want={p}"))
    say(f"RESULT B1 rank={RANK} {'ok' if ok_all else 'FAIL'} registered_in={ms:.1f}ms "
        f"size={size / 2**20:.1f}MiB nvshmem={version}")

    set_phase("nvshmemx_buffer_unregister_symmetric")  # collective: barrier first, then unmap
    rc = lib.nvshmemx_buffer_unregister_symmetric(ctypes.c_void_p(reg), size)
    if rc != 0:
        say(f"RESULT B1 rank={RANK} unregister FAIL rc={rc}")
    set_phase("jaxep.finalize")
    jaxep.finalize()
    del arr
    return 0 if ok_all and rc == 0 else 1


def run(argv=None) -> int:
    """main() with every unexpected exception turned into a FAIL line (exit 2), and the watchdog
    disarmed at the end (jax.distributed's shutdown barrier follows under jaxep.launch)."""
    try:
        code = main(argv)
    except SystemExit:
        raise
    except BaseException as e:  # pylint: disable=broad-except
        import traceback
        traceback.print_exc()
        fail(f"{type(e).__name__} in phase '{_phase}': {e}".replace("\n", " ")[:500])
    stop_watchdog()
    return code


if __name__ == "__main__":
    sys.exit(run())
