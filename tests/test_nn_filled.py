"""`jaxep.nn.filled`: the expert stage on the filled prefix of the receive buffer equals it on the
whole buffer (forward and gradients), for every bucket a row count can land in."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxep.nn.filled import BUCKETS, bucket_sizes, on_filled_rows


def test_bucket_sizes():
    assert bucket_sizes(8192, 8192) == (8192,)      # EP 1: C = T*K, always full: no switch
    assert bucket_sizes(1024, 256) == (1024,)       # small buffers: no switch
    s = bucket_sizes(16384, 8192)
    assert len(s) == BUCKETS and s[-1] == 16384 and list(s) == sorted(set(s))
    assert all(v % 8 == 0 for v in s) and s[0] == 2048
    assert bucket_sizes(10001, 100)[-1] == 10001


def _experts(w, b):
    def fn(rows, gs, expert):
        h = jax.lax.ragged_dot(rows, w, gs) + jnp.take(b, jnp.maximum(expert, 0), axis=0)
        return jnp.where((expert >= 0)[:, None], h, 0.0)
    return fn


@pytest.mark.parametrize("filled", [0, 1, 511, 512, 513, 2000, 4096])
def test_equals_the_whole_buffer(filled):
    rng = np.random.default_rng(filled)
    c, h, f, groups = 4096, 8, 4, 3
    cuts = np.sort(rng.integers(0, filled + 1, groups - 1))
    gs = jnp.asarray(np.diff(np.concatenate([[0], cuts, [filled]])), jnp.int32)
    rows = np.zeros((c, h), np.float32)
    rows[:filled] = rng.normal(size=(filled, h))
    rows = jnp.asarray(rows)
    expert = jnp.where(jnp.arange(c) < filled,
                       jnp.searchsorted(jnp.cumsum(gs), jnp.arange(c), side="right"), -1)
    w = jnp.asarray(rng.normal(size=(groups, h, f)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(groups, f)), jnp.float32)
    sizes = bucket_sizes(c, 1024)
    assert len(sizes) > 1

    def loss(fn_rows, w_, b_):
        return fn_rows(_experts(w_, b_))

    whole = lambda w_, b_: _experts(w_, b_)(rows, gs, expert)  # noqa: E731
    part = lambda w_, b_: on_filled_rows(_experts(w_, b_), rows, gs, expert, sizes=sizes)  # noqa
    np.testing.assert_array_equal(jax.jit(part)(w, b), whole(w, b))
    g_part = jax.grad(lambda w_, b_: jnp.sum(jnp.sin(part(w_, b_))), argnums=(0, 1))(w, b)
    g_whole = jax.grad(lambda w_, b_: jnp.sum(jnp.sin(whole(w_, b_))), argnums=(0, 1))(w, b)
    for a, e in zip(g_part, g_whole):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)  # sums over fewer zero rows


def test_sizes_must_end_at_the_buffer():
    rows = jnp.zeros((64, 2))
    with pytest.raises(ValueError, match="sizes must end at the 64 rows, got"):
        on_filled_rows(lambda r, g: r, rows, jnp.zeros((1,), jnp.int32), sizes=(32,))


def test_ragged_tail_worker_runs_on_cpu():
    """tests/gpu/ragged_tail_worker.py (the padded-tail study the GPU runs) at tiny sizes: every
    buffer size gives the filled prefix's forward equal to the whole buffer's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "gpu", "ragged_tail_worker.py"),
                        "--filled", "256", "--hidden", "16", "--ffn", "16", "--iters", "2",
                        "--min_bucketed_rows", "0"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("filled_prefix equals whole: True") == 4, r.stdout
    assert "buckets=8" in r.stdout, r.stdout
