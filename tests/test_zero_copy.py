"""Zero-copy inputs (docs/zero_copy.md B1; on by default, Config.zero_copy=False off), CPU tier: the
switch, the decision (identical on every rank, from every rank's facts) and the setup sequence with
a fake extension and a fake key-value store. The registration and the kernels run only in tests/gpu."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

import test_runtime_checks as trc  # tests/ is on sys.path (pytest's rootdir-relative import)
from jaxep import _extension, runtime
from jaxep.runtime import nvshmem, watchdog, zero_copy
from jaxep.runtime.state import RUNTIME

GIB = 1 << 30
POOL = 13 * GIB + 2 * (1 << 20)  # a 2 MiB multiple, like XLA's preallocated BFC pool


def _facts(rank, **kw):
    f = dict(rank=rank, requested=True, base=0x7f0000000000 + rank * POOL, size=POOL, vmm=1,
             handle_types=zero_copy.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, gran_rec=2 << 20,
             why="", gran_env="2097152", want_handle=zero_copy.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
             nvshmem="3.8.0", supported=True, asserts=False, error_checks=False, shared_gpu=True)
    f.update(kw)
    return f


def _all(n=8, per_rank=None):
    """n ranks' facts; per_rank maps a rank to overrides."""
    return [_facts(r, **(per_rank or {}).get(r, {})) for r in range(n)]


def test_on_by_default_and_a_config_field():
    assert trc.CFG.zero_copy is True
    assert not hasattr(zero_copy, "requested") and not hasattr(zero_copy, "ENV")  # no env switch


def test_all_ranks_equal_turns_it_on():
    on, why = zero_copy.decide(_all())
    assert on and "one VMM allocation" in why


@pytest.mark.parametrize("facts,reason", [
    (_all(2, {1: dict(size=POOL - (2 << 20))}), "pool sizes differ"),
    (_all(4, {2: dict(vmm=0, why="not a VMM allocation (cuMemRetainAllocationHandle failed (1))")}),
     r"not one VMM allocation on ranks \[2\]"),
    (_all(2, {0: dict(gran_env=None), 1: dict(gran_env=None)}), "NVSHMEM_CUMEM_GRANULARITY must be"),
    (_all(2, {1: dict(gran_env=None)}), "NVSHMEM_CUMEM_GRANULARITY must be"),
    (_all(2, {0: dict(gran_env="512M"), 1: dict(gran_env="512M")}), "NVSHMEM_CUMEM_GRANULARITY"),
    (_all(2, {1: dict(requested=False)}), r"turned off \(Config.zero_copy=False\) on ranks \[1\]"),
    (_all(2, {0: dict(nvshmem="3.3.8")}), "needs >= 3.3.9"),
    (_all(2, {1: dict(supported=False)}), "needs >= 3.3.9"),
    (_all(2, {1: dict(handle_types=zero_copy.CU_MEM_HANDLE_TYPE_FABRIC)}), "lack NVSHMEM's heap type"),
    (_all(2, {1: dict(asserts=None)}), "assert"),
    (_all(2, {0: dict(error_checks=True)}), "NVSHMEM_ENABLE_ERROR_CHECKS"),
    ([_facts(r, size=POOL + 4096) for r in range(2)], "not a multiple of NVSHMEM's granularity"),
])
def test_any_condition_off_turns_it_off_with_a_reason(facts, reason):
    on, why = zero_copy.decide(facts)
    assert not on
    assert re.search(reason, why), why


def test_small_pool_does_not_need_the_assert_check():
    facts = [_facts(r, size=2 * GIB, asserts=True) for r in range(2)]
    assert zero_copy.decide(facts)[0]


def test_granularity_in_nvshmem_syntax_is_accepted():
    assert zero_copy.decide(_all(2, {r: dict(gran_env="2M") for r in range(2)}))[0]


def test_decision_is_the_same_whatever_rank_evaluates_it():
    facts = _all(4, {3: dict(size=POOL * 2)})
    assert len({zero_copy.decide(json.loads(json.dumps(facts))) for _ in range(4)}) == 1


class FakeExt:
    def __init__(self, reg=("", False, 12.5)):
        self.reg, self.registered, self.enabled = reg, [], 0

    def nvshmem_version(self):
        return "3.8.0"

    def pool_registration_supported(self):
        return True

    def register_pool(self, base, size):
        self.registered.append((base, size))
        return self.reg

    def enable_pool(self):
        self.enabled += 1


class FakeKV:
    """JAX's key-value store as setup uses it; `peers` pre-publishes the other ranks' values."""

    def __init__(self, peers):
        self.kv = dict(peers)

    def key_value_set(self, k, v):
        self.kv[k] = v

    def blocking_key_value_get(self, k, ms):
        if k not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {k}")
        return self.kv[k]


def _setup(ext, peer_facts, mine, registered_err=""):
    peers = {f"jaxep/zero_copy/0/facts/{f['rank']}": json.dumps(f) for f in peer_facts}
    peers.update({f"jaxep/zero_copy/0/registered/{f['rank']}":
                  json.dumps({"rank": f["rank"], "err": registered_err}) for f in peer_facts})
    kv = FakeKV(peers)
    on = zero_copy.setup(ext, kv, 0, 1 + len(peer_facts), device=None, generation=0, wait_ms=10,
                         requested=True, pointer=lambda d: (0x1234, None),
                         facts_fn=lambda e, ptr, rank: dict(mine, rank=rank))
    return on, kv


def test_setup_registers_and_enables_when_every_rank_agrees():
    ext = FakeExt()
    on, kv = _setup(ext, [_facts(1)], _facts(0))
    assert on and ext.registered == [(_facts(0)["base"], POOL)] and ext.enabled == 1
    assert json.loads(kv.kv["jaxep/zero_copy/0/facts/0"])["size"] == POOL


def test_setup_off_does_not_register(caplog):
    ext = FakeExt()
    with caplog.at_level("INFO", logger="jaxep"):
        on, _ = _setup(ext, [_facts(1, size=POOL * 2)], _facts(0))
    assert not on and ext.registered == [] and ext.enabled == 0
    assert "jaxep zero-copy: off: XLA's pool sizes differ" in caplog.text


def test_setup_a_rank_turned_off_publishes_that_and_all_stay_off(caplog):
    ext, kv = FakeExt(), FakeKV({"jaxep/zero_copy/0/facts/1": json.dumps(_facts(1))})

    def never(device):
        raise AssertionError("a rank with zero-copy off must not query its pool")
    with caplog.at_level("INFO", logger="jaxep"):
        on = zero_copy.setup(ext, kv, 0, 2, None, 0, 10, requested=False, pointer=never)
    assert not on and ext.registered == [] and ext.enabled == 0
    assert json.loads(kv.kv["jaxep/zero_copy/0/facts/0"])["requested"] is False
    assert "off: turned off (Config.zero_copy=False) on ranks [0]" in caplog.text


def test_setup_a_peer_that_never_publishes_times_out_and_all_stay_off(caplog):
    ext = FakeExt()
    with caplog.at_level("INFO", logger="jaxep"):
        on = zero_copy.setup(ext, FakeKV({}), 0, 2, None, 0, 10, requested=True,
                             pointer=lambda d: (1, None), facts_fn=lambda e, p, r: _facts(r))
    assert not on and ext.registered == [] and "exchange of pool facts failed" in caplog.text


def test_setup_a_failing_local_query_still_publishes_and_turns_it_off(caplog):
    ext, kv = FakeExt(), FakeKV({"jaxep/zero_copy/0/facts/1": json.dumps(_facts(1))})

    def broken(device):
        raise AttributeError("no unsafe_buffer_pointer")
    with caplog.at_level("INFO", logger="jaxep"):
        on = zero_copy.setup(ext, kv, 0, 2, None, 0, 10, requested=True, pointer=broken)
    assert not on and ext.registered == [] and "jaxep/zero_copy/0/facts/0" in kv.kv
    assert "pool query failed: AttributeError" in caplog.text


def test_setup_a_peer_without_peer_addresses_keeps_everyone_staging():
    ext = FakeExt()
    on, _ = _setup(ext, [_facts(1)], _facts(0), registered_err="nvshmem_ptr ... NULL for PE 0")
    assert not on and len(ext.registered) == 1 and ext.enabled == 0


def test_setup_refused_registration_is_fatal():
    ext = FakeExt(reg=("returned NULL", True, 3.0))
    with pytest.raises(RuntimeError, match=r"NVSHMEM freed its heap.*zero_copy=False"):
        _setup(ext, [_facts(1)], _facts(0))


# --- the hook in jaxep.initialize: Config.zero_copy decides ---------------------------------------

def _fake_runtime(monkeypatch):
    """The minimum of test_runtime_checks.py's fake for nvshmem.start to reach runtime_init."""
    from jax._src import distributed
    ext = trc.FakeExt()
    monkeypatch.setattr(_extension, "_module", ext)
    monkeypatch.setattr(_extension, "_constants", _extension.parse_constants(ext.constants()))
    monkeypatch.setattr(_extension, "multi_rank_built", lambda: True)
    monkeypatch.setattr(nvshmem.jax, "process_count", lambda: 2)
    monkeypatch.setattr(nvshmem.jax, "process_index", lambda: 0)
    monkeypatch.setattr(nvshmem.jax, "local_devices", lambda: [trc._device(0)])  # pylint: disable=protected-access
    monkeypatch.setattr(nvshmem.jax, "devices", lambda: [trc._device(0), trc._device(1)])  # pylint: disable=protected-access
    monkeypatch.setattr(watchdog, "Watchdog", trc.FakeWatchdog)
    # The runtime records what it started (its node layout, zero-copy); restored after the test (a
    # later test's EP size must not be checked against this fake's 2 processes per host).
    for name in ("started", "watchdog", "configs", "axis_name"):
        monkeypatch.setattr(RUNTIME, name, getattr(RUNTIME, name))
    # NVSHMEM_CUMEM_GRANULARITY: jaxep.initialize sets it (zero-copy); monkeypatch restores it.
    for k in ("NVSHMEM_SYMMETRIC_SIZE", "CUDA_MPS_PIPE_DIRECTORY", "NVSHMEM_CUMEM_GRANULARITY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(distributed.global_state, "client", trc.FakeKV())
    return ext


@pytest.mark.parametrize("setup_says", [True, False])
@pytest.mark.parametrize("wanted", [True, False])
def test_initialize_always_takes_part_in_the_decision(monkeypatch, setup_says, wanted):
    ext = _fake_runtime(monkeypatch)
    calls = []
    monkeypatch.setattr(zero_copy, "setup", lambda *a, **k: calls.append(k) or setup_says)
    try:
        trc._start(dataclasses.replace(trc.CFG, zero_copy=wanted))  # pylint: disable=protected-access
        assert len(ext.inits) == 1 and len(calls) == 1
        assert calls[0]["requested"] is wanted  # Config.zero_copy reaches the decision
        assert runtime.zero_copy_enabled() is setup_says
    finally:
        RUNTIME.started = None


@pytest.mark.parametrize("wanted,preset,expect", [
    (True, None, "2097152"),     # default: zero-copy wanted, NVSHMEM needs 2 MiB granularity
    (False, None, None),         # off: NVSHMEM's environment untouched
    (True, "536870912", "536870912"),  # the user's choice wins (decide() then says off, and why)
])
def test_initialize_sets_the_granularity_before_nvshmem_starts(monkeypatch, caplog, wanted, preset,
                                                               expect):
    ext = _fake_runtime(monkeypatch)
    seen = []  # the variable when NVSHMEM first runs: rank 0's unique id, before its init
    real_uid = ext.unique_id
    monkeypatch.setattr(ext, "unique_id", lambda: seen.append(
        os.environ.get("NVSHMEM_CUMEM_GRANULARITY")) or real_uid(), raising=False)
    monkeypatch.setattr(zero_copy, "setup", lambda *a, **k: False)
    if preset is None:
        monkeypatch.delenv("NVSHMEM_CUMEM_GRANULARITY", raising=False)
    else:
        monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", preset)
    try:
        with caplog.at_level("INFO", logger="jaxep"):
            trc._start(dataclasses.replace(trc.CFG, zero_copy=wanted))  # pylint: disable=protected-access
        assert seen == [expect]
        wrote = "set NVSHMEM_CUMEM_GRANULARITY=2097152 in this process's environment" in caplog.text
        assert wrote is (wanted and preset is None), caplog.text  # logged exactly when written
    finally:
        RUNTIME.started = None


def test_fatal_registration_drops_the_runtime_locally(monkeypatch):
    ext = _fake_runtime(monkeypatch)

    def refuse(*a, **k):
        raise RuntimeError("jaxep.initialize: zero-copy registration failed")
    monkeypatch.setattr(zero_copy, "setup", refuse)
    with pytest.raises(RuntimeError, match="zero-copy registration failed"):
        trc._start(trc.CFG)  # pylint: disable=protected-access
    assert ext.finalized == [False] and RUNTIME.started is None
    assert not runtime.zero_copy_enabled() and runtime.multi_rank_size() == 0
