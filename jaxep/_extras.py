"""What each tool needs beyond the library (jax and numpy), as the extras of pyproject.toml.

The library (ops, backends, runtime, config, jaxep.nn) imports none of these. Each tool's entry
point calls `require` before any work, so a tool run without its extra exits with one line that
names the extra to install instead of a traceback.
"""
from __future__ import annotations

import importlib

# extra -> (the command it serves, the modules it must provide)
EXTRAS = {
    "bench": ("jaxep-bench", ("absl", "rich")),   # matplotlib too, asked for only by --plot
    "doctor": ("python -m jaxep.doctor", ("psutil",)),
    "launch": ("python -m jaxep.launch", ("psutil",)),
    "nn": ("jaxep.nn and jaxep-bench --layer", ("flax",)),
}


def missing(modules) -> list[str]:
    """The `modules` that do not import here."""
    out = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def require(extra: str, modules=None) -> None:
    """SystemExit with one line naming `extra` when one of `modules` (default: the extra's) does
    not import."""
    command, default = EXTRAS[extra]
    gone = missing(default if modules is None else modules)
    if gone:
        raise SystemExit(f"{command} needs {', '.join(gone)}, which is not installed: "
                         f"pip install 'jaxep[{extra}]'")
