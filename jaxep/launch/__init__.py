"""`python -m jaxep.launch --nproc N [--share-gpu] script.py args...`: N local ranks, like torchrun
(docs/launch.md); `--nnodes M --node_rank i --coordinator host:port` on each of M nodes for
M x N ranks (docs/multinode.md). One job per file:

  env.py       the children's environment: EnvSetting, Plan, make_plan, the `--share-gpu` settings
               (share_gpu_env, xla_mem_fraction), visible_gpus, the JAXEP_* names, LaunchError,
               and initialize_distributed (with distributed_args), the helper a child calls to
               set up jax.distributed
  mps.py       the CUDA MPS control daemon of `--share-gpu`: MpsDaemon, mps_start, mps_stop
  group.py     the process group (run_group: start, stream, stop on failure, timeout or signal),
               the coordinator port (free_port, coordinator_port_taken) and the children's
               bootstrap (child_command, the hidden `--_child` mode)
  cli.py       the command line: the parser, main, _launch
  __main__.py  `python -m jaxep.launch`, for the launcher and its children alike
"""
from jaxep.launch.cli import main
from jaxep.launch.env import (ENV_COORDINATOR, ENV_LOCAL_DEVICE_IDS, ENV_LOCAL_RANK,
                              ENV_NUM_PROCESSES, ENV_PROCESS_ID, JAX_COORDINATOR_ADDRESS,
                              XLA_SHARED_GPU_FRACTION, EnvSetting, LaunchError, Plan,
                              distributed_args, initialize_distributed, make_plan, share_gpu_env,
                              visible_gpus, xla_mem_fraction)
from jaxep.launch.group import (PORT_ATTEMPTS, TAIL_LINES, child_command, coordinator_port_taken,
                                describe_status, free_port, run_group)
from jaxep.launch.mps import MPS_CONTROL, MpsDaemon, mps_start, mps_stop

__all__ = [
    "ENV_COORDINATOR", "ENV_LOCAL_DEVICE_IDS", "ENV_LOCAL_RANK", "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "MPS_CONTROL", "PORT_ATTEMPTS", "TAIL_LINES",
    "XLA_SHARED_GPU_FRACTION", "EnvSetting", "LaunchError", "MpsDaemon", "Plan", "child_command",
    "coordinator_port_taken", "describe_status", "distributed_args", "free_port",
    "initialize_distributed", "main", "make_plan", "mps_start",
    "mps_stop", "run_group", "share_gpu_env", "visible_gpus", "xla_mem_fraction",
]
