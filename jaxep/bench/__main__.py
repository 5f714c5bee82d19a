"""jaxep-bench: times jaxep.dispatch / combine after checking them, and explains the time
(bytes per link class, the floor each implies, same-run baselines). docs/benchmark.md.

  python -m jaxep.bench --tokens 4096 --hidden 7168 --topk 8 --experts 64 --json out.json --plot out.png
  python -m jaxep.bench --cpu_devices 8 --ranks_per_node 4 --tokens 256 --hidden 512 --topk 4 --experts 32
"""
from jaxep.bench import console_main

console_main()
