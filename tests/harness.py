"""Runs jaxep ops over R emulated devices and builds per-rank inputs for the oracle."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jaxep


def mesh(R: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def routing(rng, R, T, K, E, kind="uniform"):
    """Per-rank [T,K] int32 ids: distinct experts per token (uniform/skewed) or special cases."""
    idxs = []
    for _ in range(R):
        if kind == "uniform":
            idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) if T else np.zeros((0, K))
        elif kind == "skewed":  # zipf-like: low expert ids far more popular
            p = 1.0 / np.arange(1, E + 1) ** 1.5
            idx = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(T)]) if T else np.zeros((0, K))
        elif kind == "one_expert":
            idx = np.full((T, K), -1)
            idx[:, 0] = 0
        else:
            raise ValueError(kind)
        idxs.append(idx.astype(np.int32))
    return idxs


def inputs(rng, R, T, H, K, dtype):
    xs = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for _ in range(R)]
    ws = [rng.uniform(0.1, 1.0, (T, K)).astype(np.float32) for _ in range(R)]
    return xs, ws


def _identity(rows):
    return rows


@functools.lru_cache(maxsize=64)
def _program(cfg, R, backend, expert_fn):
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=backend)
        y = expert_fn(res.x)
        out = jaxep.combine(y, res.handle, axis_name="ep")
        h = res.handle
        return (res.x, res.group_sizes, res.weights, h.send_row, h.recv_slot, y, out,
                res.stats.dropped_rows, res.stats.invalid_ids, res.expert, res.stats.max_recv_rows)

    return jax.jit(jax.shard_map(body, mesh=mesh(R), in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 11))


def run(cfg, xs, idxs, ws, *, backend=None, expert_fn=None):
    """dispatch -> expert_fn(rows) -> combine on len(xs) devices; returns per-rank numpy lists.

    Compiled programs are cached per (config, R, backend, expert_fn): pass module-level functions.
    """
    R = len(xs)
    f = _program(cfg, R, backend, expert_fn or _identity)
    outs = f(jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(idxs)),
             jnp.asarray(np.concatenate(ws)))
    names = ("x", "group_sizes", "weights", "send_row", "recv_slot", "y", "out", "dropped", "invalid",
             "expert", "max_recv_rows")
    return {n: np.split(np.asarray(o), R) for n, o in zip(names, outs)}


def run_in_pty(cmd, env=None, cwd=None, timeout=300):
    """Runs `cmd` with a pseudo-terminal as stdin/stdout/stderr; (returncode, everything written)."""
    import os  # pylint: disable=g-import-not-at-top
    import select  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    import pytest  # pylint: disable=g-import-not-at-top
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    else:
        p.kill()
    os.close(master)
    return p.wait(timeout=30), out.decode("utf-8", "replace")


def cpu_child_env(repo: str) -> dict:
    """The environment of launched CPU children: CPU jax, one device per process, `repo` importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [env.get("PYTHONPATH")] if p])
    return env
