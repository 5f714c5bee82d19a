"""Process-wide state: `initialize` / `finalize`, the multi-rank NVSHMEM runtime, `check`, and the
choice of backend.

Nothing here runs at import. The reference backend needs no initialization; the CUDA backend at EP
size 1 needs none either. The multi-rank CUDA backend (EP size > 1: one process per GPU/rank, e.g.
`python -m jaxep.launch --nproc N [--share-gpu] script.py`) is set up by `initialize`:

  1. checks: one local device per process, the extension built with NVSHMEM, NVSHMEM not already
     initialized by someone else, enough free GPU memory outside XLA's pool for the symmetric block
     (it names XLA_PYTHON_CLIENT_PREALLOCATE / XLA_PYTHON_CLIENT_MEM_FRACTION when XLA took it);
  2. cudaSetDevice + cudaFree(0) on the calling thread (NVSHMEM binds to that device);
  3. every rank publishes its config (`Config.canonical()`) in JAX's distributed key-value store
     and compares it with every other rank's: a RuntimeError on every rank, naming the fields and
     the ranks, unless all are identical (the knobs are FFI attributes: every rank must run the
     same kernels);
  4. PE 0 creates the NVSHMEM unique id and publishes it in the same key-value store; the others
     read it (no MPI, no torch); on several hosts, NVSHMEM's bootstrap sockets are first pointed at
     the interface that reaches JAX's coordinator (`_pin_bootstrap_interface`);
  5. nvshmem init with the unique id, one `nvshmem_malloc` of the symmetric block sized from the
     config and the EP size, the peer-pointer table (`nvshmem_ptr`), a host-mapped diagnostic record;
     then the zero-copy decision (`jaxep.zero_copy`, when `config.zero_copy`);
  6. a watchdog thread that polls the record and logs a kernel's timeout at ERROR.

PE = `jax.process_index()` = position on the EP axis (a mesh over `jax.devices()` in order).

Environment: the library writes os.environ in exactly two places, each just before NVSHMEM starts
(NVSHMEM reads these settings only from its own process environment), only when the variable is
unset, and logged at INFO: `zero_copy.prepare_env` sets NVSHMEM_CUMEM_GRANULARITY=2 MiB when
`config.zero_copy` is on (zero-copy needs it); `_pin_bootstrap_interface`, on several hosts only,
sets NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (and _FAMILY) to the interface reaching JAX's coordinator.
Every other NVSHMEM setting jaxep recommends is only logged (INFO), never set. (The command-line
tools, `jaxep.launch` and `jaxep-bench --cpu_devices`, set up the environment of what they start,
as their flags ask.)
"""
from __future__ import annotations

import builtins
import dataclasses
import ipaddress
import logging
import os
import threading

import jax
import numpy as np

from jaxep import _ffi, _jax_private, machine, node_layout, topology, zero_copy
from jaxep.config import Config, field_diff

log = logging.getLogger("jaxep")

_BACKENDS = ("reference", "cuda")
# What each wait phase of a multi-rank call means, keyed by the short names the extension gives
# its phase codes (_ffi.constants()["phases"]).
_PHASE_TEXT = {
    "none": "-",
    "free": "release (waiting for the peer to finish reading this rank's stage of the previous call)",
    "ready": "exchange (waiting for the peer's stage of this call)",
    "zero_copy": "zero-copy release (waiting for the peer to finish reading this rank's x or y of "
                 "this call in its XLA pool)",
    # Internode (ffi/cuda/internode.h): the peer is the rank of another node with this local index.
    "credit": "internode credit (waiting for the peer's node to free the region the peer hosts "
              "for this rank)",
    "remote_meta": "internode metadata (waiting for the peer's metadata put of this call)",
    "remote_rows": "internode rows (the pull of the other nodes' sources waiting for one row the "
                   "peer puts into its forwarder on this node, the rank with the peer's local "
                   "index: flag = the row's last call seq)",
    "return": "internode return (waiting for the peer's node's partials / values for this rank's "
              "tokens: flag = results arrived (gather_back), or the last call seq of one chunk of "
              "8 tokens' partials (combine))",
    # Low-latency kernels (ffi/cuda/low_latency.h): flag and want are the op's device seq.
    "ll_counts": "low-latency dispatch counts (waiting for the source's counts message of this "
                 "call)",
    "ll_row": "low-latency dispatch row (waiting for one row the source writes into this rank's "
              "receive area)",
    "ll_combine_row": "low-latency combine row (waiting for one of this rank's slots to come back "
                      "from the expert's rank)",
    "ll_combine_start": "low-latency combine start (waiting for the peer to begin this call's "
                        "combine_send, i.e. to finish reading its last combine)",
}
_NVSHMEM_DEFAULT_HEAP = 1 << 30  # NVSHMEM_SYMMETRIC_SIZE default
_HEAP_RESERVE = 128 << 20        # NVSHMEM's own allocations from the symmetric heap
_MEM_MARGIN = 512 << 20          # contexts, NVSHMEM internals outside the heap


class TimeoutError(builtins.TimeoutError):  # pylint: disable=redefined-builtin
    """A multi-rank kernel's bounded wait expired (a peer died, hung, or runs another program).

    The message names the rank, the op, the phase, the peer and the flag values. After it, the
    runtime is aborted: every later multi-rank kernel of this process returns at once (outputs
    unspecified) until `jaxep.finalize()`.
    """


@dataclasses.dataclass
class _State:
    config: Config | None = None    # the first of `configs`
    configs: tuple = ()             # every config later calls may use (initialize's argument)
    axis_name: str | None = None
    multi_rank: bool = False        # NVSHMEM runtime up in this process
    zero_copy: bool = False         # XLA's pool registered on every rank (config.zero_copy)
    generation: int = 0             # initialize() calls that set up NVSHMEM (key-value store keys)
    watchdog: threading.Thread | None = None
    stop: threading.Event | None = None
    reported: bool = False
    machine_ranks_per_node: int | None = None  # processes per host, agreed at initialize


_state = _State()


def _configure_logging() -> None:
    level = os.environ.get("JAXEP_LOG_LEVEL")
    if level:
        logging.basicConfig()
        log.setLevel(level.upper())


# NVSHMEM's size syntax (K/M/G/T suffixes, powers of 2): one parser, in the module without deps.
_parse_size = zero_copy.parse_size


def recommended_env(sym_bytes: int, ranks_on_gpu: int = 1, hosts: int = 1) -> dict:
    """NVSHMEM settings jaxep recommends for this run (printed, never set)."""
    heap = sym_bytes + _HEAP_RESERVE
    rec = {
        "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink multicast
        "NVSHMEM_SYMMETRIC_SIZE": str(max(heap, _NVSHMEM_DEFAULT_HEAP)),
    }
    if hosts == 1:
        rec["NVSHMEM_REMOTE_TRANSPORT"] = "none"  # one host: peers by NVLink/P2P only
    else:
        rec["NVSHMEM_IB_ENABLE_IBGDA"] = "1"  # GPU-initiated RDMA, no CPU proxy thread
    if ranks_on_gpu > 1:
        rec["NVSHMEM_DISABLE_NCCL"] = "1"
        rec["NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "1"
    return rec


def _fail(msg: str):
    raise RuntimeError("jaxep.initialize: " + msg)


def _row_bytes(config: Config) -> int:
    # Every staged row (x, y, cotangents) is at most hidden x the widest payload dtype we accept
    # for this config's dtype: the config's dtype, or f32 (gradients of f32 payloads).
    return config.hidden * np.dtype(config.dtype).itemsize


def recv_rows(config: Config, ep_size: int) -> int:
    """Receive rows per rank of the normal-mode calls: C (normal), or L * M (low_latency: its
    backward runs combine, dispatch_rows and gather_back on the flat rows l * M + m; its forward
    uses the low-latency area, `ll_area_sizes`)."""
    if config.mode == "normal":
        return config.capacity(ep_size)
    return config.local_experts(ep_size) * config.expert_rows(ep_size)


# Config fields the runtime holds once for all of initialize's configs: they must agree.
SHARED_FIELDS = ("ranks_per_node", "timeout_s", "zero_copy")


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
    `configs`: L local experts and the rows per (expert, source), min(M, T_max * K); zeros when
    there is none. (The staging the area adds with several nodes the C++ layout sizes itself.)"""
    ll = [c for c in configs if c.mode == "low_latency"]
    if not ll:
        return dict(ll_experts=0, ll_cap=0)
    return dict(ll_experts=max(c.local_experts(ep_size) for c in ll),
                ll_cap=max(min(c.expert_rows(ep_size), c.max_tokens_per_rank * c.topk)
                           for c in ll))


def _as_configs(config) -> tuple:
    """initialize's argument as a non-empty tuple of Configs that agree on SHARED_FIELDS."""
    configs = (config,) if isinstance(config, Config) else tuple(config) \
        if isinstance(config, (list, tuple)) else None
    if not configs or not all(isinstance(c, Config) for c in configs):
        raise TypeError(f"jaxep.initialize: config must be a jaxep.Config or a non-empty list of "
                        f"them (e.g. [train_config, decode_config]), got {config!r}")
    for f in SHARED_FIELDS:
        values = [getattr(c, f) for c in configs]
        if len(set(values)) > 1:
            raise ValueError(f"jaxep.initialize: the configs must agree on {f} (the runtime "
                             f"holds one {f} for all of them): expected one value, got {values}")
    return tuple(dict.fromkeys(configs))  # equal configs once, in order


def _init_multi_rank(configs) -> None:
    configs = _as_configs(configs)  # a Config or initialize's list
    config = configs[0]  # the SHARED_FIELDS are every config's
    ext = _ffi._module  # pylint: disable=protected-access
    nproc, pe = jax.process_count(), jax.process_index()
    local = jax.local_devices()
    if len(local) != 1:
        _fail(f"the multi-rank CUDA backend needs exactly one local device per process, got "
              f"{len(local)} ({local}); start one process per GPU (python -m jaxep.launch), or set "
              "CUDA_VISIBLE_DEVICES / jax.distributed.initialize(local_device_ids=[i]) per process")
    if not _ffi.multi_rank_built():
        _fail("this build of jaxep._jaxep_cuda has no NVSHMEM (build_info()['multi_rank'] is "
              "False), so EP size > 1 cannot run on the CUDA backend; rebuild with JAXEP_CUDA=<CUDA "
              "major> and the cu13/cu12 extra (docs/build.md), or pass backend='reference'")
    arch = _ffi.arch_mismatch(local[0])
    if arch:
        _fail(f"{arch[0]}; {arch[1]}")
    max_ranks = _ffi.constant("max_ranks")
    if nproc > max_ranks:
        _fail(f"at most {max_ranks} ranks (all nodes together) are supported by this build, got "
              f"{nproc} processes")
    owners = [d.process_index for d in jax.devices()]
    if owners != list(range(nproc)):
        _fail(f"jax.devices() must be ordered by process (device i in process i, so that the EP "
              f"axis position equals the NVSHMEM PE); got process indices {owners}")
    status = ext.nvshmem_init_status()
    if status >= 2:
        _fail(f"NVSHMEM is already initialized in this process by someone else (status {status}: "
              "XLA's NVSHMEM collectives or another library); jaxep must own its NVSHMEM init")
    device = local[0]
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else int(ordinal)
    sizes = runtime_sizes(configs, nproc)
    cap, row_bytes = sizes["capacity"], sizes["row_bytes"]
    client = _jax_private.distributed_client()
    if client is None:
        _fail("jax.distributed is not initialized (the unique id travels through its key-value "
              "store); call jax.distributed.initialize() or start with python -m jaxep.launch")
    wait_ms = int(max(60.0, config.timeout_s) * 1000)
    # The same config everywhere first (a rank-dependent ranks_per_node would otherwise fail the
    # layout on some ranks only), then the node layout (processes per host, or the override).
    try:
        # The same list of configs on every rank: the first under the generation's key, the
        # others under sub-keys, each with their number when several (so a rank with another
        # number differs at the first).
        for i, c in enumerate(configs):
            agree_config(client, c, pe, nproc, _state.generation if i == 0 else
                         f"{_state.generation}/{i}", wait_ms,
                         extra={"number of configs": len(configs)} if len(configs) > 1 else None)
    except RuntimeError:
        _state.generation += 1  # every rank raised: a retry publishes under fresh keys
        raise
    try:
        hosts = node_layout.gather_hosts(client, pe, nproc, _state.generation, timeout_ms=wait_ms)
        node = node_layout.layout_from_hosts(hosts, config.ranks_per_node)
    except RuntimeError:
        _state.generation += 1  # every rank raised: a retry publishes under fresh keys
        raise
    n_hosts = len(set(hosts))
    ll_sizes = ll_area_sizes(configs, nproc)
    # The one record of what the runtime is set up for: sized here, started with it below.
    params = ext.RuntimeParams(device=ordinal, rank=pe, size=nproc, node_size=node,
                               timeout_s=float(config.timeout_s), **sizes, **ll_sizes)
    sym = ext.symmetric_bytes(params)
    heap_env = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    heap = _parse_size(heap_env) if heap_env else _NVSHMEM_DEFAULT_HEAP
    rec = recommended_env(sym, ranks_on_gpu=nproc if _shares_gpu() else 1,
                          hosts=n_hosts)
    if sym + _HEAP_RESERVE > heap:
        ll = (f", low-latency area for L={ll_sizes['ll_experts']} experts x {nproc} sources x "
              f"{ll_sizes['ll_cap']} rows x 2 halves" if ll_sizes["ll_experts"] else "")
        _fail(f"the symmetric block needs {sym} bytes (T={sizes['max_tokens']}, "
              f"K={sizes['topk']}, E={sizes['experts']}, C={cap}, row {row_bytes} B{ll}, over "
              f"{len(configs)} config(s)) but the NVSHMEM heap is {heap} bytes "
              f"(NVSHMEM_SYMMETRIC_SIZE={heap_env or 'unset: 1 GiB'}); set "
              f"NVSHMEM_SYMMETRIC_SIZE={rec['NVSHMEM_SYMMETRIC_SIZE']} in every process's "
              "environment, or lower capacity_factor / max_tokens_per_rank"
              + (" / rows_per_expert" if ll else ""))
    free, total = ext.device_mem_info(ordinal)  # also cudaSetDevice + cudaFree(0) on this thread
    need = heap + _MEM_MARGIN
    if free < need:
        pre = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "unset (true)")
        frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset (0.75)")
        _fail(f"GPU {ordinal} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB, but NVSHMEM "
              f"needs about {need / 2**30:.2f} GiB outside XLA's pool (heap {heap} B + margin). "
              f"JAX preallocates its pool (XLA_PYTHON_CLIENT_PREALLOCATE={pre}, "
              f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac}): set XLA_PYTHON_CLIENT_MEM_FRACTION lower "
              "(e.g. 0.75/ranks per GPU) or XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts")
    # Several hosts: what would stop or slow NVSHMEM's network transports, logged before its init
    # (which may end the process) by one rank per node; every rank adds it to an init failure.
    network = _network_findings(n_hosts) if n_hosts > 1 and pe % node == 0 else None
    for f in network or ():
        log.warning("jaxep network: %s; fix: %s", f["what"], f["hint"])
    _pin_bootstrap_interface(n_hosts)  # before NVSHMEM opens its sockets (uid, init)
    zero_copy.prepare_env(config.zero_copy)  # before NVSHMEM reads its environment (uid, init)
    key = f"jaxep/nvshmem_uid/{_state.generation}"
    if pe == 0:
        try:
            uid = ext.unique_id()
        except RuntimeError as e:
            why = f"{e}: {_bootstrap_text()}"
            client.key_value_set_bytes(key, _UID_ERROR + why.encode())  # the others fail at once
            _state.generation += 1  # every rank raises: a retry publishes under fresh keys
            _fail(why)
        client.key_value_set_bytes(key, uid)
    else:
        uid = bytes(client.blocking_key_value_get_bytes(key, wait_ms))
        if uid.startswith(_UID_ERROR):
            _state.generation += 1
            _fail("rank 0 could not create NVSHMEM's unique id: "
                  + uid[len(_UID_ERROR):].decode(errors="replace"))
    try:
        ext.runtime_init(params, bytes(uid))
    except RuntimeError as e:
        if n_hosts > 1 and network is None:
            network = _network_findings(n_hosts)
        if not network:
            raise
        raise RuntimeError(
            f"jaxep.initialize: {e}. On {n_hosts} hosts, what this machine shows for "
            "NVSHMEM's network (python -m jaxep.doctor --nodes N prints it all): "
            + "; ".join(f"[{f['level']}] {f['what']} -> {f['hint']}" for f in network)) from e
    _state.machine_ranks_per_node = node
    # Zero-copy (docs/zero_copy.md, B1; Config.zero_copy=False turns it off): every rank takes
    # part in the decision, which is the same everywhere.
    try:
        _state.zero_copy = zero_copy.setup(ext, client, pe, nproc, device, _state.generation,
                                           wait_ms, requested=config.zero_copy)
    except RuntimeError:
        ext.runtime_finalize(False)  # NVSHMEM's heap is gone: drop local state only
        raise
    _state.generation += 1
    _state.multi_rank = True
    _state.reported = False
    _start_watchdog()
    missing = {k: v for k, v in rec.items() if os.environ.get(k) is None}
    log.info("jaxep NVSHMEM %s: PE %d of %d on GPU %d (%s, compute capability %s; kernels built "
             "for %s), %d of %d processes per GPU; symmetric block %.1f MiB (heap %.1f MiB), "
             "capacity C=%d, timeout %.1f s; peers by nvshmem_ptr (load/store); free GPU memory "
             "before init %.2f GiB", ext.nvshmem_version(), pe, nproc, ordinal, device.device_kind,
             getattr(device, "compute_capability", "?"), _ffi.build_info().get("cuda_archs", "?"),
             nproc if _shares_gpu() else 1, nproc, sym / 2**20, heap / 2**20, cap,
             config.timeout_s, free / 2**30)
    nodes = nproc // node
    log.info("jaxep node layout: %d node(s) x %d ranks (%s; rank = node * %d + local index), "
             "this rank: node %d, local %d; hosts: %s; peers of other nodes by NVSHMEM puts only",
             nodes, node, "Config.ranks_per_node" if config.ranks_per_node else "processes per host",
             node, pe // node, pe % node, node_layout.describe_hosts(hosts))
    if log.isEnabledFor(logging.INFO):
        for line in topology.gpu_report(ordinal):
            log.info("jaxep network: %s", line)
    log.info("jaxep recommends (not set by jaxep): %s%s",
             " ".join(f"{k}={v}" for k, v in rec.items()),
             f"; unset here: {', '.join(missing)}" if missing else "")


_BOOTSTRAP_IFNAME = "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"
_BOOTSTRAP_FAMILY = "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY"
_UID_ERROR = b"jaxep-error:"  # rank 0 publishes this instead of a unique id it could not make


def _network_findings(hosts: int) -> list[dict]:
    """The doctor's warnings and errors about NVSHMEM's network on this machine (`hosts` > 1)."""
    return [f for f in topology.summary(nodes=hosts)["findings"]
            if f["level"] in ("warn", "error")]


def _bootstrap_text() -> str:
    """What a failed unique id says: where NVSHMEM's bootstrap looked for its socket."""
    chosen = os.environ.get(_BOOTSTRAP_IFNAME)
    where = (f"{_BOOTSTRAP_IFNAME}={chosen}" if chosen else
             f"{_BOOTSTRAP_IFNAME} unset: an ib* interface, else the first but docker*/lo")
    return (f"NVSHMEM's unique-id bootstrap opens its socket on an interface of this host ({where}"
            f"; family {os.environ.get(_BOOTSTRAP_FAMILY) or 'either'}); NVSHMEM's lines above say "
            f"why it failed (\"No socket interface found\": set {_BOOTSTRAP_IFNAME} to an "
            "interface that exists, NCCL_SOCKET_IFNAME's syntax)")


def _pin_bootstrap_interface(hosts: int) -> None:
    """Several hosts: NVSHMEM's unique-id bootstrap listens and connects on an interface of its own
    choice (an ib* one, else the first that is not docker* or lo), which the other hosts do not
    always reach (then its init times out connecting). Unless NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME is
    set, point it at the interface through which this host reaches JAX's coordinator, a network
    every process has already used; its address family too, unless set. One host: nothing."""
    if hosts < 2:
        return
    if os.environ.get(_BOOTSTRAP_IFNAME):
        log.info("jaxep: NVSHMEM's bootstrap uses %s=%s (set in the environment)",
                 _BOOTSTRAP_IFNAME, os.environ[_BOOTSTRAP_IFNAME])
        return
    try:
        address = _jax_private.coordinator_address()
    except _jax_private.JaxPrivateMoved as e:
        address = None
        log.warning("jaxep: %s", e)
    route = machine.route_interface(address) if address else None
    if route is None or ipaddress.ip_address(route[1]).is_loopback:
        log.warning("jaxep: no interface of this host reaches JAX's coordinator (%s; route %s), so "
                    "NVSHMEM's bootstrap picks its own; if its init fails to connect, set %s to "
                    "an interface every host reaches (NCCL_SOCKET_IFNAME's syntax)",
                    address, route, _BOOTSTRAP_IFNAME)
        return
    name, local, family = route
    os.environ[_BOOTSTRAP_IFNAME] = "=" + name  # "=": this exact name, not a prefix
    os.environ.setdefault(_BOOTSTRAP_FAMILY, family)
    log.info("jaxep: NVSHMEM's bootstrap set to interface %s (%s, %s), the one that reaches JAX's "
             "coordinator %s: %s=%s %s=%s (set them to choose another)", name, local, family,
             address, _BOOTSTRAP_IFNAME, os.environ[_BOOTSTRAP_IFNAME], _BOOTSTRAP_FAMILY,
             os.environ[_BOOTSTRAP_FAMILY])


def agree_config(client, config: Config, pe: int, nproc: int, generation, wait_ms: int,
                 extra: dict | None = None) -> None:
    """Every rank publishes `config.canonical()` (plus the `extra` fields) under
    jaxep/config/<generation>/<pe> and reads every rank's; unless all equal rank 0's, every rank
    raises the same RuntimeError naming the differing fields and the ranks (so no rank goes on
    into NVSHMEM's collective init alone)."""
    import json  # pylint: disable=g-import-not-at-top
    key = f"jaxep/config/{generation}"
    mine = config.canonical()
    if extra:
        mine = json.dumps({**json.loads(mine), **extra}, sort_keys=True)
    client.key_value_set(f"{key}/{pe}", mine)
    texts = []
    for r in range(nproc):
        try:
            texts.append(mine if r == pe else client.blocking_key_value_get(f"{key}/{r}", wait_ms))
        except Exception as e:  # pylint: disable=broad-except
            _fail(f"rank {r} did not publish its config within {wait_ms / 1000:g} s (it failed "
                  f"earlier in jaxep.initialize, or never called it): {type(e).__name__}: {e}")
    base = json.loads(texts[0])
    diffs = []
    for r, text in enumerate(texts[1:], start=1):
        other = json.loads(text)
        fields = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
        if fields:
            diffs.append(f"rank {r} vs rank 0: " + ", ".join(
                f"{k}={other.get(k)!r} vs {base.get(k)!r}" for k in fields))
    if diffs:
        _fail("the config must be identical on every rank (its knobs are FFI attributes: every "
              "rank must run the same kernels), but " + "; ".join(diffs))


def _shares_gpu() -> bool:
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


def _start_watchdog() -> None:
    stop = threading.Event()

    def poll():
        while not stop.wait(0.5):
            text = diagnostic()
            if text and not _state.reported:
                _state.reported = True
                log.error("%s", text)
                return

    t = threading.Thread(target=poll, name="jaxep-watchdog", daemon=True)
    _state.watchdog, _state.stop = t, stop
    t.start()


def diagnostic() -> str | None:
    """The text of the first timeout a multi-rank kernel of this process recorded, or None."""
    if not _state.multi_rank:
        return None
    d = _ffi._module.runtime_diag()  # pylint: disable=protected-access
    if d is None:
        return None
    to = _state.config.timeout_s if _state.config else float("nan")
    names = _ffi.constants() or {}
    op = names.get("ops", {}).get(d["op"], d["op"])
    phase = names.get("phases", {}).get(d["phase"], d["phase"])
    g = _state.machine_ranks_per_node or 1
    where = lambda r: f"rank {r} (node {r // g}, local {r % g})"  # noqa: E731
    return (f"jaxep: {where(d['rank'])} timed out in {op} (call #{d['seq']}), "
            f"phase {_PHASE_TEXT.get(phase, phase)}, waiting for peer {where(d['peer'])}: flag "
            f"{d['seen']}, want {d['awaited']} (waited {d['waited_ns'] / 1e9:.1f} s, timeout "
            f"{to:g} s). The peer process died, hangs, or runs a different sequence of jaxep "
            "calls; this process's multi-rank kernels are aborted until jaxep.finalize()")


def check() -> None:
    """Raises `jaxep.TimeoutError` if a multi-rank kernel of this process timed out.

    Call it after `block_until_ready()` on a step's outputs (the custom calls cannot raise at run
    time: an XLA FFI handler error crashed the process on jax 0.11.2). The watchdog thread started
    by `initialize` also logs the same text at ERROR within about 0.5 s.
    """
    text = diagnostic()
    if text:
        raise TimeoutError(text)


def initialize(config, axis_name: str = "ep") -> None:
    """Declares the config(s) every later call must use and, in a multi-process GPU run, sets up
    the NVSHMEM runtime (see the module docstring). Collective: every process must call it.

    `config`: a `jaxep.Config`, or a list of them when one process runs several, e.g. a model's
    training config and its `mode="low_latency"` decode config: the symmetric buffers are then
    sized for the largest of each size, and the configs must agree on the fields the runtime
    holds once (`SHARED_FIELDS`: ranks_per_node, timeout_s, zero_copy). Calls with any other
    config, or over another axis than `axis_name`, raise at trace time. In a multi-process GPU run
    the configs must be identical on every process (their knobs are FFI attributes): a
    RuntimeError on every process, naming the differing fields and ranks, otherwise. Set
    JAXEP_LOG_LEVEL=INFO (or configure the "jaxep" logger) to see the topology and the effective
    settings.
    """
    configs = _as_configs(config)
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"jaxep.initialize: axis_name must be a non-empty str, got "
                        f"{type(axis_name).__name__} {axis_name!r}")
    if _state.configs and _state.configs != configs:
        raise ValueError("jaxep.initialize: already initialized with another config; call "
                         f"jaxep.finalize() first. initialized: {list(_state.configs)}, got: "
                         f"{list(configs)}")
    if _state.config is not None and _state.axis_name != axis_name:
        raise ValueError(f"jaxep.initialize: already initialized with axis_name="
                         f"{_state.axis_name!r}; call jaxep.finalize() first, got axis_name="
                         f"{axis_name!r}")
    _configure_logging()
    if _state.config is None and jax.process_count() > 1 and _ffi.is_available() \
            and jax.default_backend() == "gpu":
        _init_multi_rank(configs)
    _state.configs, _state.config, _state.axis_name = configs, configs[0], axis_name
    log.info("jaxep initialized: axis=%r config=%s; CUDA extension: %s; jax backend: %s; "
             "processes: %d; multi-rank CUDA runtime: %s", axis_name,
             configs[0] if len(configs) == 1 else list(configs),
             "available" if _ffi.is_available() else _ffi.unavailable_reason(),
             jax.default_backend(), jax.process_count(), _state.multi_rank)


def finalize() -> None:
    """Frees the symmetric buffers and finalizes NVSHMEM (collective: every process calls it),
    then forgets the config. After a timeout (a peer may be dead) only local state is dropped."""
    if _state.multi_rank:
        if _state.stop is not None:
            _state.stop.set()
        collective = diagnostic() is None
        _ffi._module.runtime_finalize(collective)  # pylint: disable=protected-access
        _state.multi_rank = _state.zero_copy = False
    _state.config = _state.axis_name = None
    _state.configs = ()
    _state.machine_ranks_per_node = None


def initialized_config() -> Config | None:
    """The (first) config given to `jaxep.initialize`, or None."""
    return _state.config


def initialized_configs() -> tuple:
    """Every config given to `jaxep.initialize` (empty before it)."""
    return _state.configs


def zero_copy_enabled() -> bool:
    """True when multi-rank calls may read peers' x / y in their XLA pools (docs/zero_copy.md;
    on by default where possible, Config.zero_copy=False turns it off)."""
    return _state.multi_rank and _state.zero_copy


def machine_ranks_per_node() -> int | None:
    """Processes per host that `jaxep.initialize` agreed on (node_layout.discover), or None when
    no multi-process runtime read the machine (then a config without ranks_per_node is one node)."""
    return _state.machine_ranks_per_node


def node_size(config: Config, ep_size: int) -> int:
    """G, ranks per node for `ep_size` ranks: config.ranks_per_node, else the machine's layout
    read at initialize, else ep_size (one node). ValueError when G does not divide ep_size."""
    return config.node_size(ep_size, _state.machine_ranks_per_node)


def multi_rank_size() -> int:
    """EP size of the initialized multi-rank CUDA runtime, 0 when there is none."""
    return jax.process_count() if _state.multi_rank else 0


def check_config(op: str, config, name: str = "config") -> None:
    """`config` (the argument `name` of `op`) must be a Config, and the initialized one if any."""
    if not isinstance(config, Config):
        raise TypeError(f"jaxep.{op}: {name} must be a jaxep.Config, got {type(config).__name__}")
    if _state.configs and config not in _state.configs:
        if len(_state.configs) == 1:
            raise ValueError(f"jaxep.{op}: {name} differs from the one passed to jaxep.initialize: "
                             f"{field_diff(_state.config, config)} (initialized: {_state.config})")
        raise ValueError(f"jaxep.{op}: {name} is none of the {len(_state.configs)} configs passed "
                         f"to jaxep.initialize: vs the first, {field_diff(_state.config, config)} "
                         f"(initialized: {list(_state.configs)})")


def check_axis_name(op: str, axis_name) -> None:
    """After `jaxep.initialize(config, axis_name)`, every op runs over that EP axis."""
    if _state.config is not None and axis_name != _state.axis_name:
        raise ValueError(f"jaxep.{op}: axis_name must be the EP axis given to jaxep.initialize: "
                         f"expected {_state.axis_name!r}, got {axis_name!r}")


_warned: set = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def select_backend(op: str, requested: str | None, ep_size: int) -> str:
    """'cuda' when the extension is built, the default device is a GPU and either the EP size is 1
    or the multi-rank runtime (jaxep.initialize in a multi-process run) has that EP size."""
    if requested is not None and requested not in _BACKENDS:
        raise ValueError(f"jaxep.{op}: backend must be one of {_BACKENDS} or None, got {requested!r}")
    cuda_ok = _ffi.is_available() and jax.default_backend() == "gpu"
    arch = _ffi.arch_mismatch(jax.local_devices()[0]) if cuda_ok else None
    multi_ok = ep_size > 1 and multi_rank_size() == ep_size
    if requested == "cuda":
        if not cuda_ok:
            raise ValueError(f"jaxep.{op}: backend='cuda' needs the CUDA extension and a GPU: "
                             f"extension {'built' if _ffi.is_available() else _ffi.unavailable_reason()}, "
                             f"default jax backend {jax.default_backend()!r}")
        if arch:
            raise ValueError(f"jaxep.{op}: backend='cuda': {arch[0]}; {arch[1]}")
        if ep_size != 1 and not multi_ok:
            raise ValueError(
                f"jaxep.{op}: backend='cuda' with EP size {ep_size} needs the multi-rank NVSHMEM "
                f"runtime of that size: call jaxep.initialize(config) in each of {ep_size} "
                f"processes (one GPU each; python -m jaxep.launch); runtime EP size now: "
                f"{multi_rank_size() or 'none'}"
                + ("" if _ffi.multi_rank_built() else "; this build has no NVSHMEM"))
        return "cuda"
    if requested == "reference":
        return "reference"
    if arch:
        _warn_once(f"jaxep runs its ops on the reference backend here: {arch[0]}; {arch[1]}")
        return "reference"
    return "cuda" if cuda_ok and (ep_size == 1 or multi_ok) else "reference"
