"""`python -m jaxep.launch ...`: the launcher, and (with the hidden `--_child` first argument, see
group.child_command) each child's bootstrap."""
import sys

from jaxep import _extras
from jaxep.launch.cli import main

if __name__ == "__main__":
    _extras.require("launch")
    sys.exit(main())
