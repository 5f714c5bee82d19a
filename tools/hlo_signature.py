"""The CUDA lowering's signature of a tree: lowers jaxep's public ops (forward and gradient) for the
CUDA platform with a fake extension and runtime (no GPU) over 24 configurations (normal and
low-latency modes, EP 1-8, node layouts, the knobs, the fp8 wire) and prints every jaxep custom
call with its attributes and operand and result types. Two trees lower the same custom calls when
their outputs are equal. From a tree's root (any commit: its own tests/ give the fake constants):

    python <this file> > a.txt      # in each tree, then: diff a.txt b.txt

Trees whose CUDA backend is `jaxep._ffi` (before the package's layers) are read too.
"""
import os
import re
import sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jaxep
from test_runtime_checks import CONSTANTS
try:
    from jaxep import _extension as ext; from jaxep.backends import cuda_calls as calls
    from jaxep import backends
    patch_select = lambda f: setattr(backends, "select", f)
except ImportError:
    from jaxep import _ffi as ext; calls = ext; from jaxep import runtime
    patch_select = lambda f: setattr(runtime, "select_backend", f)
ext._registered = True
if ext.constants() is None:
    ext._constants = ext.parse_constants(CONSTANTS)
patch_select(lambda op, requested, ep_size: "cuda")
NODE = {"v": None}
calls.runtime_limits = lambda op, ep_size: dict(
    size=ep_size, max_tokens=1 << 20, topk=64, experts=1 << 13, capacity=1 << 30,
    stage_bytes=1 << 40, node_size=NODE["v"] or ep_size, ll_experts=1 << 10, ll_cap=1 << 20,
    ll_row_bytes=1 << 20)

def mesh(R):
    return Mesh(np.array(jax.devices()[:R]), ("ep",))

def lines(hlo):
    return [l.strip() for l in hlo.splitlines() if "custom_call @jaxep" in l]

def normal(cfg, R):
    def loss(x, w, A, idx):
        def body(x, idx, w, A):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
            return jaxep.combine(y, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=mesh(R), in_specs=(P("ep"),) * 4, out_specs=P("ep"))(x, idx, w, A)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))
    T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
    sds = jax.ShapeDtypeStruct
    dt = jnp.dtype(cfg.dtype)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        sds((R * T, H), dt), sds((R * T, K), jnp.float32), sds((E, H, H), dt),
        sds((R * T, K), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()

def low_latency(cfg, R):
    def loss(x, w, idx):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            y = res.x if not cfg.fp8_dispatch else jaxep.dequantize_fp8(res.x, res.scales)
            return jaxep.combine(y.astype(jnp.bfloat16), res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep"))(x, idx, w)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))
    T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk
    sds = jax.ShapeDtypeStruct
    argn = (1,) if cfg.fp8_dispatch else (0, 1)
    return jax.jit(jax.grad(loss, argnums=argn)).trace(
        sds((R * T, H), jnp.bfloat16), sds((R * T, K), jnp.float32),
        sds((R * T, K), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()

C = jaxep.Config
cases = []
for R in (1, 2, 4, 8):
    cases.append((f"normal R{R}", C(num_experts=16, topk=2, hidden=128, max_tokens_per_rank=4, dtype="bfloat16"), R, normal))
for R, G in ((4, 2), (8, 4), (8, 2)):
    cases.append((f"normal R{R} G{G} wire", C(num_experts=16, topk=2, hidden=128, max_tokens_per_rank=4, dtype="bfloat16", ranks_per_node=G, combine_wire_dtype="bfloat16"), R, normal))
cases.append(("normal knobs", C(num_experts=16, topk=2, hidden=128, max_tokens_per_rank=4, dtype="bfloat16", num_sms=20, dispatch_kernel="row", combine_kernel="thread", zero_copy=False), 4, normal))
cases.append(("normal f32 recv", C(num_experts=16, topk=3, hidden=128, max_tokens_per_rank=4, dtype="float32", recv_capacity=10), 2, normal))
for R in (1, 2, 4):
    cases.append((f"normal fp8 wire R{R}", C(num_experts=16, topk=2, hidden=256, max_tokens_per_rank=4, dtype="bfloat16", dispatch_wire_dtype="float8_e4m3fn"), R, normal))
for R in (1, 2, 4):
    for fp8 in (False, True):
        cases.append((f"ll R{R} fp8={fp8}", C(num_experts=16, topk=2, hidden=256, max_tokens_per_rank=4, dtype="bfloat16", mode="low_latency", fp8_dispatch=fp8), R, low_latency))
cases.append(("ll R4 G2", C(num_experts=16, topk=2, hidden=256, max_tokens_per_rank=4, dtype="bfloat16", mode="low_latency", ranks_per_node=2), 4, low_latency))
for name, cfg, R, f in cases:
    NODE["v"] = cfg.ranks_per_node
    print("##", name)
    for l in lines(f(cfg, R)):
        print(re.sub(r"%[\w#.]+", "%", l))
