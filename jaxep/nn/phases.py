"""The MoE layer's steps, as named scopes: `phase(name)` names each step's XLA ops
"jaxep_moe/<name>/..." (their backward ops "transpose(...)/jaxep_moe/<name>/..."), so a profile
attributes time to them (`jaxep-bench --layer` does: jaxep/bench/layer.py)."""
from __future__ import annotations

import jax

PHASES = ("router", "dispatch", "experts", "combine", "shared")


def phase(name: str):
    """`jax.named_scope("jaxep_moe/<name>")` of one of `PHASES`."""
    if name not in PHASES:
        raise ValueError(f"jaxep.nn.phase: name must be one of {PHASES}, got {name!r}")
    return jax.named_scope(f"jaxep_moe/{name}")
