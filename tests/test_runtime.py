"""CPU tier: the multi-rank runtime's Python side (no GPU needed): trace-time errors of the
multi-rank CUDA path, check()/diagnostic() without a runtime, NVSHMEM settings helpers."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxep
from jaxep import _extension, runtime
from jaxep import backends
from jaxep.runtime import sizes
from jaxep.backends import cuda_calls


def test_check_is_a_noop_without_runtime():
    jaxep.check()
    assert runtime.diagnostic() is None
    assert runtime.multi_rank_size() == 0


def test_timeout_error_is_a_builtin_timeout_error():
    assert issubclass(jaxep.TimeoutError, TimeoutError)


@pytest.mark.parametrize("text,value", [("1073741824", 1 << 30), ("2G", 2 << 30), ("512M", 512 << 20),
                                        ("64k", 64 << 10), ("1.5G", int(1.5 * (1 << 30)))])
def test_parse_symmetric_size(text, value):
    assert sizes.parse_size(text) == value


def test_recommended_env():
    rec = sizes.recommended_env(3 << 30, ranks_on_gpu=8)
    assert rec["NVSHMEM_DISABLE_NVLS"] == "1"
    assert int(rec["NVSHMEM_SYMMETRIC_SIZE"]) >= 3 << 30
    assert rec["NVSHMEM_DISABLE_NCCL"] == "1"
    assert "NVSHMEM_DISABLE_NCCL" not in sizes.recommended_env(1 << 20)
    assert sizes.recommended_env(1 << 20, hosts=2)["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    one_domain = sizes.recommended_env(1 << 20, hosts=2, nodes=1)  # NVL72 trays: no NIC traffic
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in one_domain
    assert "NVSHMEM_REMOTE_TRANSPORT" not in one_domain


def test_cuda_backend_multi_rank_needs_the_runtime():
    with pytest.raises(ValueError, match=r"backend='cuda'.*EP size 2|needs the CUDA extension and a GPU"):
        backends.select("dispatch", "cuda", 2)
    assert backends.select("dispatch", None, 2) == "reference"


@pytest.mark.skipif(not _extension.is_available(), reason="CUDA extension not built")
def test_ffi_multi_rank_without_runtime_raises_at_trace_time():
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    i = jax.ShapeDtypeStruct((4, 2), jnp.int32)
    w = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4, dtype="float32")
    f = lambda x, i, w: cuda_calls.dispatch(x, i, w, config=cfg, capacity=16, ep_size=2)
    exc = RuntimeError if _extension.multi_rank_built() else NotImplementedError
    with pytest.raises(exc, match=r"jaxep.backends.cuda_calls.dispatch: ep_size = 2"):
        jax.jit(f).trace(x, i, w)


def test_unloaded_extension_raises_naming_the_reason(monkeypatch):
    monkeypatch.setattr(_extension, "_registered", False)
    monkeypatch.setattr(_extension, "_reason", "no extension here")
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    with pytest.raises(RuntimeError, match=r"jaxep CUDA backend \(combine\): the CUDA backend is "
                                           "unavailable: no extension here"):
        cuda_calls.combine(None, None, None, None, None, config=cfg)


@pytest.mark.skipif(not _extension.is_available(), reason="CUDA extension not built")
def test_extension_reports_multi_rank_build():
    info = _extension.build_info()
    assert "multi_rank" in info and "nvshmem" in info
    assert "jaxep_gather_back" in _extension._module.registrations()
    if _extension.multi_rank_built():
        m = _extension._module
        assert m.nvshmem_built() and m.nvshmem_version()
        assert m.runtime_info() is None and m.runtime_diag() is None
        # T=4096, K=8, E=256, C=40960, H=7168 bf16: about 588 MB per PE
        params = m.RuntimeParams(device=0, rank=0, size=1, node_size=1, max_tokens=4096, topk=8,
                                 experts=256, capacity=40960, row_bytes=7168 * 2,
                                 return_row_bytes=0, ll_experts=0, ll_cap=0, timeout_s=100.0)
        assert 580e6 < m.symmetric_bytes(params) < 600e6
        assert params.capacity == 40960 and "timeout_s=100.0" in repr(params)
        with pytest.raises(TypeError, match="RuntimeParams: missing timeout_s"):
            m.RuntimeParams(device=0, rank=0, size=1, node_size=1, max_tokens=1, topk=1,
                            experts=1, capacity=1, row_bytes=1, return_row_bytes=0,
                            ll_experts=0, ll_cap=0)
        with pytest.raises(TypeError, match="RuntimeParams: unknown field hidden"):
            m.RuntimeParams(device=0, rank=0, size=1, node_size=1, max_tokens=1, topk=1,
                            experts=1, capacity=1, row_bytes=1, return_row_bytes=0,
                            ll_experts=0, ll_cap=0, timeout_s=1.0, hidden=1)


def test_initialize_single_process_does_not_touch_nvshmem():
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    jaxep.initialize(cfg)
    try:
        assert runtime.multi_rank_size() == 0
        jaxep.check()
    finally:
        jaxep.finalize()


def test_no_environment_variable_selects_what_jaxep_computes():
    """Settings are Config fields (FFI attributes): outside the launcher's own process-group
    variables (jaxep/launch/), the library reads only the debug pass-through variables, which
    change what is logged or recorded, never what is computed: JAXEP_LOG_LEVEL (Python) and
    JAXEP_PHASE_TIMES (the C++ phase timer, ffi/phase_times.h). Each is in the README's table."""
    import os
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parent.parent
    files = [p for p in (root / "jaxep").rglob("*.py")
             if "launch" not in p.relative_to(root).with_suffix("").parts]
    py = {m for p in files for m in re.findall(r"JAXEP_[A-Z_]+", p.read_text())}
    debug = {"JAXEP_LOG_LEVEL", "JAXEP_PHASE_TIMES"}
    # JAXEP_CUDA is the build-time switch of pip install and JAXEP_CUDA_ARCHITECTURES a CMake
    # option (docs/build.md): hints name them, nothing at run time reads them.
    assert py <= debug | {"JAXEP_CUDA", "JAXEP_CUDA_ARCHITECTURES"}, py
    reads = [line for p in files for line in p.read_text().splitlines()
             if "JAXEP_CUDA" in line and ("environ" in line or "getenv" in line)]
    assert reads == [], reads
    cc = {m for p in (root / "ffi").rglob("*") if p.is_file()
          for m in re.findall(r"getenv\s*\(\s*\"(JAXEP_\w*)\"", p.read_text(errors="replace"))}
    assert cc <= {"JAXEP_PHASE_TIMES"}, cc
    readme = (root / "README.md").read_text()
    for var in debug:
        assert f"| `{var}=" in readme, f"{var} is not in the README's table of variables"
    assert os.path.isdir(root / "ffi")


def test_initialize_with_several_configs():
    """A process that trains and decodes initializes with both configs: calls with either pass
    the trace-time check, any other config is refused naming the difference; the runtime's
    buffers are sized for the largest of each size; the configs must agree on the fields the
    runtime holds once."""
    import dataclasses
    from jaxep import runtime
    train = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=32)
    decode = jaxep.Config(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=4,
                          mode="low_latency", rows_per_expert=16, fp8_dispatch=False)
    other = dataclasses.replace(train, max_tokens_per_rank=16)
    jaxep.initialize([train, decode])
    try:
        assert runtime.initialized_configs() == (train, decode)
        assert runtime.initialized_config() == train
        runtime.check_config("dispatch", train)
        runtime.check_config("dispatch", decode)
        with pytest.raises(ValueError, match="none of the 2 configs.*max_tokens_per_rank"):
            runtime.check_config("dispatch", other)
        jaxep.initialize([train, decode])  # the same list again: a no-op
        with pytest.raises(ValueError, match="already initialized with another config"):
            jaxep.initialize(train)
    finally:
        jaxep.finalize()
    assert runtime.initialized_configs() == ()
    got = sizes.runtime_sizes((train, decode), 4)
    # Rows: normal C = ceil(1.25 * 32 * 2) -> 80; low latency L * M = 2 * 16 = 32.
    assert got == dict(max_tokens=32, topk=2, experts=8, capacity=80, row_bytes=128,
                       return_row_bytes=256), got
    big = dataclasses.replace(decode, rows_per_expert=64)  # L * M = 128 > 80
    assert sizes.runtime_sizes((train, big), 4)["capacity"] == 128
    for field, value in (("timeout_s", 5.0), ("zero_copy", False), ("ranks_per_node", 2)):
        with pytest.raises(ValueError, match=f"must agree on {field}"):
            jaxep.initialize([train, dataclasses.replace(decode, **{field: value})])
    for bad in ([], [train, 3], "train"):
        with pytest.raises(TypeError, match="a jaxep.Config or a non-empty list"):
            jaxep.initialize(bad)


def _align(n):
    return -(-n // 256) * 256


def _symmetric_formula(R, G, T, H, K, E, C, max_ranks):
    """docs/multinode.md's formula of the symmetric block (normal mode, bf16 rows, f32 returns)."""
    row, N, flags = 2 * H, T * K, _align(8 * max_ranks)
    meta = _align(4 * E) + 4 * _align(4 * N)
    total = 2 * flags + 256 + meta + _align(4 * C) + _align(max(max(T, C) * row, 4 * C))
    n = R // G
    if n > 1:
        rrow = _align(max(row, 4 * H, 4 * K))
        stride = meta + _align(4 * T) + 2 * T * rrow
        total += 3 * flags + _align(8 * n * T) + _align(4 * n * T) + 2 * _align(4 * n)
        total += (n - 1) * stride
    return total


# The figures docs/multinode.md gives (the seed's shapes, 8 local experts per rank), in bytes.
SEED_SYMMETRIC = {(64, 64): 587909376, (64, 8): 2236293888, (256, 64): 1294426880,
                  (256, 8): 7887840000}


@pytest.mark.skipif(not _extension.multi_rank_built(), reason="extension without NVSHMEM")
@pytest.mark.parametrize("R,G", sorted(SEED_SYMMETRIC))
def test_symmetric_bytes_follow_the_documented_formula(R, G):
    m = _extension._module
    cfg = jaxep.Config(num_experts=8 * R, topk=8, hidden=7168, max_tokens_per_rank=4096,
                       dtype="bfloat16")
    p = sizes.Params.of([cfg], device=0, rank=0, size=R, node_size=G)
    got = m.symmetric_bytes(m.RuntimeParams(**dataclasses.asdict(p)))
    assert got == SEED_SYMMETRIC[(R, G)]
    assert got == _symmetric_formula(R, G, 4096, 7168, 8, 8 * R, p.capacity,
                                     m.constants()["max_ranks"])


@pytest.mark.skipif(not _extension.multi_rank_built(), reason="extension without NVSHMEM")
@pytest.mark.parametrize("rank,size,node", [(100, 1024, 4), (1023, 1024, 8), (80, 144, 72),
                                            (71, 144, 72), (5, 72, 72), (700, 1024, 1024)])
def test_peer_table_maps_this_node_and_poisons_the_others(rank, size, node):
    t = _extension._module.peer_table_entries(rank, size, node)
    poison = 0xDEAD << 36
    assert len(t) == size
    first = rank // node * node
    for q, v in enumerate(t):
        assert v == ((q + 1) << 32 if first <= q < first + node else poison + q), q
    with pytest.raises(ValueError):
        _extension._module.peer_table_entries(0, _extension.constant("max_ranks") + 1, 1)


def test_the_init_log_line_gives_build_instructions_only_where_cuda_could_run(monkeypatch):
    """jaxep.initialize's INFO line: off a GPU, what is missing; on a GPU, how to build it too."""
    from jaxep.runtime import state
    monkeypatch.setattr(_extension, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "unavailable_reason",
                        lambda: "installed without its CUDA extension; build it with JAXEP_CUDA=13")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert state._extension_state() == "installed without its CUDA extension"  # pylint: disable=protected-access
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert state._extension_state().endswith("build it with JAXEP_CUDA=13")  # pylint: disable=protected-access
    monkeypatch.setattr(_extension, "is_available", lambda: True)
    assert state._extension_state() == "available"  # pylint: disable=protected-access
