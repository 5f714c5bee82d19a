"""Multi-rank benchmark (every rank on one GPU under MPS, or one GPU per rank where the machine
has --nproc GPUs: --share-gpu / --no-share-gpu force either): a thin wrapper that runs `jaxep-bench` once per expert count
under `jaxep.launch` and prints one short table from the JSON files.

    python tools/bench_multirank.py --nproc 8 --experts 64,256 --outdir /tmp/bench
    python tools/bench_multirank.py --nproc 8 --experts 64 --staged  # --nozero_copy, *_staged
    # runs, for each E (each a separate launch: jaxep.initialize fixes one Config per run):
    python -m jaxep.launch --nproc 8 --share-gpu --timeout 300 -m jaxep.bench --backend cuda \
        --tokens 4096 --hidden 7168 --topk 8 --experts E --dtype bfloat16 --iters 10 \
        --dispatch_kernel token --combine_kernel warp --zero_copy \
        --json OUTDIR/bench_n8_eE.json --plot OUTDIR/bench_n8_eE.png      (log: bench_n8_eE.log)

The kernel variants and zero-copy are jaxep.Config fields; this wrapper passes them to the bench
as its flags (--dispatch_kernel, --combine_kernel, --zero_copy / --nozero_copy), which build the
Config every rank initializes with (identical on every rank, checked by jaxep.initialize).

Everything the old per-rank script did now lives in the bench (jaxep/bench/): every rank checks
its shard against the host oracle before timing (XLA collectives cannot run with ranks sharing a
GPU), the ranks meet at a barrier before timing, each process's timings go to process 0 through
the key-value store, and the baselines are timed in the same run by every rank at once: a copy of
the op's least device-memory bytes (`vs_copy`) and a copy of the deduplicated payload (unique
(token, destination rank) rows), 1/R of it per rank (`payload_copy/op`: docs/performance.md's
"dispatch / copy_all" metric; > 1 means faster than that copy).

`--backend reference --no-share-gpu` with JAX_PLATFORMS=cpu runs the same thing on CPU (checks this
wrapper without a GPU). Exit code: 0 when every run passed, else the first failing run's code.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_command(a, experts: int, base: str) -> list[str]:
    cmd = [sys.executable, "-m", "jaxep.launch", "--nproc", str(a.nproc)]
    if a.share_gpu:
        cmd.append("--share-gpu")
    cmd += ["--timeout", str(a.timeout), "-m", "jaxep.bench", f"--backend={a.backend}",
            f"--tokens={a.tokens}", f"--hidden={a.hidden}", f"--topk={a.topk}",
            f"--experts={experts}", f"--dtype={a.dtype}", f"--iters={a.iters}",
            f"--warmup={a.warmup}", f"--inner={a.inner}", f"--json={base}.json",
            f"--dispatch_kernel={a.dispatch_kernel}", f"--combine_kernel={a.combine_kernel}",
            "--nozero_copy" if a.staged else "--zero_copy"]
    if a.ranks_per_node:
        cmd.append(f"--ranks_per_node={a.ranks_per_node}")
    if a.plot:
        cmd.append(f"--plot={base}.png")
    return cmd + list(a.bench_args)


def rank_env(a) -> dict:
    """The ranks' environment: this one's, logging at INFO unless set (debug pass-through only:
    the kernel choices and zero-copy travel as bench flags, see bench_command)."""
    del a
    env = dict(os.environ)
    env.setdefault("JAXEP_LOG_LEVEL", "INFO")  # "jaxep zero-copy: on|off: <why>" in the log
    return env


def row(n: int, e: int, rc: int, secs: float, doc: dict | None, kernels: str = "token/warp") -> dict:
    r = dict(N=n, E=e, rc=rc, secs=round(secs, 1), kernels=kernels)
    if doc is None:
        return r
    ops = doc["ops"]
    r.update(ok=bool(doc["correctness"]["passed"]),
             payload_MB=doc["copy_baseline"]["payload"]["bytes_total"] / 1e6,
             payload_copy_ms=doc["copy_baseline"]["payload"]["time_s"]["median"] * 1e3)
    for op in ("dispatch", "combine", "both"):
        t = ops[op]["time_s"]
        r[f"{op}_ms"] = t["median"] * 1e3
        r[f"{op}_payload_copy_over_op"] = ops[op]["payload"]["copy_over_op"]
        r[f"{op}_vs_copy"] = ops[op]["baselines"]["copy"]["ratio"]
        r[f"{op}_spread"] = (max(t["per_process_median"]) / min(t["per_process_median"])
                             if t.get("per_process_median") else None)
        r[f"{op}_handler_runs"] = t.get("handler_runs_per_op")
    r["inner"] = ops["dispatch"]["time_s"]["inner"]
    return r


def table(rows) -> str:
    head = (f"{'N':>2} {'E':>4} {'rc':>3} {'ok':>3} {'pay MB':>8} {'disp ms':>8} {'comb ms':>8} "
            f"{'both ms':>8} {'pcopy ms':>8} {'d pc/op':>7} {'c pc/op':>7} {'d/copy':>7} "
            f"{'c/copy':>7} {'inner':>5} {'h/op d,c':>8} {'secs':>5} {'kernels d/c':>11}")
    out = [head]
    for r in rows:
        if "ok" not in r:
            out.append(f"{r['N']:>2} {r['E']:>4} {r['rc']:>3}   - (no JSON; see the log) {r['secs']:>5}")
            continue
        hr = (f"{r['dispatch_handler_runs']:g},{r['combine_handler_runs']:g}"
              if r["dispatch_handler_runs"] is not None else "-")
        out.append(f"{r['N']:>2} {r['E']:>4} {r['rc']:>3} {str(r['ok'])[0]:>3} {r['payload_MB']:>8.1f} "
                   f"{r['dispatch_ms']:>8.3f} {r['combine_ms']:>8.3f} {r['both_ms']:>8.3f} "
                   f"{r['payload_copy_ms']:>8.3f} {r['dispatch_payload_copy_over_op']:>7.2f} "
                   f"{r['combine_payload_copy_over_op']:>7.2f} {r['dispatch_vs_copy']:>7.2f} "
                   f"{r['combine_vs_copy']:>7.2f} {r['inner']:>5} {hr:>8} {r['secs']:>5} "
                   f"{r.get('kernels', 'token/warp'):>11}")
    out.append("pcopy = every rank copies 1/N of the payload at once; pc/op = pcopy / op (> 1: faster "
               "than that copy); x/copy = op / copy of its least HBM bytes; h/op = multi-rank host "
               "handler runs per op (expected 1); kernels d/c = Config.dispatch_kernel/combine_kernel of "
               "the run (+st: --staged, Config.zero_copy=False)")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--experts", default="64,256", help="comma-separated; one launch each")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", type=int, default=0, help="ops per timed sample (0: ~20 ms)")
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--share-gpu", dest="share_gpu", action=argparse.BooleanOptionalAction,
                   default=None, help="all ranks on one GPU under CUDA MPS; default: only where "
                   "fewer than --nproc GPUs are visible (else one GPU per rank)")
    p.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    p.add_argument("--outdir", default=".")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--summary_json", default=None, help="also write the table's rows here")
    # The bench validates these against jaxep.config (DISPATCH_KERNELS, COMBINE_KERNELS) too.
    p.add_argument("--dispatch_kernel", default="token", choices=("token", "row"),
                   help="jaxep.Config.dispatch_kernel of the run (jaxep-bench --dispatch_kernel)")
    p.add_argument("--combine_kernel", default="warp", choices=("warp", "thread"),
                   help="jaxep.Config.combine_kernel of the run (jaxep-bench --combine_kernel)")
    p.add_argument("--staged", action="store_true",
                   help="jaxep.Config.zero_copy=False (jaxep-bench --nozero_copy): stage x and y in "
                        "NVSHMEM's heap instead of reading them in XLA's pool (docs/zero_copy.md); "
                        "files tagged _staged")
    p.add_argument("--ranks_per_node", type=int, default=0,
                   help="Config.ranks_per_node (e.g. 4: 8 ranks as 2 emulated nodes x 4); 0 = one "
                        "node of --nproc ranks")
    p.add_argument("bench_args", nargs="*", help="more jaxep.bench flags (after --)")
    a = p.parse_args(argv)
    if a.share_gpu is None:  # decided once: every rank on one GPU only where there are fewer GPUs
        from jaxep.launch.env import ranks_share_gpu  # pylint: disable=g-import-not-at-top
        a.share_gpu = ranks_share_gpu(a.nproc, os.environ)
    return a


def run_label(a: argparse.Namespace) -> tuple[str, str]:
    """(the table's kernels column, the files' name tag) of one setup: every knob that changes the
    run names its files, so runs of one call never overwrite each other's JSON/log/PNG."""
    kernels = f"{a.dispatch_kernel}/{a.combine_kernel}"
    tag = "" if kernels == "token/warp" else f"_{a.dispatch_kernel}_{a.combine_kernel}"
    if a.staged:
        kernels, tag = kernels + "+st", tag + "_staged"
    if a.ranks_per_node:
        kernels += f" {a.nproc // a.ranks_per_node}x{a.ranks_per_node}"
        tag += f"_g{a.ranks_per_node}"
    if a.tokens != 4096:
        tag += f"_t{a.tokens}"
    if a.backend == "cuda" and not a.share_gpu:  # one GPU per rank (a multi-GPU node)
        kernels, tag = kernels + " gpu/rank", tag + "_gpu-per-rank"
    # Extra jaxep.bench flags (e.g. the combine wire dtype) name the files too.
    for extra in a.bench_args:
        tag += "_" + "".join(c if c.isalnum() else "-" for c in extra.lstrip("-"))
        if extra.startswith("--combine_wire_dtype="):
            kernels += " w:" + extra.split("=", 1)[1]
        elif extra == "--dispatch_wire_dtype=float8_e4m3fn":
            kernels += " d:fp8"
        elif extra == "--mode=low_latency":
            kernels += f" LL T={a.tokens}"
        elif extra == "--fp8_dispatch":
            kernels += " fp8"
    return kernels, tag


def main(argv=None) -> int:
    if os.environ.get("JAXEP_COORDINATOR"):
        print("tools/bench_multirank.py now starts the ranks itself; run it directly:\n"
              "  python tools/bench_multirank.py --nproc 8 --experts 64,256\n"
              "(or one run: python -m jaxep.launch --nproc 8 --share-gpu -m jaxep.bench "
              "--backend cuda ...)", file=sys.stderr)
        return 2
    a = parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    rows, first_rc = [], 0
    for e in (int(v) for v in a.experts.split(",")):
        kernels, tag = run_label(a)
        base = os.path.join(a.outdir, f"bench_n{a.nproc}_e{e}{tag}")
        for stale in (base + ".json",):
            if os.path.exists(stale):
                os.remove(stale)
        cmd = bench_command(a, e, base)
        print(f"bench_multirank: N={a.nproc} E={e}: {' '.join(cmd)}  (log: {base}.log)", flush=True)
        t0 = time.time()
        with open(base + ".log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env=rank_env(a)).returncode
        doc = None
        if os.path.exists(base + ".json"):
            with open(base + ".json") as f:
                doc = json.load(f)
        rows.append(row(a.nproc, e, rc, time.time() - t0, doc, kernels))
        print(f"bench_multirank: N={a.nproc} E={e}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
        first_rc = first_rc or rc or (0 if doc else 1)
    print(table(rows), flush=True)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            json.dump(rows, f, indent=1)
    return first_rc


if __name__ == "__main__":
    sys.exit(main())
