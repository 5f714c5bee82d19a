"""Nothing in the repository refers to a file it does not contain: every path of this repository's
folders (docs/, jaxep/, tests/, tools/, ffi/, examples/) named in the docs, the library's code and
comments, the extension's sources and the tools is a tracked file or folder. A path read from git
history (`git show REV:path`) or from another project (NVSHMEM's `...`) is not this tree's."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = re.compile(r"(?<![\w./:-])((?:docs|jaxep|tests|tools|ffi|examples)/[\w./-]*\w)")
ELSEWHERE = re.compile(r"git show \S*$|NVSHMEM's `?$|[\w.-]+:$")  # what precedes a path of another tree


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.split()


def _sources(files):
    for f in files:
        if f.startswith(("docs/perf/", "tests/")):
            continue  # raw outputs quote their own day's paths; tests name key-value keys
        if f.endswith((".md", ".py", ".h", ".cc", ".cu", ".cuh", ".sh")) or f == "CMakeLists.txt":
            yield f


def test_every_path_named_exists():
    files = _tracked()
    known = set(files) | {os.path.dirname(f) for f in files}
    known |= {p for f in files for p in (f.rsplit("/", k)[0] for k in range(1, f.count("/") + 1))}
    missing = []
    for f in _sources(files):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                for m in PATH.finditer(line):
                    path, after = m.group(1).rstrip("."), line[m.end():m.end() + 2]
                    if after[:1] in ("{", "*", "<") or after in (".{", ".*", "/{", "/<", "/*"):
                        continue  # a pattern (exchange.{h,cc}, test_*.py) or a key-value key
                    if path in known or ELSEWHERE.search(line[:m.start()]):
                        continue
                    missing.append(f"{f}:{n}: {path}")
    assert not missing, "paths this tree does not contain:\n" + "\n".join(missing)
