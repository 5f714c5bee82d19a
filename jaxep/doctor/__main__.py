"""`python -m jaxep.doctor`: see `jaxep.doctor.report`."""
import sys

from jaxep.doctor.report import main

sys.exit(main())
