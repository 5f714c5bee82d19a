"""Run by tests/test_min_versions.py inside a fresh venv that holds exactly the declared minimum
versions (pyproject.toml's lower bounds of jax, jaxlib and flax): the versions themselves, an
empty batch at EP 2 forward and backward, and the README's Flax snippet as written. (The example
at --short runs as its own process, from the test.)

    python tests/min_versions_smoke.py jax==0.10.2 jaxlib==0.10.2 flax==0.12.2
"""
import importlib.metadata as md
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_versions(pins):
    for pin in pins:
        name, want = pin.split("==")
        got = md.version(name)
        assert got == want, f"{name} {got} installed, {want} declared as the minimum"
        print(f"min_versions: {name} {got}", flush=True)


def empty_batch_ep2():
    """T = 0 tokens per rank at EP 2: dispatch, an expert, combine, and the gradient of it all
    (jax 0.10.0 and 0.10.1 failed here in the shard_map lowering)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    import jaxep  # pylint: disable=g-import-not-at-top
    cfg = jaxep.Config(num_experts=4, topk=2, hidden=16, max_tokens_per_rank=4)
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))

    def moe(x, idx, w, wexp):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        y = jax.lax.ragged_dot(res.x, wexp, res.group_sizes)
        return jaxep.combine(y, res.handle, axis_name="ep")

    f = jax.shard_map(moe, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.zeros((0, 16), jnp.bfloat16)
    idx = jnp.zeros((0, 2), jnp.int32)
    w = jnp.zeros((0, 2), jnp.float32)
    wexp = jnp.stack([jnp.eye(16, dtype=jnp.bfloat16)] * 4)
    out = jax.jit(f)(x, idx, w, wexp)
    assert out.shape == (0, 16), out.shape
    loss = lambda x, w, wexp: jnp.sum(f(x, idx, w, wexp).astype(jnp.float32))  # noqa: E731
    gx, gw, gexp = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, wexp)
    assert gx.shape == (0, 16) and gw.shape == (0, 2) and gexp.shape == wexp.shape
    assert not np.any(np.asarray(gexp, np.float32))
    print("min_versions: empty batch at EP 2, forward and backward: ok", flush=True)


def readme_flax_snippet():
    with open(os.path.join(ROOT, "README.md")) as f:
        code = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "jaxep.nn" in b][0]
    scope = {}
    exec(compile(code, "README.md (Flax snippet)", "exec"), scope)  # pylint: disable=exec-used
    assert scope["grads"] is not None
    print("min_versions: the README's Flax snippet: ok", flush=True)


if __name__ == "__main__":
    check_versions(sys.argv[1:])
    empty_batch_ep2()
    readme_flax_snippet()
    print("min_versions: OK", flush=True)
