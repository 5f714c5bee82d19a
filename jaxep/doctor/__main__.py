"""`python -m jaxep.doctor`: see `jaxep.doctor.report`."""
import sys

from jaxep import _extras

_extras.require("doctor")  # before report imports psutil

from jaxep.doctor.report import main  # noqa: E402  pylint: disable=g-import-not-at-top

sys.exit(main())
