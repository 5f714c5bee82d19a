"""CPU tier: the reference backend on large layouts: 64 emulated CPU devices as 16 nodes x 4 and
1 node x 64 (tiny shapes), dispatch and combine bitwise equal to the NumPy oracle. The test
session has 8 devices (conftest.py), so the run is a child process with 64."""
import os
import subprocess
import sys
import textwrap

import harness

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

CHILD = textwrap.dedent("""
    import jax, ml_dtypes, numpy as np
    import harness, jaxep, oracle
    assert jax.device_count() == 64, jax.devices()
    R, T, H, K, E = 64, 3, 8, 4, 128  # 2 experts per rank
    rng = np.random.default_rng(7)
    idxs = harness.routing(rng, R, T, K, E)
    idxs[5][0, 1] = -1  # a masked slot
    xs, ws = harness.inputs(rng, R, T, H, K, ml_dtypes.bfloat16)
    for G in (4, 64):
        cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                           dtype="bfloat16", ranks_per_node=G, combine_wire_dtype="bfloat16")
        got = harness.run(cfg, xs, idxs, ws, backend="reference")
        want = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=cfg.capacity(R))
        for name in ("x", "group_sizes", "weights", "send_row", "recv_slot"):
            for r in range(R):
                assert np.array_equal(np.asarray(got[name][r]).view(np.uint8),
                                      np.asarray(want[name][r]).view(np.uint8)), (G, name, r)
        assert [int(m[0]) for m in got["max_recv_rows"]] == want["max_recv_rows"], G
        out = oracle.combine(got["y"], want["weights"], want["send_row"], idxs, num_experts=E,
                             ranks_per_node=G, wire_dtype="bfloat16")
        for r in range(R):
            assert np.array_equal(np.asarray(got["out"][r]).view(np.uint8),
                                  np.asarray(out[r]).view(np.uint8)), (G, "out", r)
        print("layout", R // G, "x", G, "ok")
""")


def _child(code: str, devices: int) -> subprocess.CompletedProcess:
    """Runs `code` in a CPU child with `devices` emulated devices (tests/ importable); it must
    exit 0."""
    env = harness.cpu_child_env(REPO)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env["PYTHONPATH"]])
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=900, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def test_reference_on_64_devices_as_16x4_and_1x64():
    p = _child(CHILD, devices=64)
    assert "layout 16 x 4 ok" in p.stdout and "layout 1 x 64 ok" in p.stdout, p.stdout


LOWER = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxep
    from jaxep import _extension, backends
    from jaxep.backends import cuda_calls
    from test_runtime_checks import CONSTANTS
    R, G, T, H, K, E = 144, 72, 2, 128, 2, 288  # two NVL72 domains over the NICs
    _extension._registered = True
    _extension._constants = _extension.parse_constants(dict(CONSTANTS, max_ranks=1024))
    backends.select = lambda op, requested, ep_size: "cuda"
    cuda_calls.runtime_limits = lambda op, ep_size: dict(
        size=ep_size, node_size=G, max_tokens=T, topk=K, experts=E, capacity=1 << 20,
        stage_bytes=1 << 40)
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dtype="bfloat16",
                       ranks_per_node=G)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    def loss(x, w, idx):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            return jaxep.combine(res.x, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32))
    sds = jax.ShapeDtypeStruct
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(
        sds((R * T, H), jnp.bfloat16), sds((R * T, K), jnp.float32),
        sds((R * T, K), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(jaxep_\\w+)\\(.*?mhlo\\.backend_config = \\{(.*?)\\}", hlo)
    names = sorted({t for t, _ in calls})
    assert names == ["jaxep_combine", "jaxep_dispatch", "jaxep_dispatch_rows",
                     "jaxep_gather_back"], names
    for t, attrs in calls:
        assert "ep_size = 144" in attrs and "ranks_per_node = 72" in attrs, (t, attrs)
    print("lowered", len(calls), "calls at 144 ranks as 2 x 72")
""")


def test_cuda_lowering_at_144_ranks_as_2_x_72():
    """The CUDA backend's custom calls at EP 144 in two NVLink domains of 72 (no GPU: a fake
    extension and runtime), forward and gradient: every call carries ep_size 144 and
    ranks_per_node 72; the ops' checks accept the layout."""
    p = _child(LOWER, devices=144)
    assert "lowered" in p.stdout and "at 144 ranks as 2 x 72" in p.stdout, p.stdout
