"""jaxep.initialize's refusals in a multi-process GPU run (issue 3, deliverable 1), on CPU: the
extension, the devices and the distributed client are fakes, so each step of
`jaxep.runtime.nvshmem.start` (run as jaxep.initialize runs it, through the process's Runtime
object `jaxep.runtime.state.RUNTIME`) is reached in isolation and its message is asserted. What the GPU
tier cannot easily provoke (two local devices, NVSHMEM initialized by someone else, JAX holding
the memory NVSHMEM needs) is covered here; the real NVSHMEM init is covered by tests/gpu."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import types

import pytest

import jaxep
from jaxep import _extension, runtime
from jaxep.backends import cuda_calls
from jaxep import topology
from jaxep.runtime import bootstrap, node_layout, nvshmem, sizes, state, watchdog
from jaxep.runtime.state import RUNTIME

CFG = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=16)
GIB = 1 << 30
# What the extension's constants() returns (the lead's ffi/module.cc), for the fakes.
CONSTANTS = dict(max_experts=8192, max_ranks=1024, internode_max_topk=32, ll_max_topk=64,
                 fp8_block=128,
                 phases=dict(enumerate(["none", "free", "ready", "zero_copy", "credit",
                                        "remote_meta", "remote_rows", "return", "ll_counts",
                                        "ll_row", "ll_combine_row", "ll_combine_start"])),
                 ops={1: "dispatch", 2: "dispatch_rows", 3: "combine", 4: "gather_back",
                      5: "ll_dispatch", 6: "ll_combine"},
                 dispatch_kernels=("token", "row"),
                 combine_kernels=("warp", "thread"))


class FakeExt:
    """The pieces of jaxep._jaxep_cuda that nvshmem.start reads, with settable answers. `inits`:
    the fields of each runtime_init's record (its RuntimeParams) plus its unique_id; `symmetric`:
    the fields of each symmetric_bytes' record."""

    @staticmethod
    def RuntimeParams(**fields):  # noqa: N802  the extension's record, every field by keyword
        return types.SimpleNamespace(**fields)

    def __init__(self, status=0, free=80 * GIB, sym=1 << 20):
        self.status, self.free, self.sym, self.inits, self.symmetric = status, free, sym, [], []

    def constants(self):
        return CONSTANTS

    def nvshmem_init_status(self):
        return self.status

    def symmetric_bytes(self, params):
        self.symmetric.append(vars(params))
        return self.sym

    def device_mem_info(self, ordinal):
        return self.free, 141 * GIB

    def unique_id(self):
        return b"uid"

    def runtime_init(self, params, unique_id):
        self.inits.append(dict(vars(params), unique_id=unique_id))

    def nvshmem_version(self):
        return "fake"

    def build_info(self):
        return {"cuda_archs": "90,100", "multi_rank": True}

    def runtime_finalize(self, collective):
        self.finalized = getattr(self, "finalized", []) + [collective]

    def runtime_diag(self):
        return getattr(self, "diag", None)


class FakeWatchdog:
    """Stands for the watchdog thread Runtime starts after NVSHMEM (no thread in these tests)."""

    def __init__(self, diagnostic):
        self.diagnostic, self.stopped = diagnostic, False

    def stop(self):
        self.stopped = True


def _device(i):
    return types.SimpleNamespace(id=i, process_index=i, local_hardware_id=0, device_kind="fake")


class FakeKV:
    """JAX's distributed key-value client as initialize uses it (str and bytes values).

    A missing jaxep/config/<generation>/<r> key of a peer reads as the value this process
    published for that generation (peers with the same config), unless `agree` is False."""

    def __init__(self, agree=True):
        self.kv, self.agree = {}, agree

    def key_value_set(self, k, v):
        self.kv[k] = v

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, k, ms):
        if k not in self.kv and k.startswith("jaxep/host/"):  # every peer on this host
            mine = [v for key, v in self.kv.items() if key.rsplit("/", 1)[0] == k.rsplit("/", 1)[0]]
            if mine:
                return mine[0]
        if k not in self.kv and self.agree and k.startswith("jaxep/config/"):
            mine = [v for key, v in self.kv.items() if key.rsplit("/", 1)[0] == k.rsplit("/", 1)[0]]
            if mine:
                return mine[0]
        if k not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {k}")
        return self.kv[k]

    blocking_key_value_get_bytes = blocking_key_value_get


@pytest.fixture
def fake(monkeypatch):
    """Two processes, this one is process 0 with one device; every check passes by default."""
    ext = FakeExt()
    st = types.SimpleNamespace(local=[_device(0)], client=None)
    monkeypatch.setattr(_extension, "_module", ext)
    monkeypatch.setattr(_extension, "_constants", _extension.parse_constants(ext.constants()))
    monkeypatch.setattr(_extension, "multi_rank_built", lambda: True)
    monkeypatch.setattr(nvshmem.jax, "process_count", lambda: 2)
    monkeypatch.setattr(nvshmem.jax, "process_index", lambda: 0)
    monkeypatch.setattr(nvshmem.jax, "local_devices", lambda: st.local)
    monkeypatch.setattr(nvshmem.jax, "devices", lambda: [_device(0), _device(1)])
    monkeypatch.setattr(watchdog, "Watchdog", FakeWatchdog)
    # The runtime records what it started (its node layout among it); restored after the test (a
    # later test's EP size must not be checked against this fake's 2 processes per host).
    for name in ("started", "watchdog", "configs", "axis_name"):
        monkeypatch.setattr(RUNTIME, name, getattr(RUNTIME, name))
    # NVSHMEM_CUMEM_GRANULARITY: jaxep.initialize sets it (zero-copy); monkeypatch restores it.
    for k in ("NVSHMEM_SYMMETRIC_SIZE", "CUDA_MPS_PIPE_DIRECTORY", "NVSHMEM_CUMEM_GRANULARITY"):
        monkeypatch.delenv(k, raising=False)
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", None)
    st.ext = ext
    yield st


def _start(config):
    """What jaxep.initialize runs in a multi-process GPU run: the Runtime takes the attempt's
    generation (a fresh key-value namespace) and `nvshmem.start`s this process's PE."""
    RUNTIME._start(state.as_configs(config))  # pylint: disable=protected-access


def _init(fake) -> dict:
    """The keyword arguments of the one runtime_init call (NVSHMEM's init)."""
    (kwargs,) = fake.ext.inits
    return kwargs


def _refusal(match):
    with pytest.raises(RuntimeError, match=match) as e:
        _start(CFG)
    assert RUNTIME.started is None  # nothing recorded as started
    assert str(e.value).startswith("jaxep.initialize: ")
    return str(e.value)


def test_two_local_devices_are_refused(fake):
    fake.local = [_device(0), _device(1)]
    msg = _refusal("exactly one local device per process, got 2")
    assert "python -m jaxep.launch" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_nvshmem_initialized_by_someone_else_is_refused(fake):
    fake.ext.status = 2
    _refusal("NVSHMEM is already initialized in this process by someone else")


def test_jax_holding_the_memory_nvshmem_needs_is_refused(fake, monkeypatch):
    _client(monkeypatch)  # the node layout is agreed first (it sizes the symmetric block)
    fake.ext.free = 1 * GIB  # less than the 1 GiB default heap + margin
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    msg = _refusal("GPU 0 has 1.00 GiB free")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in msg and "XLA_PYTHON_CLIENT_PREALLOCATE" in msg


def test_symmetric_block_larger_than_the_heap_names_the_setting(fake, monkeypatch):
    _client(monkeypatch)
    fake.ext.sym = 2 * GIB
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1G")
    msg = _refusal("the symmetric block needs")
    assert "NVSHMEM_SYMMETRIC_SIZE=" in msg and "capacity_factor" in msg


def test_a_gpu_no_kernel_of_the_build_runs_on_is_refused(fake, monkeypatch):
    """Before anything collective: the build's archs, the GPU and the rebuild option."""
    fake.local = [types.SimpleNamespace(id=0, process_index=0, local_hardware_id=0,
                                        device_kind="NVIDIA B300", compute_capability="10.3")]
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda_archs": "90"})
    msg = _refusal("NVIDIA B300 \\(compute capability 10.3\\) runs none of them")
    assert 'JAXEP_CUDA_ARCHITECTURES="90;100"' in msg, msg


def test_processes_not_ordered_by_device_are_refused(fake, monkeypatch):
    monkeypatch.setattr(nvshmem.jax, "devices", lambda: [_device(1), _device(0)])
    _refusal(r"ordered by process .* got process indices \[1, 0\]")


def test_node_layout_override_reaches_nvshmem_init(fake, monkeypatch):
    """Config.ranks_per_node=1 splits the one host's 2 ranks into 2 emulated nodes."""
    _client(monkeypatch)
    _start(dataclasses.replace(CFG, ranks_per_node=1))
    assert _init(fake)["node_size"] == 1 and runtime.machine_ranks_per_node() == 1
    assert fake.ext.symmetric[0]["node_size"] == 1  # the buffers are laid out for it too


def test_missing_distributed_client_is_refused_before_nvshmem_init(fake):
    _refusal("jax.distributed is not initialized")
    assert fake.ext.inits == []  # nothing was initialized on the way


def _client(monkeypatch, **kw) -> FakeKV:
    from jax._src import distributed
    client = FakeKV(**kw)
    monkeypatch.setattr(distributed.global_state, "client", client)
    return client


def _uids(client):
    return [v for k, v in client.kv.items() if k.startswith("jaxep/nvshmem_uid/")]


def test_all_checks_pass_then_nvshmem_is_initialized(fake, monkeypatch):
    client = _client(monkeypatch)
    _start(CFG)
    init = _init(fake)
    # ordinal, PE, processes, ranks per node (both on this host: one node), the published uid
    assert (init["device"], init["rank"], init["size"], init["node_size"],
            init["unique_id"]) == (0, 0, 2, 2, b"uid")
    assert runtime.machine_ranks_per_node() == 2 and runtime.multi_rank_size() == 2
    assert isinstance(RUNTIME.watchdog, FakeWatchdog)  # the watchdog runs once NVSHMEM is up
    assert _uids(client) == [b"uid"]
    gen = RUNTIME.generation - 1
    assert client.kv[f"jaxep/config/{gen}/0"] == CFG.canonical()


def test_the_init_log_names_the_gpu_capability_and_the_archs_built(fake, monkeypatch, caplog):
    """JAXEP_LOG_LEVEL=INFO: the line that reports NVSHMEM's start says which GPU this rank has,
    its compute capability and the archs of the kernels (what a rebuild question needs)."""
    _client(monkeypatch)
    fake.local = [types.SimpleNamespace(id=0, process_index=0, local_hardware_id=0,
                                        device_kind="NVIDIA H200", compute_capability="9.0")]
    with caplog.at_level("INFO", logger="jaxep"):
        _start(CFG)
    assert any("on GPU 0 (NVIDIA H200, compute capability 9.0; kernels built for 90,100)"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("me", [0, 1])
def test_a_config_that_differs_between_ranks_is_refused_on_every_rank(fake, monkeypatch, me):
    """Rank 1 runs other knobs: both ranks raise, naming the fields and the ranks, before NVSHMEM."""
    monkeypatch.setattr(nvshmem.jax, "process_index", lambda: me)
    fake.local = [_device(me)]
    client = _client(monkeypatch, agree=False)
    gen = RUNTIME.generation
    cfgs = [CFG, dataclasses.replace(CFG, num_sms=16, combine_kernel="thread")]
    client.kv[f"jaxep/config/{gen}/{1 - me}"] = cfgs[1 - me].canonical()
    with pytest.raises(RuntimeError) as e:
        _start(cfgs[me])
    msg = str(e.value)
    assert msg.startswith("jaxep.initialize: the config must be identical on every rank"), msg
    assert "rank 1 vs rank 0: combine_kernel='thread' vs 'warp', num_sms=16 vs None" in msg, msg
    assert fake.ext.inits == [] and _uids(client) == []  # NVSHMEM never started


def test_a_rank_that_never_publishes_its_config_is_named(fake, monkeypatch):
    _client(monkeypatch, agree=False)
    with pytest.raises(RuntimeError, match=r"rank 1 did not publish its config within 100 s"):
        _start(CFG)
    assert fake.ext.inits == []


def test_canonical_config_text_is_field_exact():
    assert CFG.canonical() == jaxep.Config(**dataclasses.asdict(CFG)).canonical()
    for change in (dict(num_sms=8), dict(zero_copy=False), dict(dispatch_kernel="row"),
                   dict(timeout_s=5.0), dict(capacity_factor=None)):
        assert dataclasses.replace(CFG, **change).canonical() != CFG.canonical(), change
    assert re.search(r'"zero_copy": true', CFG.canonical())


def test_finalize_then_initialize_again_uses_a_fresh_unique_id(fake, monkeypatch):
    """initialize -> finalize (collective) -> initialize with another config: NVSHMEM is set up
    again under a new key-value key (a late rank can never read the previous run's unique id)."""
    client = _client(monkeypatch)
    monkeypatch.setattr(_extension, "is_available", lambda: True)
    monkeypatch.setattr(state.jax, "default_backend", lambda: "gpu")
    other = jaxep.Config(num_experts=16, topk=2, hidden=64, max_tokens_per_rank=16)
    try:
        jaxep.initialize(CFG)
        with pytest.raises(ValueError, match="already initialized with another config"):
            jaxep.initialize(other)
        jaxep.finalize()
        assert fake.ext.finalized == [True] and runtime.initialized_config() is None
        jaxep.initialize(other)
        assert runtime.initialized_config() == other and len(fake.ext.inits) == 2
        assert len(_uids(client)) == 2  # one unique-id key per initialization
        # After a timeout a peer may be dead: finalize drops local state without a collective.
        fake.ext.diag = dict(rank=0, op=1, seq=3, phase=2, peer=1, seen=0, awaited=3, waited_ns=5e9)
        with pytest.raises(jaxep.TimeoutError, match=r"rank 0 \(node 0, local 0\) timed out in "
                                                     r"dispatch \(call #3\), phase exchange .* "
                                                     r"waiting for peer rank 1 \(node 0, local 1\)"):
            jaxep.check()
        jaxep.finalize()
        assert fake.ext.finalized == [True, False] and RUNTIME.started is None
    finally:
        RUNTIME.configs, RUNTIME.axis_name, RUNTIME.started = (), None, None


def test_several_configs_size_the_runtime_for_the_largest(fake, monkeypatch):
    """initialize([train, decode]): both agreed (each with their number), and the runtime is
    started with the largest tokens, rows and row bytes of the two."""
    client = _client(monkeypatch)
    decode = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                          mode="low_latency", rows_per_expert=64)
    _start([CFG, decode])
    init = _init(fake)
    gen = RUNTIME.generation - 1
    assert '"number of configs": 2' in client.kv[f"jaxep/config/{gen}/0"]
    assert decode.canonical()[:-1] in client.kv[f"jaxep/config/{gen}/1/0"].replace(
        ', "number of configs": 2', "")
    # max tokens 16, topk 2, experts 8, rows max(C=40, L*M=4*64=256), row bytes (bf16 rows)
    sized = ("max_tokens", "topk", "experts", "capacity", "row_bytes")
    assert tuple(init[k] for k in sized) == (16, 2, 8, 256, 64 * 2), init
    assert tuple(fake.ext.symmetric[0][k] for k in sized) == (16, 2, 8, 256, 64 * 2)


def test_a_rank_with_another_number_of_configs_is_refused(fake, monkeypatch):
    client = _client(monkeypatch, agree=False)
    gen = RUNTIME.generation
    client.kv[f"jaxep/config/{gen}/1"] = CFG.canonical()  # rank 1: one config
    decode = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                          mode="low_latency")
    with pytest.raises(RuntimeError, match="number of configs=None vs 2"):
        _start([CFG, decode])
    assert fake.ext.inits == []


def test_the_low_latency_area_is_sized_from_the_low_latency_configs(fake, monkeypatch):
    """initialize passes the area (L local experts, min(M, T) rows per (expert, source)) to the
    runtime, from the low-latency configs only; none without one."""
    _client(monkeypatch)
    decode = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                          mode="low_latency", rows_per_expert=64)
    _start([CFG, decode])
    init = _init(fake)
    assert (init["ll_experts"], init["ll_cap"]) == (4, 4), init  # L = 8 / 2, min(M=64, T=4)
    assert sizes.ll_area_sizes([CFG], 2) == dict(ll_experts=0, ll_cap=0)
    small = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                         mode="low_latency", rows_per_expert=3)
    big_t = jaxep.Config(num_experts=16, topk=2, hidden=64, max_tokens_per_rank=32,
                         mode="low_latency", rows_per_expert=24)
    assert sizes.ll_area_sizes([small, big_t], 2) == dict(ll_experts=8, ll_cap=24)
    assert sizes.ll_area_sizes([small], 2) == dict(ll_experts=4, ll_cap=3)  # min(M=3, T=4)


# The low-latency area's rows and flags at the `ll128` bench shapes (8 ranks, E=256, T=128,
# H=7168 bf16, K=8, M = 8 * 128): 2 halves x L=32 x R=8 x rows x (14336 B + an 8 B flag), with
# min(M, T) = 128 rows per (expert, source); min(M, T*K) = 1024 rows would take K = 8 times it.
LL128_AREA = 2 * 32 * 8 * 128 * (7168 * 2 + 8)
LL128_AREA_T_TIMES_K = 2 * 32 * 8 * 1024 * (7168 * 2 + 8)


def test_the_low_latency_area_bytes_at_the_ll128_shapes():
    ll128 = jaxep.Config(num_experts=256, topk=8, hidden=7168, max_tokens_per_rank=128,
                         dtype="bfloat16", mode="low_latency")
    assert sizes.ll_area_sizes([ll128], 8) == dict(ll_experts=32, ll_cap=128)
    got = sizes.ll_area_bytes([ll128], 8)
    assert got == LL128_AREA == 940_048_384 and LL128_AREA_T_TIMES_K == 7_520_387_072
    assert got * ll128.topk == LL128_AREA_T_TIMES_K
    assert sizes.ll_area_bytes([CFG], 8) == 0  # no low-latency config: no area
    # M below T bounds the rows; f32 rows are twice as wide (a 16-byte aligned stride).
    m64 = dataclasses.replace(ll128, rows_per_expert=64)
    assert sizes.ll_area_bytes([m64], 8) == 2 * 32 * 8 * 64 * (7168 * 2 + 8)
    odd = jaxep.Config(num_experts=16, topk=2, hidden=5, max_tokens_per_rank=4, dtype="float32",
                       mode="low_latency")
    assert sizes.ll_area_bytes([odd], 2) == 2 * 8 * 2 * 4 * (32 + 8)  # 20 B rows -> 32 B


@pytest.mark.skipif(not _extension.multi_rank_built(), reason="extension without NVSHMEM")
def test_the_low_latency_area_bytes_match_the_extension_layout():
    """The symmetric heap of the runtime of the ll128 decode config minus the same runtime without
    the area: the area's rows and flags (ll_area_bytes) plus its counts messages and combine rows."""
    m = _extension._module
    ll128 = jaxep.Config(num_experts=256, topk=8, hidden=7168, max_tokens_per_rank=128,
                         dtype="bfloat16", mode="low_latency")
    p = sizes.Params.of([ll128], device=0, rank=0, size=8, node_size=8)

    def heap(params):
        return m.symmetric_bytes(m.RuntimeParams(**dataclasses.asdict(params)))

    extra = heap(p) - heap(dataclasses.replace(p, ll_experts=0, ll_cap=0))
    area = sizes.ll_area_bytes([ll128], 8)
    assert area <= extra < area + (64 << 20), (area, extra)  # messages, combine rows: < 64 MiB


def test_the_low_latency_heap_refusal_names_the_area_and_rows_per_expert(fake, monkeypatch):
    _client(monkeypatch)
    fake.ext.sym = 3 << 30
    decode = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                          mode="low_latency")
    with pytest.raises(RuntimeError, match=r"low-latency area for L=4 experts x 2 sources x 4 rows"
                                           r" x 2 halves.*NVSHMEM_SYMMETRIC_SIZE=.*rows_per_expert"):
        _start(decode)


def _ll_runtime(monkeypatch, **over):
    """A runtime with a low-latency area (its limits updated by `over`), of an extension with
    CONSTANTS' limits."""
    info = dict(size=2, node_size=2, max_tokens=4, topk=2, experts=8, capacity=64,
                stage_bytes=1 << 20, ll_experts=4, ll_cap=8, ll_row_bytes=128)
    info.update(over)
    monkeypatch.setattr(_extension, "_constants", _extension.parse_constants(CONSTANTS))
    monkeypatch.setattr(cuda_calls, "runtime_limits", lambda op, ep: info)


@pytest.mark.parametrize("over,match", [
    (dict(ll_experts=2), r"local experts must be <= 2 .*got 4"),
    (dict(ll_cap=4), r"rows per \(expert, source\) min\(M, T\) must be <= 4 .*got 8"),
    (dict(ll_row_bytes=64), r"row bytes must be <= 64 .*got 128"),
    (dict(node_size=1), r"ranks_per_node must be the node layout jaxep.initialize set up \(1 "),
])
def test_low_latency_calls_that_do_not_fit_the_area_are_refused(monkeypatch, over, match):
    _ll_runtime(monkeypatch, **over)
    with pytest.raises(ValueError, match=r"jaxep\.backends\.cuda_calls\.ll_dispatch_send: " + match):
        cuda_calls._check_ll_fits("ll_dispatch_send", 2, 2, experts=8, slots=8, cap=8,  # pylint: disable=protected-access
                            row_bytes=128, topk=2)


def test_low_latency_calls_that_fit_the_area_pass(monkeypatch):
    _ll_runtime(monkeypatch)
    cuda_calls._check_ll_fits("ll_dispatch_send", 2, 2, experts=8, slots=8, cap=8,  # pylint: disable=protected-access
                        row_bytes=128, topk=2)
    with pytest.raises(ValueError, match=r"config.topk must be <= 64"):
        cuda_calls._check_ll_fits("ll_combine_recv", 2, 2, experts=8, slots=8, cap=0,  # pylint: disable=protected-access
                            row_bytes=128, topk=65)


def _facts(host: str) -> str:
    """What a rank on `host` without an NVLink fabric publishes (node_layout.rank_facts)."""
    return json.dumps(node_layout.rank_facts(host), sort_keys=True)


def _two_hosts(client, monkeypatch, findings):
    """Process 1 publishes another host (so 2 nodes of 1), and topology.summary reports
    `findings` (this CPU machine's own would depend on it)."""
    gen = RUNTIME.generation
    client.kv[f"jaxep/host/{gen}/1"] = _facts("node1")
    seen = []

    def summary(nodes=None):
        seen.append(nodes)
        return {"findings": findings}
    monkeypatch.setattr(topology, "summary", summary)
    return seen


NO_GDR = dict(level="error", what="no GPUDirect RDMA: CUDA reports no dma-buf support ...",
              hint="sudo modprobe nvidia-peermem")


def test_an_nvshmem_init_failure_across_hosts_carries_the_network_findings(fake, monkeypatch,
                                                                           caplog):
    """Two hosts, NVSHMEM's init fails (as it does without GPUDirect RDMA: "Peer GPU N is not
    accessible"): the findings were logged before the init and end the message."""
    seen = _two_hosts(_client(monkeypatch), monkeypatch,
                      [NO_GDR, dict(level="info", what="an info line", hint="-")])

    def fail(params, unique_id):
        raise RuntimeError("NVSHMEM initialization (unique id bootstrap) failed with status 7 "
                           "(NVSHMEM_DEBUG=INFO shows why)")
    monkeypatch.setattr(fake.ext, "runtime_init", fail)
    with caplog.at_level("WARNING", logger="jaxep"):
        text = _refusal("failed with status 7")
    assert seen == [2]
    assert "On 2 nodes, what this machine shows for NVSHMEM's network" in text
    assert text.endswith("[error] no GPUDirect RDMA: CUDA reports no dma-buf support ... -> "
                         "sudo modprobe nvidia-peermem")
    assert "an info line" not in text
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("jaxep network")] == [
        "jaxep network: no GPUDirect RDMA: CUDA reports no dma-buf support ...; fix: sudo "
        "modprobe nvidia-peermem"]


@pytest.mark.parametrize("domain", [None, "nvlink 0a0b clique 7"])
def test_an_nvshmem_init_failure_on_one_node_is_raised_as_it_is(fake, monkeypatch, domain):
    """One node: one host (domain None), or two hosts of one NVLink domain (NVL72 trays), where
    every peer is reached by NVLink. The NICs' findings are neither asked for, logged nor added to
    an init failure."""
    client = _client(monkeypatch)
    if domain is not None:
        client.kv[f"jaxep/host/{RUNTIME.generation}/1"] = json.dumps(
            dict(host="tray1", nvlink=domain, blockers=[]), sort_keys=True)
        monkeypatch.setattr(nvshmem, "_rank_facts",
                            lambda ordinal: dict(host="tray0", nvlink=domain, blockers=[]))
    monkeypatch.setattr(topology, "summary", lambda nodes=None: pytest.fail("asked"))

    def fail(params, unique_id):
        raise RuntimeError("NVSHMEM initialization failed with status 7")
    monkeypatch.setattr(fake.ext, "runtime_init", fail)
    with pytest.raises(RuntimeError) as e:
        _start(CFG)
    assert str(e.value) == "NVSHMEM initialization failed with status 7"


IFNAME, FAMILY = "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY"


def _unset_restored(monkeypatch, *names):
    """Unset `names` for the test and remove whatever the code under test sets afterwards."""
    for n in names:
        monkeypatch.setenv(n, "placeholder")  # records the original state for the undo
        monkeypatch.delenv(n)


def _bootstrap_env_at_unique_id(fake, monkeypatch):
    """What NVSHMEM would read when PE 0 makes the unique id (its bootstrap's listen socket)."""
    seen = {}

    def unique_id():
        seen.update({k: os.environ.get(k) for k in (IFNAME, FAMILY)})
        return b"uid"
    monkeypatch.setattr(fake.ext, "unique_id", unique_id)
    return seen


def test_across_hosts_nvshmem_bootstrap_uses_the_interface_that_reaches_jax(fake, monkeypatch,
                                                                            caplog):
    """NVSHMEM's unique-id bootstrap picks its own interface (an ib* one, else the first but
    docker/lo), which the other host may not reach (then "Connection timed out" in bootstrap_init,
    the symptom of DeepEP issue 150): on several hosts initialize points it at the route to JAX's coordinator."""
    _unset_restored(monkeypatch, IFNAME, FAMILY)
    _two_hosts(_client(monkeypatch), monkeypatch, [])
    monkeypatch.setattr(bootstrap._jax_private, "coordinator_address", lambda: "node0:29500")
    asked = []
    monkeypatch.setattr(bootstrap, "route_interface",
                        lambda a: asked.append(a) or ("ens2", "10.0.0.5", "AF_INET"))
    seen = _bootstrap_env_at_unique_id(fake, monkeypatch)
    with caplog.at_level("INFO", logger="jaxep"):
        _start(CFG)
    assert asked == ["node0:29500"] and seen == {IFNAME: "=ens2", FAMILY: "AF_INET"}
    assert any("interface ens2 (10.0.0.5, AF_INET), the one that reaches JAX's coordinator "
               "node0:29500" in r.getMessage() for r in caplog.records)


def test_the_bootstrap_interface_set_by_the_user_or_on_one_host_is_left_alone(fake, monkeypatch):
    _unset_restored(monkeypatch, IFNAME, FAMILY)
    monkeypatch.setattr(bootstrap, "route_interface", lambda a: pytest.fail("asked"))
    monkeypatch.setattr(bootstrap._jax_private, "coordinator_address", lambda: "node0:29500")
    seen = _bootstrap_env_at_unique_id(fake, monkeypatch)
    client = _client(monkeypatch)
    _start(CFG)  # one host
    assert seen == {IFNAME: None, FAMILY: None}
    monkeypatch.setenv(IFNAME, "eno1")
    _two_hosts(client, monkeypatch, [])
    _start(CFG)
    assert seen == {IFNAME: "eno1", FAMILY: None}


@pytest.mark.parametrize("route", [None, ("lo", "127.0.0.1", "AF_INET")])
def test_no_route_to_the_coordinator_leaves_nvshmem_its_choice_and_says_so(fake, monkeypatch,
                                                                           caplog, route):
    _unset_restored(monkeypatch, IFNAME, FAMILY)
    _two_hosts(_client(monkeypatch), monkeypatch, [])
    monkeypatch.setattr(bootstrap._jax_private, "coordinator_address", lambda: "node0:29500")
    monkeypatch.setattr(bootstrap, "route_interface", lambda a: route)
    seen = _bootstrap_env_at_unique_id(fake, monkeypatch)
    with caplog.at_level("WARNING", logger="jaxep"):
        _start(CFG)
    assert seen == {IFNAME: None, FAMILY: None}
    assert any("NVSHMEM's bootstrap picks its own" in r.getMessage() and IFNAME in r.getMessage()
               for r in caplog.records)


def test_a_unique_id_rank_0_cannot_make_fails_every_rank_at_once(fake, monkeypatch):
    """NVSHMEM's bootstrap finds no socket interface (as seen on the lent GPU machine: "No socket
    interface found", nvshmemx_get_uniqueid status 7): rank 0 raises naming the variable that chooses the
    interface and publishes the error, so rank 1 raises the same at once instead of waiting."""
    _unset_restored(monkeypatch, IFNAME, FAMILY)
    monkeypatch.setenv(IFNAME, "=nosuch0")
    client = _client(monkeypatch)
    gen = RUNTIME.generation

    def no_interface():
        raise RuntimeError("nvshmemx_get_uniqueid failed with status 7")
    monkeypatch.setattr(fake.ext, "unique_id", no_interface)
    text = _refusal("nvshmemx_get_uniqueid failed with status 7: NVSHMEM's unique-id bootstrap")
    assert f"{IFNAME}==nosuch0; family either" in text and fake.ext.inits == []
    published = client.kv[f"jaxep/nvshmem_uid/{gen}"]
    # rank 1 reads it: the same words, at once
    monkeypatch.setattr(nvshmem.jax, "process_index", lambda: 1)
    fake.local = [_device(1)]
    client.kv[f"jaxep/nvshmem_uid/{gen + 1}"] = published  # the retry's fresh namespace
    text1 = _refusal("rank 0 could not create NVSHMEM's unique id: nvshmemx_get_uniqueid failed")
    assert text1.endswith(text[len("jaxep.initialize: "):])
    assert fake.ext.inits == []


def test_only_node_leaders_read_the_network_before_init_the_others_on_failure(fake, monkeypatch):
    """4 ranks on 2 hosts (2 per node): rank 1 is not its node's first, so it reads no network
    findings while starting (no nvidia-smi per rank), and reads them only when NVSHMEM fails."""
    monkeypatch.setattr(nvshmem.jax, "process_count", lambda: 4)
    monkeypatch.setattr(nvshmem.jax, "process_index", lambda: 1)
    monkeypatch.setattr(nvshmem.jax, "devices", lambda: [_device(i) for i in range(4)])
    monkeypatch.setattr(bootstrap, "pin_interface", lambda hosts: None)
    fake.local = [_device(1)]
    client = _client(monkeypatch)
    seen = []

    def summary(nodes=None):
        seen.append(nodes)
        return {"findings": [NO_GDR]}
    monkeypatch.setattr(topology, "summary", summary)

    def publish_the_others():
        gen = RUNTIME.generation
        client.kv[f"jaxep/host/{gen}/0"] = _facts(node_layout.this_host())
        for r in (2, 3):
            client.kv[f"jaxep/host/{gen}/{r}"] = _facts("node1")
        client.kv[f"jaxep/nvshmem_uid/{gen}"] = b"uid"
    publish_the_others()
    _start(CFG)
    assert seen == [] and _init(fake)["node_size"] == 2  # started as 2 nodes x 2, nothing read
    RUNTIME.started = None  # as after a finalize that dropped the runtime locally

    def fail(params, unique_id):
        raise RuntimeError("NVSHMEM bootstrapped the 4 PEs but could not initialize (status 1)")
    monkeypatch.setattr(fake.ext, "runtime_init", fail)
    publish_the_others()
    with pytest.raises(RuntimeError) as e:
        _start(CFG)
    assert seen == [2]
    assert str(e.value).endswith("[error] " + NO_GDR["what"] + " -> " + NO_GDR["hint"])
