"""The recorded seed node (tests/fixtures/topology/seed_node) as a writable copy, and its NIC
counters moved: what the wire tests of the bench and the doctor share."""
from __future__ import annotations

import os
import shutil

SEED = os.path.join(os.path.dirname(__file__), "fixtures", "topology", "seed_node")


def copy_root(tmp_path) -> str:
    """A copy of the seed node's file tree under tmp_path (its counters may then be moved)."""
    root = str(tmp_path / "root")
    shutil.copytree(os.path.join(SEED, "root"), root)
    return root


def bump(root, nic, rel, by) -> None:
    """Adds `by` to the counter file `rel` of port 1 of `nic` under `root`."""
    path = os.path.join(root, "sys/class/infiniband", nic, "ports/1", rel)
    with open(path) as f:
        v = int(f.read())
    with open(path, "w") as f:
        f.write(f"{v + by}\n")
