"""What the expert matmuls cost past the rows that arrived: `jax.lax.ragged_dot` over a receive
buffer of M rows of which only the first `filled` hold tokens, against the same product on the
filled prefix chosen by `jaxep.nn.filled.on_filled_rows` (a switch over static bucket sizes), and
against the dense batched product of the filled rows (the floor), forward and gradient, same run.

    python tests/gpu/ragged_tail_worker.py                       # GPU: T*K = 8192 rows, H 2048, F 1024
    JAX_PLATFORMS=cpu python tests/gpu/ragged_tail_worker.py --filled 256 --hidden 32 --ffn 32 \
        --min_bucketed_rows 0

Prints one line per (M, variant): `RAGGED M=... filled=... <variant> fwd_ms=... grad_ms=...`, each the
median of --iters timed calls after a warm-up, and checks the bucketed forward equals the whole
buffer's (exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_ms(f, *args, iters: int) -> float:
    import jax
    import numpy as np
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--filled", type=int, default=8192, help="rows that hold tokens (T*K)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=4, help="local experts (groups)")
    p.add_argument("--factors", default="1,1.25,2,8", help="buffer rows M = factor * filled")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--min_bucketed_rows", type=int, default=None,
                   help="jaxep.nn.filled.MIN_BUCKETED_ROWS for this run (tiny CPU checks)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxep.nn import filled
    from jaxep.nn.filled import bucket_sizes, on_filled_rows
    if a.min_bucketed_rows is not None:
        filled.MIN_BUCKETED_ROWS = a.min_bucketed_rows

    rng = np.random.default_rng(0)
    n, h, f, g = a.filled, a.hidden, a.ffn, a.experts
    dt = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    w = jnp.asarray(rng.normal(0, h ** -0.5, (g, h, f)), dt)
    gs = jnp.asarray(np.diff(np.linspace(0, n, g + 1).astype(np.int32)), jnp.int32)
    bad = 0
    for factor in (float(v) for v in a.factors.split(",")):
        m = max(n, int(round(factor * n)))
        x = np.zeros((m, h), np.float32)
        x[:n] = rng.standard_normal((n, h))
        x = jnp.asarray(x, dt)
        mm = lambda r, s: jax.lax.ragged_dot(r, w, s, preferred_element_type=jnp.float32)  # noqa
        sizes = bucket_sizes(m, n)
        part = lambda r, s: on_filled_rows(mm, r, s, sizes=sizes)  # noqa: E731
        variants = {"whole": mm, "filled_prefix": part}
        outs = {}
        for name, fn in variants.items():
            fwd = jax.jit(fn)
            grad = jax.jit(jax.grad(lambda r, s, fn=fn: jnp.sum(fn(r, s)), argnums=0))
            outs[name] = fwd(x, gs)
            print(f"RAGGED M={m} filled={n} {name} buckets={len(sizes) if name != 'whole' else 1} "
                  f"fwd_ms={_median_ms(fwd, x, gs, iters=a.iters):.3f} "
                  f"grad_ms={_median_ms(grad, x, gs, iters=a.iters):.3f}", flush=True)
        same = bool(jnp.array_equal(outs["whole"], outs["filled_prefix"]))
        bad += not same
        print(f"RAGGED M={m} filled_prefix equals whole: {same}", flush=True)
    xb = jnp.asarray(rng.standard_normal((g, n // g, h)), dt)
    dense = jax.jit(lambda a_, b_: jnp.einsum("lmh,lhf->lmf", a_, b_,
                                              preferred_element_type=jnp.float32))
    print(f"RAGGED dense batched [{g},{n // g},{h}]x[{g},{h},{f}] "
          f"fwd_ms={_median_ms(dense, xb, w, iters=a.iters):.3f}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
