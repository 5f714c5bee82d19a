"""Marking a backend's outputs as varying over the EP axis (shard_map's varying manual axes)."""
from __future__ import annotations

import jax


def varying(xs, axis_name):
    """Marks every array of the pytree `xs` as varying over the EP axis (a no-op where it is);
    `axis_name` a mesh axis or a tuple of them (varying over each).

    Inside shard_map with check_vma, the custom VJP rules must return cotangents typed like their
    (varying) primal inputs. Outputs computed from the data are varying already; those JAX builds
    as constants are not: a custom call's results and, with T = 0 tokens per rank, the empty or
    all-zero arrays of the reference backend.
    """
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def one(x):
        if x is None or set(axes) <= set(getattr(jax.typeof(x), "vma", None) or ()):
            return x
        try:
            return jax.lax.pcast(x, axis_name, to="varying")
        except NameError:  # not inside shard_map (direct calls of a backend): nothing to mark
            return x
        except ValueError:  # "Unsupported pcast from=varying": varying already (the aval's
            return x        # field for it moved between JAX versions: vma, mat)
    return jax.tree.map(one, xs)
