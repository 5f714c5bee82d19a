"""jaxep: expert-parallel (MoE) dispatch and combine for JAX.

    cfg = jaxep.Config(num_experts=64, topk=8, hidden=7168, max_tokens_per_rank=4096)
    res = jaxep.dispatch(x, topk_idx, topk_weights, axis_name="ep", config=cfg)   # in shard_map
    y = jax.lax.ragged_dot(res.x, w_local, res.group_sizes)
    out = jaxep.combine(y, res.handle, axis_name="ep")

Importing jaxep only registers the FFI targets of the CUDA extension, when it was built.
"""
from jaxep.config import Config
from jaxep.fp8 import dequantize_fp8
from jaxep.ops import combine, combine_recv, combine_send, dispatch, dispatch_recv, dispatch_send
from jaxep.runtime import TimeoutError, check, finalize, initialize  # noqa: A004
from jaxep.types import (CombinePending, DispatchPending, DispatchResult, Handle,
                         LowLatencyDispatchResult, Stats)

__version__ = "0.1.0"

__all__ = ["CombinePending", "Config", "DispatchPending", "DispatchResult", "Handle",
           "LowLatencyDispatchResult", "Stats", "TimeoutError", "check", "combine", "combine_recv",
           "combine_send", "dequantize_fp8", "dispatch", "dispatch_recv", "dispatch_send",
           "finalize", "initialize"]
