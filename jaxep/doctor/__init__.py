"""`python -m jaxep.doctor` (`jaxep.doctor.report.main`): what this machine has for jaxep, and what is wrong or slow.

A tool beside the library: `report` (the facts and the report), `topology` (what NVSHMEM makes of
the machine: settings, NIC choice, findings) over `machine` (what the machine has, read and never
changed). The library imports `topology` only to word a network failure of `jaxep.initialize` and,
at INFO, to log the network it will use.
"""
