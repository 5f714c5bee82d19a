"""Times the fp8 wire's source pass alone (`jaxep_fp8_quantize_rows`, the quantize into packed
rows that Config.dispatch_wire_dtype="float8_e4m3fn" adds before dispatch) on one process and the
whole GPU, against a same-run device copy of the same HBM bytes (read the payload, write the packed
rows). Prints one line per shape: the quantize's time, the copy's, and copy / quantize (1 = at the
copy's speed). Run on a GPU machine after building the extension:

    python3 tools/time_fp8_quantize.py [--tokens 4096] [--hidden 7168] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxep import _ffi  # noqa: E402
from jaxep.bench import timing  # noqa: E402
from jaxep.config import fp8_row_bytes  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    if not _ffi.is_available():
        print("time_fp8_quantize: the CUDA extension is not available:", _ffi.unavailable_reason())
        return 1
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    for t in a.tokens:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((t, a.hidden)), a.dtype)
        quant = timing.time_loop(timing.device_loop(_ffi.fp8_quantize_rows, mesh, "ep"), (x,),
                                 warmup=2, iters=a.iters, markers=("jaxep_fp8_quantize_rows",))
        moved = x.nbytes + t * fp8_row_bytes(a.hidden)  # read the payload, write the packed rows
        # The bench's copy baseline (read half `moved`, write half), one rank: this process.
        copy = timing.time_copy(types.SimpleNamespace(seed=0, warmup=2, iters=a.iters, inner=0),
                                mesh, "ep", 1, moved)
        q, c = quant["median"], copy["median"]
        print(f"fp8 quantize rows T={t} H={a.hidden} {a.dtype}: {q * 1e6:.1f} us, copy of the same "
              f"{moved / 1e6:.1f} MB {c * 1e6:.1f} us, copy/quantize {c / q:.2f} "
              f"({moved / q / 1e9:.0f} GB/s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
