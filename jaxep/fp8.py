"""`jaxep.dequantize_fp8`: the rows of an fp8 low-latency dispatch back in a float dtype; and the
fp8 wire of normal-mode dispatch (`Config.dispatch_wire_dtype="float8_e4m3fn"`): `pack_wire_rows`
/ `unpack_wire_rows`, the row format both backends move (H e4m3 codes, then the H/128 f32 scales'
bytes: `jaxep.config.fp8_row_bytes(H)` = H + H/32 bytes).

With `Config(mode="low_latency", fp8_dispatch=True)`, dispatch returns x [L, M, H] float8_e4m3fn
and scales [L, M, H/128] f32 (SPEC section 3; `jaxep.reference.fp8_quantize`). Feeding the expert
matmuls (w [L, H, F] this rank's experts):

    res = jaxep.dispatch(x, idx, w_route, axis_name="ep", config=cfg)
    rows = jaxep.dequantize_fp8(res.x, res.scales)                      # [L, M, H] bf16
    y = jnp.einsum("lmh,lhf->lmf", rows, w)                              # batched, or:
    L, M, H = rows.shape
    y = jax.lax.ragged_dot(rows.reshape(L * M, H), w,                    # groups of M rows each
                           jnp.full((L,), M, jnp.int32)).reshape(L, M, -1)
    y = jnp.where(jnp.arange(M)[None, :, None] < res.counts[:, None, None], y, 0)  # optional mask
    out = jaxep.combine(y.astype(jnp.bfloat16), res.handle, axis_name="ep")

Rows past counts[l] are zero (x and scales), so they give zero through any bias-free expert; the
mask matters only for experts with a bias or f(0) != 0 (combine ignores those rows anyway: they
carry no slot). fp8 outputs are not differentiable (jaxep.ops.dispatch_ll).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep.config import FP8_BLOCK


def dequantize_fp8(x_fp8, scales, dtype=jnp.bfloat16):
    """x_fp8 [..., H] float8_e4m3fn, scales [..., H/128] f32 -> [..., H] in `dtype`:
    f32(x_fp8) * scale of its 128-channel block, one f32 product per element, cast once."""
    x32 = x_fp8.astype(jnp.float32)
    if x32.shape[-1] != scales.shape[-1] * FP8_BLOCK or x32.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"jaxep.dequantize_fp8: scales must have shape "
                         f"{list(x32.shape[:-1]) + [x32.shape[-1] // FP8_BLOCK]} (one per "
                         f"{FP8_BLOCK} channels of x_fp8 {list(x32.shape)}), got {list(scales.shape)}")
    return (x32 * jnp.repeat(scales.astype(jnp.float32), FP8_BLOCK, axis=-1)).astype(dtype)


def pack_wire_rows(codes, scales):
    """codes [T, H] (float8_e4m3fn or their uint8 bytes), scales [T, H/128] f32 ->
    [T, fp8_row_bytes(H)] uint8: each row's codes, then its scales' bytes (little endian)."""
    if codes.dtype != jnp.uint8:
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    s8 = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)  # [T, H/128, 4]
    return jnp.concatenate([codes, s8.reshape(codes.shape[0], -1)], axis=1)


def unpack_wire_rows(rows, hidden: int, dtype):
    """[C, fp8_row_bytes(H)] uint8 -> [C, H] `dtype` (dequantize_fp8: f32(code) x its block's
    scale, cast once). All-zero rows (empty capacity) give +0.0."""
    C = rows.shape[0]
    codes = jax.lax.bitcast_convert_type(rows[:, :hidden], jnp.float8_e4m3fn)
    scales = jax.lax.bitcast_convert_type(
        rows[:, hidden:].reshape(C, hidden // FP8_BLOCK, 4), jnp.float32)
    return dequantize_fp8(codes, scales, dtype)
