"""Inputs that make FP8 quantization hard to get bit for bit (SPEC section 3: scale = amax / 448,
code = e4m3(x / scale), both IEEE f32 divisions), as [N, 128] blocks (one scale each).

Every block holds its amax in channel 0 (the other 127 values are no larger in magnitude), so
the scale is chosen per block. The families:
  * "bf16": every bf16 amax mantissa at exponents across the f32 range (subnormal, near the
    range's ends, around 2^-71 where ffi/cuda/fp8.cuh's ScaleDivisor changes path, 1, 2^127),
    each with every bf16 value of the 15 binades below it (both signs) and a few tiny ones;
  * "f16": the same over f16 (a sample of the 1024 amax mantissas, all of the values);
  * "f32": for scales from many amax values, the values next to every e4m3 rounding boundary
    (the midpoints between neighbouring codes and the codes themselves, times the scale, and
    their 3 f32 neighbours each side), plus random values;
  * "special": an all-zero block, signed zeros, a block with one nonzero value.
Blocks with NaN or inf are not made: SPEC leaves them unspecified.
"""
from __future__ import annotations

import numpy as np

_E4M3_MAX = 448.0


def _e4m3_positive():
    """Every positive finite e4m3fn value, ascending (f64)."""
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    v = np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.sort(v)


def _pack(amax_list, values_for, dtype) -> np.ndarray:
    """Blocks of `dtype`: for each amax, its values (|v| <= amax) 127 at a time behind it."""
    blocks = []
    for amax in amax_list:
        vals = values_for(amax)
        vals = vals[np.abs(vals.astype(np.float64)) <= float(amax)]
        n = -(-vals.size // 127) if vals.size else 1
        body = np.zeros(n * 127, dtype)
        body[:vals.size] = vals
        b = np.empty((n, 128), dtype)
        b[:, 0] = amax
        b[:, 1:] = body.reshape(n, 127)
        blocks.append(b)
    return np.concatenate(blocks)


def _float_family(dtype, mant_bits: int, exps, mantissas) -> np.ndarray:
    """bf16 / f16: amax = every chosen mantissa at every chosen exponent (as bit patterns); each
    block's values: every value of the 15 binades at and below amax's, both signs, plus tiny."""
    width = np.dtype(dtype).itemsize * 8
    uint = np.uint16
    exp_bits = width - 1 - mant_bits
    bias = (1 << (exp_bits - 1)) - 1
    every = np.arange(1 << width, dtype=np.uint32).astype(uint).view(dtype)
    every = every[np.isfinite(every.astype(np.float32))]
    e_of = np.floor(np.log2(np.abs(every.astype(np.float64)), where=every != 0,
                            out=np.full(every.shape, -1e9)))
    amaxes = []
    for e in exps:  # unbiased exponent; below the normal range: subnormal patterns
        for m in mantissas:
            field = e + bias
            bits = (field << mant_bits) | m if field > 0 else m  # subnormal: exponent field 0
            if field >= (1 << exp_bits) - 1 or (field <= 0 and m == 0):
                continue
            amaxes.append(np.array([bits], uint).view(dtype)[0])
    tiny = np.array([0.0, -0.0], np.float32)

    def values_for(amax):
        ea = np.floor(np.log2(float(amax)))
        near = every[(e_of <= ea) & (e_of >= ea - 14)]
        small = every[(e_of < ea - 14)][::997]  # a sample of what quantizes to +-0
        return np.concatenate([near, small, tiny.astype(dtype)])

    return _pack(amaxes, values_for, dtype)


def bf16_blocks() -> np.ndarray:
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    exps = [-133, -127, -126, -100, -73, -72, -71, -70, -20, -1, 0, 1, 60, 126, 127]
    return _float_family(ml_dtypes.bfloat16, 7, exps, range(128))


def f16_blocks(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mants = sorted({0, 1, 511, 512, 1023, *rng.integers(0, 1024, 24).tolist()})
    return _float_family(np.float16, 10, [-24, -15, -14, -1, 0, 15], mants)


def f32_blocks(seed: int = 0, n_amax: int = 600) -> np.ndarray:
    rng = np.random.default_rng(seed)
    exps = rng.choice(np.array([-75, -73, -72, -71, -70, -40, -3, 0, 1, 5, 40, 100, 127]), n_amax)
    mant = rng.integers(0, 1 << 23, n_amax).astype(np.uint32)
    amaxes = ((exps + 127).astype(np.uint32) << 23 | mant).view(np.float32)
    e4 = _e4m3_positive()
    marks = np.concatenate([e4, (e4[:-1] + e4[1:]) / 2, [e4[0] / 2]])  # codes and midpoints
    marks = marks[marks <= _E4M3_MAX]

    def values_for(amax):
        s = np.float32(amax / np.float32(_E4M3_MAX))
        centre = (marks * np.float64(s)).astype(np.float32)  # nearest f32 to mark * scale
        near = [centre]
        up, down = centre.copy(), centre.copy()
        for _ in range(3):
            up = np.nextafter(up, np.float32(np.inf))
            down = np.nextafter(down, np.float32(-np.inf))
            near += [up, down]
        noise = (rng.standard_normal(127) * (float(amax) / 3)).clip(-float(amax), float(amax))
        v = np.concatenate(near + [noise.astype(np.float32)])
        v = v[np.isfinite(v)]
        return np.concatenate([v, -v])

    return _pack(amaxes, values_for, np.float32)


def special_blocks(dtype) -> np.ndarray:
    b = np.zeros((3, 128), np.float32)
    b[1, ::2] = -0.0  # signed zeros only: amax 0, scale 1
    b[2, 0] = -3.0  # one nonzero value, the rest +-0
    b[2, 6] = -0.0
    return b.astype(dtype)


def blocks(family: str) -> np.ndarray:
    """The [N, 128] blocks of one family ("bf16", "f16", "f32" or "special_<dtype>")."""
    if family.startswith("special_"):
        import ml_dtypes  # pylint: disable=g-import-not-at-top
        dt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
        return special_blocks(dt[family[len("special_"):]])
    return {"bf16": bf16_blocks, "f16": f16_blocks, "f32": f32_blocks}[family]()
