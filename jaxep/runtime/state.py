"""The runtime object: the configs `jaxep.initialize` declared, the EP axis, and in a multi-process
GPU run the NVSHMEM runtime it started (`jaxep.runtime.nvshmem`). One per process (`RUNTIME`).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax

from jaxep import _extension
from jaxep.config import Config, field_diff
from jaxep.runtime import nvshmem, watchdog
from jaxep.runtime.sizes import SHARED_FIELDS

log = logging.getLogger("jaxep")


def as_configs(config) -> tuple:
    """initialize's argument as a non-empty tuple of Configs that agree on SHARED_FIELDS."""
    configs = (config,) if isinstance(config, Config) else tuple(config) \
        if isinstance(config, (list, tuple)) else None
    if not configs or not all(isinstance(c, Config) for c in configs):
        raise TypeError(f"jaxep.initialize: config must be a jaxep.Config or a non-empty list of "
                        f"them (e.g. [train_config, decode_config]), got {config!r}")
    for f in SHARED_FIELDS:
        values = [getattr(c, f) for c in configs]
        if len(set(values)) > 1:
            raise ValueError(f"jaxep.initialize: the configs must agree on {f} (the runtime "
                             f"holds one {f} for all of them): expected one value, got {values}")
    return tuple(dict.fromkeys(configs))  # equal configs once, in order


def canonical_axis_name(op: str, axis_name, what: str = "axis_name"):
    """The EP axis as jaxep keeps it: a non-empty str, or a tuple of at least two distinct
    non-empty str (mesh axes whose product is the EP group, ranks in the order jax's collectives
    over that tuple use: `jax.lax.axis_index(tuple)`). A list is taken as its tuple and a 1-tuple
    as its one name (jax's collectives treat them alike), so equal groups compare equal."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    if isinstance(axis_name, tuple):
        if not axis_name:
            raise ValueError(f"jaxep.{op}: {what} must be a mesh axis name or a non-empty tuple "
                             f"of them, got an empty tuple ()")
        bad = [a for a in axis_name if not isinstance(a, str) or not a]
        if bad:
            raise ValueError(f"jaxep.{op}: {what} must be a tuple of non-empty str mesh axis "
                             f"names, got {axis_name!r} ({bad[0]!r} is not one)")
        twice = sorted({a for a in axis_name if axis_name.count(a) > 1})
        if twice:
            raise ValueError(f"jaxep.{op}: {what} must name each mesh axis once, got "
                             f"{axis_name!r} ({', '.join(map(repr, twice))} more than once)")
        return axis_name[0] if len(axis_name) == 1 else axis_name
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"jaxep.{op}: {what} must be a non-empty str or a tuple of them, got "
                        f"{type(axis_name).__name__} {axis_name!r}")
    return axis_name


def axis_names(axis_name) -> tuple:
    """The mesh axes of a canonical EP axis name, as a tuple (one name: a 1-tuple)."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


@dataclasses.dataclass
class Runtime:
    """Process-wide state. `started` is set while the NVSHMEM runtime is up in this process.
    `generation` counts the multi-rank start attempts: each takes a fresh key-value namespace,
    the same on every rank since every rank makes the same attempts."""
    configs: tuple = ()
    axis_name: str | tuple | None = None
    started: nvshmem.Started | None = None
    generation: int = 0
    watchdog: watchdog.Watchdog | None = None

    @property
    def config(self) -> Config | None:
        """The first of the configs (None before initialize)."""
        return self.configs[0] if self.configs else None

    @property
    def node_size(self) -> int | None:
        """Processes per host agreed at initialize, or None without a multi-rank runtime."""
        return self.started.params.node_size if self.started else None

    def initialize(self, config, axis_name) -> None:
        configs = as_configs(config)
        axis_name = canonical_axis_name("initialize", axis_name)
        if self.configs and self.configs != configs:
            raise ValueError("jaxep.initialize: already initialized with another config; call "
                             f"jaxep.finalize() first. initialized: {list(self.configs)}, got: "
                             f"{list(configs)}")
        if self.configs and self.axis_name != axis_name:
            raise ValueError(f"jaxep.initialize: already initialized with axis_name="
                             f"{self.axis_name!r}; call jaxep.finalize() first, got axis_name="
                             f"{axis_name!r}")
        _configure_logging()
        if not self.configs and jax.process_count() > 1 and _extension.is_available() \
                and jax.default_backend() == "gpu":
            self._start(configs)
        self.configs, self.axis_name = configs, axis_name
        log.info("jaxep initialized: axis=%r config=%s; CUDA extension: %s; jax backend: %s; "
                 "processes: %d; multi-rank CUDA runtime: %s", axis_name,
                 configs[0] if len(configs) == 1 else list(configs), _extension_state(),
                 jax.default_backend(), jax.process_count(), self.started is not None)

    def _start(self, configs) -> None:
        generation = self.generation
        self.generation += 1  # every attempt, on every rank: a retry reads fresh keys
        self.started = nvshmem.start(configs, generation)
        self.watchdog = watchdog.Watchdog(self.diagnostic)

    def finalize(self) -> None:
        if self.started is not None:
            if self.watchdog is not None:
                self.watchdog.stop()
            collective = self.diagnostic() is None
            _extension.module().runtime_finalize(collective)
            self.started = self.watchdog = None
        self.configs, self.axis_name = (), None

    def diagnostic(self) -> str | None:
        """The text of the first timeout a multi-rank kernel of this process recorded, or None."""
        if self.started is None:
            return None
        return watchdog.text(_extension.module().runtime_diag(),
                             self.config.timeout_s if self.config else float("nan"),
                             self.started.params.node_size)

    def check_config(self, op: str, config, name: str = "config") -> None:
        """`config` (the argument `name` of `op`) must be a Config, and an initialized one."""
        if not isinstance(config, Config):
            raise TypeError(f"jaxep.{op}: {name} must be a jaxep.Config, got "
                            f"{type(config).__name__}")
        if self.configs and config not in self.configs:
            first = self.configs[0]
            if len(self.configs) == 1:
                raise ValueError(f"jaxep.{op}: {name} differs from the one passed to "
                                 f"jaxep.initialize: {field_diff(first, config)} (initialized: "
                                 f"{first})")
            raise ValueError(f"jaxep.{op}: {name} is none of the {len(self.configs)} configs "
                             f"passed to jaxep.initialize: vs the first, "
                             f"{field_diff(first, config)} (initialized: {list(self.configs)})")

    def check_axis_name(self, op: str, axis_name):
        """The canonical form of `axis_name` (`canonical_axis_name`); after
        `jaxep.initialize(config, axis_name)`, every op runs over that EP axis."""
        axis_name = canonical_axis_name(op, axis_name)
        if self.configs and axis_name != self.axis_name:
            raise ValueError(f"jaxep.{op}: axis_name must be the EP axis given to "
                             f"jaxep.initialize: expected {self.axis_name!r}, got {axis_name!r}")
        return axis_name


def _extension_state() -> str:
    """The CUDA extension's state for the INFO line: "available", else why not; off a GPU only
    what is missing (the build instructions matter where the CUDA backend could run)."""
    if _extension.is_available():
        return "available"
    reason = _extension.unavailable_reason()
    return reason if jax.default_backend() == "gpu" else reason.split(";")[0]


def _configure_logging() -> None:
    level = os.environ.get("JAXEP_LOG_LEVEL")
    if level:
        logging.basicConfig()
        log.setLevel(level.upper())


RUNTIME = Runtime()
