"""Starting the multi-rank NVSHMEM runtime of one process (one PE per process, one GPU each): the
steps of `start`, in order, each named for what it establishes.

  1. `_this_process`: one local device, devices ordered by process (EP position == PE), the
     extension built with NVSHMEM for this GPU, at most the extension's max_ranks processes, NVSHMEM
     not initialized by anyone else;
  2. `bootstrap.agree_configs`: the same configs on every rank (a RuntimeError on every rank
     otherwise), then the node layout (`node_layout`: processes per NVLink domain, which is the
     fabric clique where NVML reports one (`fabric`) and the host otherwise, or the override);
  3. `_check_memory`: the symmetric block fits NVSHMEM's heap, and the heap fits the GPU's free
     memory outside XLA's pool (cudaSetDevice + cudaFree(0) on this thread first);
  4. on several hosts, `bootstrap.pin_interface`; `zero_copy.prepare_env`; then
     `bootstrap.exchange_unique_id`;
  5. `_init`: the extension's runtime_init with the one `sizes.Params` record, as its
     `RuntimeParams` (nvshmem init, the symmetric block, the peer table, the host-mapped
     diagnostic record);
  6. `zero_copy.setup` (every rank takes the same decision).

The network facts of several hosts come from `jaxep.topology` (what the machine has and what
NVSHMEM makes of it; what the doctor reports), imported inside the functions that use them: to warn
before NVSHMEM's init on several hosts, to word its failure, and at INFO to log the NIC each GPU
will use.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax

from jaxep import _extension, _jax_private
from jaxep.runtime import bootstrap, node_layout, zero_copy
from jaxep.runtime.bootstrap import fail as _fail
from jaxep.runtime.sizes import HEAP_RESERVE, MEM_MARGIN, NVSHMEM_DEFAULT_HEAP, Params, \
    parse_size, recommended_env
from jaxep.topology import fabric

log = logging.getLogger("jaxep")


@dataclasses.dataclass(frozen=True)
class Started:
    """What `start` established: the record the extension holds, the hosts, whether XLA's pool is
    registered (zero-copy)."""
    params: Params
    hosts: tuple
    zero_copy: bool


@dataclasses.dataclass(frozen=True)
class _Process:
    pe: int
    nproc: int
    device: object
    ordinal: int


def shares_gpu() -> bool:
    """True under CUDA MPS (several ranks on one GPU)."""
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


def _this_process(ext) -> _Process:
    nproc, pe = jax.process_count(), jax.process_index()
    local = jax.local_devices()
    if len(local) != 1:
        _fail(f"the multi-rank CUDA backend needs exactly one local device per process, got "
              f"{len(local)} ({local}); start one process per GPU (python -m jaxep.launch), or set "
              "CUDA_VISIBLE_DEVICES / jax.distributed.initialize(local_device_ids=[i]) per process")
    if not _extension.multi_rank_built():
        _fail("this build of jaxep._jaxep_cuda has no NVSHMEM (build_info()['multi_rank'] is "
              "False), so EP size > 1 cannot run on the CUDA backend; rebuild with JAXEP_CUDA=<CUDA "
              "major> and the cu13/cu12 extra (docs/build.md), or pass backend='reference'")
    arch = _extension.arch_mismatch(local[0])
    if arch:
        _fail(f"{arch[0]}; {arch[1]}")
    max_ranks = _extension.constant("max_ranks")
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
    ordinal = getattr(local[0], "local_hardware_id", None)
    return _Process(pe, nproc, local[0], local[0].id if ordinal is None else int(ordinal))


def _rank_facts(ordinal: int) -> dict:
    """This rank's host, NVLink fabric domain and what would stop NVSHMEM from mapping it
    (node_layout.rank_facts, jaxep.topology.fabric)."""
    fab = fabric.read(fabric.nvml_index(ordinal))
    return node_layout.rank_facts(fab=fab, blockers=fabric.blockers(fab))


def _client():
    client = _jax_private.distributed_client()
    if client is None:
        _fail("jax.distributed is not initialized (the unique id travels through its key-value "
              "store); call jax.distributed.initialize() or start with python -m jaxep.launch")
    return client


def _check_memory(ext, params: Params, sym: int, n_configs: int, rec: dict) -> tuple[int, int]:
    """(heap bytes, free GPU bytes) once the symmetric block (`sym` bytes) fits the heap and the
    heap the GPU."""
    heap_env = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    heap = parse_size(heap_env) if heap_env else NVSHMEM_DEFAULT_HEAP
    if sym + HEAP_RESERVE > heap:
        _fail(f"the symmetric block needs {sym} bytes ({params.sizes_text(n_configs)}) but the "
              f"NVSHMEM heap is {heap} bytes (NVSHMEM_SYMMETRIC_SIZE={heap_env or 'unset: 1 GiB'}); "
              f"set NVSHMEM_SYMMETRIC_SIZE={rec['NVSHMEM_SYMMETRIC_SIZE']} in every process's "
              "environment, or lower capacity_factor / max_tokens_per_rank"
              + (" / rows_per_expert" if params.ll_experts else ""))
    free, total = ext.device_mem_info(params.device)  # also cudaSetDevice + cudaFree(0)
    need = heap + MEM_MARGIN
    if free < need:
        pre = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "unset (true)")
        frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset (0.75)")
        _fail(f"GPU {params.device} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB, "
              f"but NVSHMEM needs about {need / 2**30:.2f} GiB outside XLA's pool (heap {heap} B + "
              f"margin). JAX preallocates its pool (XLA_PYTHON_CLIENT_PREALLOCATE={pre}, "
              f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac}): set XLA_PYTHON_CLIENT_MEM_FRACTION lower "
              "(e.g. 0.75/ranks per GPU) or XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts")
    return heap, free


def _record(ext, params: Params):
    """`params` as the extension's one record (`RuntimeParams`, ffi/cuda/runtime.h InitParams)."""
    return ext.RuntimeParams(**dataclasses.asdict(params))


def network_findings(nodes: int) -> list[dict]:
    """The warnings and errors about NVSHMEM's network on this machine (`nodes` > 1 NVLink
    domains, so some peers are reached through the NICs), as the doctor reports them."""
    from jaxep import topology  # pylint: disable=g-import-not-at-top
    return [f for f in topology.summary(nodes=nodes)["findings"]
            if f["level"] in ("warn", "error")]


def _init(ext, record, uid: bytes, n_nodes: int, network) -> None:
    try:
        ext.runtime_init(record, uid)
    except RuntimeError as e:
        if n_nodes > 1 and network is None:
            network = network_findings(n_nodes)
        if not network:
            raise
        raise RuntimeError(
            f"jaxep.initialize: {e}. On {n_nodes} nodes, what this machine shows for "
            "NVSHMEM's network (python -m jaxep.doctor --nodes N prints it all): "
            + "; ".join(f"[{f['level']}] {f['what']} -> {f['hint']}" for f in network)) from e


def start(configs, generation: int) -> Started:
    """Sets up this process's PE (the steps of the module docstring); collective: every process
    calls it with the same `generation`, the key-value namespace of this attempt."""
    ext = _extension.module()
    config = configs[0]  # the SHARED_FIELDS are every config's
    proc = _this_process(ext)
    client = _client()
    wait_ms = int(max(60.0, config.timeout_s) * 1000)
    bootstrap.agree_configs(client, configs, proc.pe, proc.nproc, generation, wait_ms)
    facts = node_layout.gather_facts(client, proc.pe, proc.nproc, generation,
                                     _rank_facts(proc.ordinal), timeout_ms=wait_ms)
    hosts = tuple(f["host"] for f in facts)
    node = node_layout.layout_from_facts(facts, config.ranks_per_node)
    n_hosts = len(set(hosts))
    n_nodes = proc.nproc // node  # NVLink domains: NVSHMEM's network carries only what crosses them
    params = Params.of(configs, device=proc.ordinal, rank=proc.pe, size=proc.nproc, node_size=node)
    record = _record(ext, params)  # the one crossing into C++: sized here, started by _init
    sym = ext.symmetric_bytes(record)
    rec = recommended_env(sym, ranks_on_gpu=proc.nproc if shares_gpu() else 1, hosts=n_hosts,
                          nodes=n_nodes)
    heap, free = _check_memory(ext, params, sym, len(configs), rec)
    # Several nodes: what would stop or slow NVSHMEM's network transports, logged before its init
    # (which may end the process) by one rank per node; every rank adds it to an init failure. One
    # NVLink domain over several hosts (NVL72) sends nothing through the NICs: nothing to check.
    network = network_findings(n_nodes) if n_nodes > 1 and proc.pe % node == 0 else None
    for f in network or ():
        log.warning("jaxep network: %s; fix: %s", f["what"], f["hint"])
    bootstrap.pin_interface(n_hosts)  # before NVSHMEM opens its sockets (uid, init)
    zero_copy.prepare_env(config.zero_copy)  # before NVSHMEM reads its environment (uid, init)
    uid = bootstrap.exchange_unique_id(client, ext, proc.pe, generation, wait_ms)
    _init(ext, record, uid, n_nodes, network)
    try:
        zc = zero_copy.setup(ext, client, proc.pe, proc.nproc, proc.device, generation, wait_ms,
                             requested=config.zero_copy)
    except RuntimeError:
        ext.runtime_finalize(False)  # NVSHMEM's heap is gone: drop local state only
        raise
    _log_started(ext, proc, params, config, hosts, rec, sym, heap, free)
    return Started(params, hosts, zc)


def _log_started(ext, proc, params, config, hosts, rec, sym, heap, free) -> None:
    missing = [k for k in rec if os.environ.get(k) is None]
    node = params.node_size
    log.info("jaxep NVSHMEM %s: PE %d of %d on GPU %d (%s, compute capability %s; kernels built "
             "for %s), %d of %d processes per GPU; symmetric block %.1f MiB (heap %.1f MiB), "
             "capacity C=%d, timeout %.1f s; peers by nvshmem_ptr (load/store); free GPU memory "
             "before init %.2f GiB", ext.nvshmem_version(), proc.pe, proc.nproc, proc.ordinal,
             proc.device.device_kind, getattr(proc.device, "compute_capability", "?"),
             _extension.build_info().get("cuda_archs", "?"),
             proc.nproc if shares_gpu() else 1, proc.nproc, sym / 2**20, heap / 2**20,
             params.capacity, config.timeout_s, free / 2**30)
    log.info("jaxep node layout: %d node(s) x %d ranks (%s; rank = node * %d + local index), "
             "this rank: node %d, local %d; hosts: %s; peers of other nodes by NVSHMEM puts only",
             proc.nproc // node, node,
             "Config.ranks_per_node" if config.ranks_per_node else "processes per NVLink domain",
             node, proc.pe // node, proc.pe % node, node_layout.describe_hosts(list(hosts)))
    if log.isEnabledFor(logging.INFO):
        from jaxep import topology  # pylint: disable=g-import-not-at-top
        for line in topology.gpu_report(proc.ordinal):
            log.info("jaxep network: %s", line)
    log.info("jaxep recommends (not set by jaxep): %s%s",
             " ".join(f"{k}={v}" for k, v in rec.items()),
             f"; unset here: {', '.join(missing)}" if missing else "")
