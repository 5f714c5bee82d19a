"""Back-to-back dispatch + combine calls, every output checksummed: one rank of `tools/gpu.sh
reliability` (and of its `ranks`, `sanitize` and `ab` steps). Public API only (jaxep.initialize,
Config, dispatch, combine, check, finalize), so it also runs another tree's jaxep (PYTHONPATH).

    python -m jaxep.launch --nproc 8 --share-gpu tests/gpu/reliability_worker.py --calls 10000
    python tests/gpu/reliability_worker.py --calls 20                      # EP 1, one GPU
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tests/gpu/reliability_worker.py --calls 50                  # 8 CPU devices, reference

Each process is one rank (one device) under `jaxep.launch`; one process with several devices
runs every rank's shard itself with the reference backend (a CPU check of this script).

Inputs: `--inputs` different input sets (routing and payload differ; one has invalid expert ids),
built on every rank from one seed, used in turn, so a call that returned the previous or the next
call's rows shows. Every call returns, per rank, a position-weighted uint32 checksum of each of its
outputs (dispatch's rows, weights, group sizes / counts, combine's output), computed on the device
and compared on the host with the expected one of its input set:
  --check oracle  (normal mode) the NumPy oracle's outputs (tests/oracle.py), checksummed the
                  same way on the host: every call is checked against the reference; on sampled
                  calls (the first, every --sample_every-th, the last) the whole outputs are
                  fetched and compared bitwise too;
  --check self    the first call of each input set gives the expected checksums and outputs
                  (low-latency mode: consistency between calls, no oracle);
  --check none    only --digest.
Before each call the rank sleeps a random 0..--delay_ms (different on every rank), so ranks
arrive late by different amounts; each call is fetched before the next (--sync_every 1). A hang
cannot block for good: every device-side wait is bounded by Config.timeout_s, after which
jaxep.check() raises jaxep.TimeoutError (counted as a hang, then the run stops); --max_seconds
stops the loop early (reported) so a step's time box is kept.

--digest: prints `DIGEST <rank> <set> <sha256>` of the whole outputs of each input set's first
call (the `ab` step compares them between two trees).

Prints `RELIABILITY rank=<r> ...` (one per checked rank) and `SUMMARY <rank> ok|FAIL`; exits 1 on
any mismatch, hang or error.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10000, help="dispatch + combine calls per rank")
    p.add_argument("--delay_ms", type=float, default=4.0,
                   help="each call waits a random 0..delay_ms first (0: back to back)")
    p.add_argument("--inputs", type=int, default=5, help="input sets, used in turn")
    p.add_argument("--check", default=None, choices=("oracle", "self", "none"),
                   help="expected outputs (default: oracle in normal mode, self in low latency)")
    p.add_argument("--sample_every", type=int, default=500,
                   help="whole outputs compared bitwise on the first, every N-th and the last "
                        "call (0: first and last only)")
    p.add_argument("--sync_every", type=int, default=1,
                   help="fetch the checksums every N calls (1: each call waits for the last)")
    p.add_argument("--digest", action="store_true",
                   help="print the sha256 of each input set's first outputs")
    p.add_argument("--mode", default="normal", choices=("normal", "low_latency"))
    p.add_argument("--rows_per_expert", default="0",
                   help="low latency: Config.rows_per_expert (M); 0 = the Config's default, "
                        "bench = jaxep-bench's default M for these sizes")
    p.add_argument("--heap_for_ranks", type=int, default=0,
                   help="print `HEAP <bytes> <symmetric bytes>`, the NVSHMEM_SYMMETRIC_SIZE "
                        "jaxep.initialize recommends for this config on N ranks sharing one GPU, "
                        "and exit (no run; needs the built extension)")
    p.add_argument("--tokens", type=int, default=128, help="T per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts", type=int, default=0, help="E; 0 = --experts_per_rank x ranks")
    p.add_argument("--experts_per_rank", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--capacity_factor", type=float, default=1.25, help="0 = never drop")
    p.add_argument("--ranks_per_node", type=int, default=0, help="Config.ranks_per_node; 0 = machine's")
    p.add_argument("--num_sms", type=int, default=0, help="Config.num_sms; 0 = no cap")
    p.add_argument("--timeout_s", type=float, default=30.0, help="Config.timeout_s")
    p.add_argument("--max_seconds", type=float, default=0.0,
                   help="stop the loop after this long (0: never); reported, not a failure")
    p.add_argument("--check_every", type=int, default=100, help="jaxep.check() every N calls")
    p.add_argument("--backend", default=None, choices=("cuda", "reference"),
                   help="default: cuda on GPU, reference otherwise")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.check is None:
        a.check = "oracle" if a.mode == "normal" else "self"
    if a.check == "oracle" and a.mode != "normal":
        p.error("--check oracle is for --mode normal; low latency uses --check self")
    for name in ("calls", "inputs", "sync_every", "check_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.rows_per_expert != "bench" and not a.rows_per_expert.isdigit():
        p.error(f"--rows_per_expert: an integer >= 0 or 'bench', got {a.rows_per_expert!r}")
    if a.rows_per_expert not in ("0", "bench") and a.mode != "low_latency":
        p.error("--rows_per_expert is for --mode low_latency")
    return a


def make_config(a, R: int):
    """The run's jaxep.Config on R ranks (also what --heap_for_ranks sizes)."""
    import jaxep
    E = a.experts or a.experts_per_rank * R
    ll = {}
    if a.mode == "low_latency" and a.rows_per_expert == "bench":
        import types
        from jaxep.bench import low_latency  # jaxep-bench's M: its ll cases' heap fits this
        bc = types.SimpleNamespace(rows_per_expert=0, tokens=a.tokens, topk=a.topk, experts=E)
        ll = {"rows_per_expert": low_latency.rows_per_expert(bc, R)}
    elif a.mode == "low_latency" and int(a.rows_per_expert):
        ll = {"rows_per_expert": int(a.rows_per_expert)}
    return jaxep.Config(num_experts=E, topk=a.topk, hidden=a.hidden, max_tokens_per_rank=a.tokens,
                        capacity_factor=a.capacity_factor or None, dtype=a.dtype,
                        timeout_s=a.timeout_s, mode=a.mode, **ll,
                        **({"ranks_per_node": a.ranks_per_node} if a.ranks_per_node else {}),
                        **({"num_sms": a.num_sms} if a.num_sms else {}))


def heap_bytes(a, R: int) -> tuple[int, int]:
    """(NVSHMEM_SYMMETRIC_SIZE, symmetric block bytes) for this config on R ranks sharing one GPU:
    what jaxep.initialize computes and recommends (jaxep.runtime.sizes: Params.of, the
    extension's symmetric_bytes, recommended_env), from the jaxep on the path."""
    import dataclasses
    from jaxep import _extension
    from jaxep.runtime import sizes
    cfg = make_config(a, R)
    params = sizes.Params.of([cfg], device=0, rank=0, size=R, node_size=a.ranks_per_node or R)
    ext = _extension.module() if _extension.multi_rank_built() else None
    if ext is None:
        raise RuntimeError(f"no multi-rank extension here ({_extension.unavailable_reason()})")
    sym = ext.symmetric_bytes(ext.RuntimeParams(**dataclasses.asdict(params)))
    rec = sizes.recommended_env(sym, ranks_on_gpu=R)
    return int(rec["NVSHMEM_SYMMETRIC_SIZE"]), int(sym)


# ----------------------------------------------------------------------------------- checksum

_MUL = 2654435761  # Knuth's multiplicative hash constant: position weights mod 2**32


def _uint_view(a, np_or_jnp):
    """The array's bits as unsigned integers of its width, widened to uint32, flattened."""
    import numpy as np
    width = np.dtype(a.dtype).itemsize
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]
    if np_or_jnp is np:
        return np.ascontiguousarray(a).view(u).reshape(-1).astype(np.uint32)
    import jax
    return jax.lax.bitcast_convert_type(a, u).reshape(-1).astype(np_or_jnp.uint32)


def checksum_np(a) -> int:
    """Host twin of `checksum_jnp`: sum_i bits[i] * (i * _MUL + 1) mod 2**32 (uint32 arithmetic)."""
    import numpy as np
    with np.errstate(over="ignore"):
        v = _uint_view(np.asarray(a), np)
        w = np.arange(v.size, dtype=np.uint32) * np.uint32(_MUL) + np.uint32(1)
        return int(np.sum(v * w, dtype=np.uint32))


def checksum_jnp(a):
    import jax.numpy as jnp
    v = _uint_view(a, jnp)
    w = jnp.arange(v.size, dtype=jnp.uint32) * jnp.uint32(_MUL) + jnp.uint32(1)
    return jnp.sum(v * w, dtype=jnp.uint32)


# ----------------------------------------------------------------------------------- inputs

def make_inputs(seed, R, T, H, K, E, dtype, kind):
    """Every rank's (x [T,H], topk_idx [T,K], topk_weights [T,K]) from one seed."""
    import numpy as np
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for _ in range(R):
        if kind == "skewed":
            p = 1.0 / np.arange(1, E + 1) ** 1.5
            idx = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(T)])
        else:
            idx = np.argsort(rng.random((T, E)), axis=1)[:, :K]
        idx = idx.astype(np.int32)
        if kind == "bad_ids":  # -1 (no expert) and out-of-range ids: jaxep drops both
            m = rng.random(idx.shape)
            bad = rng.choice(np.array([E, E + 3, -2, -7], np.int64), idx.shape)
            idx = np.where(m < 0.05, -1, np.where(m < 0.1, bad, idx)).astype(np.int32)
        idxs.append(idx)
        xs.append(rng.standard_normal((T, H)).astype(np.float32).astype(dtype))
        ws.append(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32))
    return xs, idxs, ws


KINDS = ("uniform", "skewed", "bad_ids", "uniform", "skewed", "uniform", "bad_ids")


# ----------------------------------------------------------------------------------- run

def main(argv=None) -> int:
    a = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if ROOT not in sys.path:
        sys.path.append(ROOT)  # last: a tree on PYTHONPATH (the `ab` step's base) wins for jaxep
    import jaxep

    if a.heap_for_ranks:
        try:
            heap, sym = heap_bytes(a, a.heap_for_ranks)
        except RuntimeError as e:
            print(f"HEAP unknown: {e}", flush=True)
            return 3
        print(f"HEAP {heap} {sym}", flush=True)
        return 0
    multi = jax.process_count() > 1
    R = jax.process_count() if multi else len(jax.devices())
    me = jax.process_index()
    mine_ranks = [me] if multi else list(range(R))  # the ranks whose shards this process checks
    on_gpu = jax.default_backend() == "gpu"
    backend = a.backend or ("cuda" if on_gpu and (multi or R == 1) else "reference")
    E = a.experts or a.experts_per_rank * R
    G = a.ranks_per_node or R
    dtype = jnp.dtype(a.dtype)
    cfg = make_config(a, R)
    jaxep.initialize(cfg)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    spec = NamedSharding(mesh, P("ep"))
    say = (lambda *s: print(*s, flush=True)) if me == 0 or not multi else (lambda *s: None)
    say(f"CONFIG ranks={R} layout={R // G}x{G} backend={backend} mode={a.mode} T={a.tokens} "
        f"H={a.hidden} K={a.topk} E={E}"
        f"{f' M={cfg.expert_rows(R)}' if a.mode == 'low_latency' else ''} dtype={a.dtype} capacity_factor={a.capacity_factor or None} "
        f"calls={a.calls} delay_ms=0..{a.delay_ms} inputs={a.inputs} check={a.check} "
        f"jaxep={os.path.dirname(jaxep.__file__)}")

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=backend)
        counts = res.counts if a.mode == "low_latency" else res.group_sizes
        out = jaxep.combine(res.x, res.handle, axis_name="ep")
        outs = (res.x, res.weights, counts, out)
        sums = jnp.stack([checksum_jnp(o) for o in outs])[None]
        return (*(o[None] for o in outs), sums)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 5))

    def glob(per_rank):
        if not multi:
            return jax.device_put(np.concatenate(per_rank), spec)
        local = per_rank[me]
        shape = (R * local.shape[0],) + local.shape[1:]
        return jax.make_array_from_single_device_arrays(
            shape, spec, [jax.device_put(local, jax.local_devices()[0])])

    def shard(arr, r):
        for s in arr.addressable_shards:
            if s.device == jax.devices()[r]:
                return np.asarray(s.data)[0]
        raise AssertionError(f"no shard of rank {r}")

    t0 = time.time()
    sets, host_sets = [], []
    for i in range(a.inputs):
        xs, idxs, ws = make_inputs([a.seed, i], R, a.tokens, a.hidden, a.topk, E, dtype,
                                   KINDS[i % len(KINDS)])
        host_sets.append((xs, idxs, ws))
        sets.append(tuple(glob(v) for v in (xs, idxs, ws)))
    expected = {}  # (set, rank) -> (checksums, whole outputs)
    if a.check == "oracle":
        from tests import oracle
        C = cfg.capacity(R)
        for i, (xs, idxs, ws) in enumerate(host_sets):
            o = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=C)
            outs = oracle.combine(o["x"], o["weights"], o["send_row"], idxs, num_experts=E,
                                  ranks_per_node=G, wire_dtype=cfg.combine_wire_dtype)
            for r in mine_ranks:
                want = (o["x"][r], o["weights"][r], o["group_sizes"][r], outs[r])
                expected[i, r] = ([checksum_np(v) for v in want], want)
    t_setup = time.time() - t0
    compiled_at = time.time()
    jax.block_until_ready(f(*sets[0]))  # compile (and a first call, not counted)
    jaxep.check()
    say(f"SETUP inputs+oracle {t_setup:.1f}s, compile+first call {time.time() - compiled_at:.1f}s")

    rng = np.random.default_rng([a.seed, 1000 + me])
    stats = {r: dict(mismatch=0, bitwise=0, bitwise_bad=0) for r in mine_ranks}
    first_bad: dict[int, str] = {}
    hangs = errors = done = 0
    stopped = ""
    pending = []  # (call index, set index, outputs) not yet fetched
    names = ("rows", "weights", "counts", "combine")

    def sampled(c):
        return c == 0 or c == a.calls - 1 or (a.sample_every and c % a.sample_every == 0)

    def fetch(c, i, res):
        nonlocal done
        for r in mine_ranks:
            got_sums = [int(v) for v in shard(res[4], r)]
            whole = None
            if (i, r) not in expected:  # --check self / none: the first call of the set decides
                whole = tuple(shard(res[j], r) for j in range(4))
                expected[i, r] = (got_sums, whole)
                if a.digest:
                    h = hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for v in whole))
                    print(f"DIGEST {r} {i} {h.hexdigest()}", flush=True)
            want_sums, want = expected[i, r]
            if a.check != "none" and got_sums != want_sums:
                stats[r]["mismatch"] += 1
                bad = [n for n, g, w in zip(names, got_sums, want_sums) if g != w]
                first_bad.setdefault(r, f"call {c} set {i}: checksum of {','.join(bad)} differs")
            if a.check != "none" and sampled(c):
                whole = whole or tuple(shard(res[j], r) for j in range(4))
                stats[r]["bitwise"] += 1
                for n, g, w in zip(names, whole, want):
                    g, w = np.asarray(g), np.asarray(w)
                    if g.shape != w.shape or g.dtype != w.dtype or g.tobytes() != w.tobytes():
                        stats[r]["bitwise_bad"] += 1
                        first_bad.setdefault(r, f"call {c} set {i}: {n} not bitwise equal "
                                                f"(shape {g.shape}/{w.shape} {g.dtype}/{w.dtype})")
                        break
        done = c + 1

    loop_t0 = time.time()
    per_call = []
    try:
        for c in range(a.calls):
            if a.max_seconds and time.time() - loop_t0 > a.max_seconds:
                stopped = f"stopped after {c} calls: --max_seconds {a.max_seconds:g}"
                break
            if a.delay_ms > 0:
                time.sleep(rng.uniform(0.0, a.delay_ms) / 1000.0)
            i = c % a.inputs
            tc = time.perf_counter()
            pending.append((c, i, f(*sets[i])))
            if len(pending) >= a.sync_every or c == a.calls - 1:
                for item in pending:
                    fetch(*item)
                pending.clear()
                per_call.append(time.perf_counter() - tc)
            if (c + 1) % a.check_every == 0:
                jaxep.check()
    except jaxep.TimeoutError as e:
        hangs += 1
        stopped = f"jaxep.TimeoutError after {done} calls: {e}"
        print(f"HANG {me} {stopped}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
        errors += 1
        stopped = f"{type(e).__name__} after {done} calls: {e}".replace("\n", " ")[:500]
        print(f"ERROR {me} {stopped}", flush=True)
        traceback.print_exc()
    if not hangs and not errors:
        try:
            jaxep.check()
        except jaxep.TimeoutError as e:
            hangs += 1
            stopped = f"jaxep.TimeoutError at the end: {e}"
    secs = time.time() - loop_t0
    ok = not hangs and not errors
    pc = np.array(per_call or [0.0]) * 1e3
    for r in mine_ranks:
        s = stats[r]
        ok &= s["mismatch"] == 0 and s["bitwise_bad"] == 0
        print(f"RELIABILITY rank={r} calls={done}/{a.calls} checksum_mismatches={s['mismatch']} "
              f"bitwise_checked={s['bitwise']} bitwise_mismatches={s['bitwise_bad']} hangs={hangs} "
              f"errors={errors} secs={secs:.1f} ms_per_call={1e3 * secs / max(done, 1):.2f} "
              f"call_ms_p50={np.median(pc):.2f} call_ms_max={pc.max():.2f}"
              + (f" first_mismatch=[{first_bad[r]}]" if r in first_bad else "")
              + (f" note=[{stopped}]" if stopped else ""), flush=True)
    print(f"SUMMARY {me} {'ok' if ok else 'FAIL'}", flush=True)
    if hangs or errors:
        sys.stdout.flush()
        os._exit(1)  # a peer may be gone: skip the collective finalize
    jaxep.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
