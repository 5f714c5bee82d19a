"""`python -m jaxep.doctor` (`jaxep.doctor.report.main`): what this machine has for jaxep, and
what is wrong or slow.

A tool beside the library (its extra: [doctor]): `report` (the facts, the report, the command
line), `qos` (RoCE QoS, bonds, NICs left idle), `counters` (the NICs' counters), `packages` (the
installed wheels and their CUDA majors), `record` (`--record` / `--replay`). The network facts
and what NVSHMEM makes of them are the library's `jaxep.topology` (the runtime logs them and words
a network failure with them), which the doctor reports.
"""
