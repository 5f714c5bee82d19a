"""Zero-copy inputs (docs/zero_copy.md, option B1): on by default, `Config.zero_copy=False` turns
it off.

Peers read a multi-rank call's source rows (dispatch / dispatch_rows: x, combine: y) where XLA put
them instead of from a staged copy in NVSHMEM's heap. At `jaxep.initialize` (multi-rank path):
  0. `prepare_env` (before NVSHMEM starts): NVSHMEM_CUMEM_GRANULARITY=2 MiB unless the user set it
     (one of the library's two os.environ writes; the other is `bootstrap.pin_interface`);
  1. `local_facts`: which allocation holds a small jax array on this rank's device (ctypes on the
     CUDA driver): base, size, VMM or not, requested handle types, recommended granularity; plus
     NVSHMEM_CUMEM_GRANULARITY and the NVSHMEM library facts;
  2. every rank publishes its facts in JAX's key-value store and reads all others' (with
     `Config.zero_copy=False` a rank publishes only that, so nobody waits for it);
  3. `decide(facts)`: a pure function of all ranks' facts, so every rank takes the same decision;
  4. if on: `ext.register_pool(base, size)` (collective nvshmemx_buffer_register_symmetric), a
     second exchange of "registered and every peer address known", then `ext.enable_pool()` on
     all ranks or on none. From then on a call whose source rows lie in the pool does not stage
     them (it waits at its end until every peer has read them).
Anything off: logged at INFO with the reason, and jaxep stages every input (the same results).
Per call, the `zero_copy` FFI attribute (= `Config.zero_copy`) lets a call leave its rows in place
only when this registration happened. NVSHMEM tears its heap down when a registration fails, so
every condition it checks is checked here first, on every rank; a refusal after that is fatal
(RuntimeError from initialize, which names `Config(zero_copy=False)` as the way out).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os

from jaxep.runtime.sizes import parse_size

log = logging.getLogger("jaxep")

GRANULARITY = 2 << 20                 # NVSHMEM_CUMEM_GRANULARITY zero-copy needs (2 MiB)
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
NVSHMEM_MAX_GRANULARITY = 1 << 31     # NVSHMEMI_MAX_HANDLE_LENGTH: NVSHMEM caps the granularity
ASSERT_LIMIT = 1 << 32                # assert(size < 4 GiB) in register_heap_memory (3.4.5)
MIN_NVSHMEM = (3, 3, 9)               # nvshmemx_buffer_register_symmetric


OFF_REASON = "turned off (Config.zero_copy=False)"


def prepare_env(requested: bool) -> None:
    """Sets NVSHMEM_CUMEM_GRANULARITY=2 MiB before NVSHMEM reads its environment (the unique id,
    the init), when zero-copy is requested (`Config.zero_copy`) and the variable is unset.

    This is the one place jaxep writes os.environ. It must: NVSHMEM reads its heap granularity
    only from its own process environment (there is no API for it), and with its default (512 MiB)
    a registration of XLA's pool would be rounded up past the pool's end. It happens only when the
    variable is unset, so a user's choice always wins (decide() then says why zero-copy is off),
    and it is logged at INFO.
    """
    if requested and os.environ.get("NVSHMEM_CUMEM_GRANULARITY") is None:
        os.environ["NVSHMEM_CUMEM_GRANULARITY"] = str(GRANULARITY)
        log.info("jaxep zero-copy: set NVSHMEM_CUMEM_GRANULARITY=%d in this process's environment "
                 "(it was unset) before NVSHMEM starts: NVSHMEM reads its heap granularity only "
                 "from its environment, and registering XLA's pool needs 2 MiB (docs/zero_copy.md)",
                 GRANULARITY)


# ----------------------------------------------------------------------------- CUDA driver

class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp_v1 (CUDA 13.0 cuda.h)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Loc), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags), ("_pad", ctypes.c_ubyte * 64)]


def pool_info(ptr: int) -> dict:
    """The CUDA allocation holding device address `ptr` (the calling thread's current context must
    be jax's; jaxep's device_mem_info made the primary context current): base, size, vmm (0/1),
    handle_types, gran_rec (recommended granularity), why (empty unless something failed)."""
    info = {"base": 0, "size": 0, "vmm": 0, "handle_types": 0, "gran_rec": 0, "why": ""}
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        info["why"] = f"libcuda.so.1: {e}"
        return info
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        info["why"] = f"cuMemGetAddressRange failed ({rc})"
        return info
    info.update(base=base.value, size=size.value)
    handle = ctypes.c_uint64()
    rc = cu.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr))
    if rc != 0:
        info["why"] = f"not a VMM allocation (cuMemRetainAllocationHandle failed ({rc}))"
        return info
    try:
        prop = _Prop()
        rc = cu.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle)
        if rc != 0:
            info["why"] = f"cuMemGetAllocationPropertiesFromHandle failed ({rc})"
            return info
        info.update(vmm=1, handle_types=prop.requestedHandleTypes)
        g = ctypes.c_size_t()
        if cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop),
                                            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == 0:
            info["gran_rec"] = g.value
    finally:
        cu.cuMemRelease(handle)
    return info


def _nvshmem_has_live_asserts() -> bool | None:
    """Whether the loaded libnvshmem_host imports __assert_fail (built without NDEBUG: NVSHMEM
    3.4.5 would then abort a registration of >= 4 GiB); None when the library is not found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libnvshmem_host.so" in ln}
    except OSError:
        return None
    for p in sorted(paths):
        try:
            with open(p, "rb") as f:
                return b"__assert_fail\0" in f.read()
        except OSError:
            continue
    return None


def local_facts(ext, ptr: int, rank: int, pool=pool_info, asserts=_nvshmem_has_live_asserts) -> dict:
    """What this rank contributes to the decision (JSON-serializable), zero-copy requested."""
    info = pool(ptr)
    env_gran = os.environ.get("NVSHMEM_CUMEM_GRANULARITY")
    handle_env = os.environ.get("NVSHMEM_CUMEM_HANDLE_TYPE", "").strip().upper()
    return dict(
        rank=rank, requested=True, base=info["base"], size=info["size"], vmm=info["vmm"],
        handle_types=info["handle_types"], gran_rec=info["gran_rec"], why=info["why"],
        gran_env=env_gran, want_handle=(CU_MEM_HANDLE_TYPE_FABRIC if handle_env == "FABRIC"
                                        else CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        nvshmem=ext.nvshmem_version(), supported=bool(ext.pool_registration_supported()),
        asserts=asserts(),
        error_checks=os.environ.get("NVSHMEM_ENABLE_ERROR_CHECKS", "").strip().lower()
        in ("1", "true", "yes", "y", "on"),
        shared_gpu=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")))


def _size_or_none(text: str | None) -> int | None:
    try:
        return parse_size(text) if text else None
    except ValueError:
        return None


def _version(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(".")[:3])
    except ValueError:
        return ()


def decide(facts: list[dict]) -> tuple[bool, str]:
    """(on, why): a pure function of every rank's facts (in rank order), hence the same on every
    rank. On only if NVSHMEM could register every rank's pool without failing (its checks, read in
    NVSHMEM v3.4.5 mem_heap.cpp, see docs/zero_copy.md §2 and §5)."""
    off = [f["rank"] for f in facts if not f["requested"]]
    if off:
        return False, f"{OFF_REASON} on ranks {off}"
    notvmm = {f["rank"]: f["why"] for f in facts if not f["vmm"]}
    if notvmm:
        return False, (f"XLA's pool is not one VMM allocation on ranks {sorted(notvmm)}: "
                       f"{next(iter(notvmm.values()))} (jax >= 0.10.2 with preallocation: "
                       "XLA_PYTHON_CLIENT_PREALLOCATE, XLA_PYTHON_CLIENT_ALLOCATOR?)")
    old = {f["rank"]: f["nvshmem"] for f in facts
           if not f["supported"] or _version(f["nvshmem"]) < MIN_NVSHMEM}
    if old:
        return False, (f"NVSHMEM without nvshmemx_buffer_register_symmetric (needs >= 3.3.9) on "
                       f"ranks {old}")
    sizes = [f["size"] for f in facts]
    if len(set(sizes)) != 1:
        return False, f"XLA's pool sizes differ across ranks: {sizes}"
    size = sizes[0]
    grans = [f["gran_env"] for f in facts]
    if any(_size_or_none(g) != GRANULARITY for g in grans):
        return False, (f"NVSHMEM_CUMEM_GRANULARITY must be {GRANULARITY} on every rank (NVSHMEM "
                       f"rounds a registration up to it, 512 MiB by default, past XLA's pool); "
                       f"got {grans}")
    gran = min(max(GRANULARITY, max(f["gran_rec"] for f in facts)), NVSHMEM_MAX_GRANULARITY)
    if size % gran:
        return False, f"pool size {size} B is not a multiple of NVSHMEM's granularity {gran} B"
    wrong = {f["rank"]: hex(f["handle_types"]) for f in facts
             if not f["handle_types"] & f["want_handle"]}
    if wrong:
        return False, (f"pool handle types {wrong} lack NVSHMEM's heap type "
                       f"{hex(facts[0]['want_handle'])}")
    if size >= ASSERT_LIMIT and any(f["asserts"] is not False for f in facts):
        return False, (f"pool of {size} B >= 4 GiB and NVSHMEM's assert(size < 4 GiB) may be live "
                       f"(library asserts per rank: {[f['asserts'] for f in facts]}); lower "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION")
    if any(f["error_checks"] for f in facts) and any(f["shared_gpu"] for f in facts):
        return False, ("NVSHMEM_ENABLE_ERROR_CHECKS is on and ranks share a GPU: NVSHMEM's "
                       "same-device check refuses the registration")
    return True, f"every rank's XLA pool is one VMM allocation of {size} B ({size / 2**30:.2f} GiB)"


def _pool_pointer(device) -> tuple[int, object]:
    """A device pointer inside XLA's pool: a small array on `device` (returned to keep it alive
    during the queries)."""
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    arr = jax.device_put(np.zeros(256, np.int32), device).block_until_ready()
    try:
        ptr = arr.addressable_data(0).unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except
        ptr = arr.unsafe_buffer_pointer()
    return int(ptr), arr


def _exchange(client, key: str, rank: int, nproc: int, value: dict, wait_ms: int) -> list[dict]:
    client.key_value_set(f"{key}/{rank}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{r}", wait_ms)) for r in range(nproc)]


# A rank's facts when it has none to give (zero-copy off there, or its pool query failed).
_NO_FACTS = dict(rank=-1, requested=True, base=0, size=0, vmm=0, handle_types=0, gran_rec=0, why="",
                 gran_env=None, want_handle=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, nvshmem="",
                 supported=False, asserts=None, error_checks=False, shared_gpu=False)


def setup(ext, client, rank: int, nproc: int, device, generation: int, wait_ms: int, *,
          requested: bool, pointer=_pool_pointer, facts_fn=local_facts) -> bool:
    """Steps 1-4 of the module docstring; True when zero-copy is enabled (on all ranks). Called
    by every rank (also with requested=False, i.e. Config.zero_copy=False: its facts say so and
    every rank decides off); a rank that never publishes makes the others time out after wait_ms
    and decide off."""
    key = f"jaxep/zero_copy/{generation}"
    try:
        if not requested:
            mine = dict(_NO_FACTS, rank=rank, requested=False, why=OFF_REASON)
        else:
            ptr, keep = pointer(device)
            mine = facts_fn(ext, ptr, rank)
            del keep
    except Exception as e:  # pylint: disable=broad-except
        # Still publish (peers wait for these facts); vmm=0 turns it off on every rank.
        mine = dict(_NO_FACTS, rank=rank, why=f"pool query failed: {type(e).__name__}: {e}")
    try:
        facts = _exchange(client, key + "/facts", rank, nproc, mine, wait_ms)
    except Exception as e:  # pylint: disable=broad-except
        log.info("jaxep zero-copy: off: the key-value exchange of pool facts failed (%s: %s; did "
                 "every rank call jaxep.initialize?)", type(e).__name__, e)
        return False
    on, why = decide(facts)
    if not on:
        log.info("jaxep zero-copy: off: %s", why)
        return False
    err, fatal, ms = ext.register_pool(mine["base"], mine["size"])
    if fatal:
        raise RuntimeError(f"jaxep.initialize: zero-copy registration failed after every check "
                           f"passed ({err}); NVSHMEM freed its heap, so this process cannot run "
                           f"the multi-rank path; pass jaxep.Config(..., zero_copy=False)")
    try:
        done = _exchange(client, key + "/registered", rank, nproc, {"rank": rank, "err": err},
                         wait_ms)
    except Exception as e:  # pylint: disable=broad-except
        done = [{"rank": -1, "err": f"exchange failed: {e}"}]
    bad = {d["rank"]: d["err"] for d in done if d["err"]}
    if bad:
        # Registered (finalize unregisters collectively), but not used: every rank stages.
        log.info("jaxep zero-copy: off: registration incomplete on ranks %s", bad)
        return False
    ext.enable_pool()
    log.info("jaxep zero-copy: on (dispatch and combine read peers' x and y in their XLA pools): %s; pool "
             "registered in %.1f ms (base %#x, NVSHMEM %s)", why, ms, mine["base"], mine["nvshmem"])
    return True
