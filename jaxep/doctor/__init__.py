"""`python -m jaxep.doctor` (`jaxep.doctor.report.main`): what this machine has for jaxep, and
what is wrong or slow.

A tool beside the library (its extra: [doctor]): `report` (the facts, the report, the command
line), `qos` (RoCE QoS, bonds, NICs left idle), `stacks` (every EP stack's priority: NVSHMEM,
NCCL, NCCL GIN, HybridEP), `bond` (each bond member's share of the bytes, the LAG's port
selection, NVSHMEM's UDP source port), `counters` (the NICs' counters), `packages` (the installed
wheels and their CUDA majors), `record` (`--record` / `--replay`), `printout` and `explain`
(`--explain`: another stack's test printout), `story` (`--explain` with `--replay`: the account). The network facts
and what NVSHMEM makes of them are the library's `jaxep.topology` (the runtime logs them and words
a network failure with them), which the doctor reports.
"""
