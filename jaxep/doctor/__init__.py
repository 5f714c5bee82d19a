"""`python -m jaxep.doctor` (`jaxep.doctor.report.main`): what this machine has for jaxep, and
what is wrong or slow.

A tool beside the library (its extra: [doctor]): `report` (the facts and the report) over
`topology` (the reports of what NVSHMEM makes of the machine), `findings` (what is wrong or slow),
`rules` (NVSHMEM's settings and the NIC it gives each GPU) and `machine` (what the machine has,
read and never changed). The library imports `topology` only to word a network failure of
`jaxep.initialize` and, at INFO, to log the network it will use: `topology`, `findings`, `rules`
and `machine` import nothing beyond the standard library.
"""
