"""Process-wide state: `initialize` / `finalize`, the multi-rank NVSHMEM runtime, and `check`.

Nothing here runs at import. The reference backend needs no initialization; the CUDA backend at EP
size 1 needs none either. The multi-rank CUDA backend (EP size > 1: one process per GPU/rank, e.g.
`python -m jaxep.launch --nproc N [--share-gpu] script.py`) is set up by `initialize`, whose steps
`jaxep.runtime.nvshmem` lists. One object holds the state (`state.RUNTIME`); the functions here are
its public face.

  state.py      the Runtime object: configs, axis, the started NVSHMEM runtime, the checks
  nvshmem.py    starting NVSHMEM: the named steps of initialize
  bootstrap.py  what ranks agree on through JAX's key-value store; NVSHMEM's bootstrap interface
  sizes.py      the symmetric buffers' sizes and the one parameter record the extension takes
  node_layout.py, zero_copy.py, watchdog.py

PE = `jax.process_index()` = position on the EP axis (a mesh over `jax.devices()` in order).

Environment: the library writes os.environ in exactly two places, each just before NVSHMEM starts
(NVSHMEM reads these settings only from its own process environment), only when the variable is
unset, and logged at INFO: `zero_copy.prepare_env` sets NVSHMEM_CUMEM_GRANULARITY=2 MiB when
`config.zero_copy` is on (zero-copy needs it); `bootstrap.pin_interface`, on several hosts only,
sets NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (and _FAMILY) to the interface reaching JAX's coordinator.
Every other NVSHMEM setting jaxep recommends is only logged (INFO), never set.
"""
from __future__ import annotations

import jax

from jaxep.config import Config
from jaxep.runtime.state import RUNTIME, axis_names, canonical_axis_name  # noqa: F401
from jaxep.runtime.watchdog import TimeoutError  # noqa: A004  pylint: disable=redefined-builtin


def initialize(config, axis_name="ep") -> None:
    """Declares the config(s) every later call must use and, in a multi-process GPU run, sets up
    the NVSHMEM runtime (see the module docstring). Collective: every process must call it.

    `config`: a `jaxep.Config`, or a list of them when one process runs several, e.g. a model's
    training config and its `mode="low_latency"` decode config: the symmetric buffers are then
    sized for the largest of each size, and the configs must agree on the fields the runtime
    holds once (`SHARED_FIELDS`: ranks_per_node, timeout_s, zero_copy). Calls with any other
    config, or over another axis than `axis_name`, raise at trace time. In a multi-process GPU run
    the configs must be identical on every process (their knobs are FFI attributes): a
    RuntimeError on every process, naming the differing fields and ranks, otherwise. Set
    JAXEP_LOG_LEVEL=INFO (or configure the "jaxep" logger) to see the topology and the effective
    settings.

    `axis_name`: the EP mesh axis, or a tuple of mesh axes whose product is the EP group (ranks
    in the order of `jax.lax.axis_index(axis_name)`), as the ops are given it.
    """
    RUNTIME.initialize(config, axis_name)


def finalize() -> None:
    """Frees the symmetric buffers and finalizes NVSHMEM (collective: every process calls it),
    then forgets the config. After a timeout (a peer may be dead) only local state is dropped."""
    RUNTIME.finalize()


def check() -> None:
    """Raises `jaxep.TimeoutError` if a multi-rank kernel of this process timed out.

    Call it after `block_until_ready()` on a step's outputs (the custom calls cannot raise at run
    time: an XLA FFI handler error crashes the process). The watchdog thread started by
    `initialize` also logs the same text at ERROR within about 0.5 s.
    """
    text = RUNTIME.diagnostic()
    if text:
        raise TimeoutError(text)


def diagnostic() -> str | None:
    """The text of the first timeout a multi-rank kernel of this process recorded, or None."""
    return RUNTIME.diagnostic()


def initialized_config() -> Config | None:
    """The (first) config given to `jaxep.initialize`, or None."""
    return RUNTIME.config


def initialized_configs() -> tuple:
    """Every config given to `jaxep.initialize` (empty before it)."""
    return RUNTIME.configs


def zero_copy_enabled() -> bool:
    """True when multi-rank calls may read peers' x / y in their XLA pools (docs/zero_copy.md;
    on by default where possible, Config.zero_copy=False turns it off)."""
    return RUNTIME.started is not None and RUNTIME.started.zero_copy


def machine_ranks_per_node() -> int | None:
    """Processes per host that `jaxep.initialize` agreed on (node_layout), or None when no
    multi-process runtime read the machine (then a config without ranks_per_node is one node)."""
    return RUNTIME.node_size


def node_size(config: Config, ep_size: int) -> int:
    """G, ranks per node for `ep_size` ranks: config.ranks_per_node, else the machine's layout
    read at initialize, else ep_size (one node). ValueError when G does not divide ep_size."""
    return config.node_size(ep_size, RUNTIME.node_size)


def multi_rank_size() -> int:
    """EP size of the initialized multi-rank CUDA runtime, 0 when there is none."""
    return jax.process_count() if RUNTIME.started is not None else 0


def check_config(op: str, config, name: str = "config") -> None:
    """`config` (the argument `name` of `op`) must be a Config, and the initialized one if any."""
    RUNTIME.check_config(op, config, name)


def check_axis_name(op: str, axis_name):
    """`axis_name` in its canonical form (a str, or a tuple of at least two distinct mesh axes);
    after `jaxep.initialize(config, axis_name)`, every op runs over that EP axis."""
    return RUNTIME.check_axis_name(op, axis_name)
