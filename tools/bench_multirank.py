"""Multi-rank dispatch/combine timing on one GPU (or one node), one process per rank.

    python -m jaxep.launch --nproc 8 --share-gpu tools/bench_multirank.py --experts 64,256

Per op: median wall time per call over --iters (each call blocked on), per rank; the slowest rank's
median is the op's time. Metric (issue 3): deduplicated payload = unique (token, destination rank)
pairs x H x itemsize, summed over ranks, divided by that time, as a ratio to a device copy of the
same bytes timed in the same run:
  copy_solo: rank 0 alone (its MPS share of SMs), the others idle at a barrier;
  copy_all:  every rank copies 1/R of the bytes at once (the same SM shares as the op).
The copy is an XLA elementwise kernel (read N bytes, write N bytes). Correctness is checked first
(dispatch rows bitwise against a vectorized NumPy layout, combine against float64 to 1e-2).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxep
from jaxep import cuda_backend

R, ME = jax.process_count(), jax.process_index()
MESH = Mesh(np.array(jax.devices()), ("ep",))
SPEC = NamedSharding(MESH, P("ep"))


def glob(local):
    shape = (R * local.shape[0],) + local.shape[1:]
    return jax.make_array_from_single_device_arrays(
        shape, SPEC, [jax.device_put(local, jax.local_devices()[0])])


def mine(a):
    return np.asarray(a.addressable_shards[0].data)


def client():
    from jax._src import distributed
    return distributed.global_state.client


_BARRIER = [0]


def barrier():
    _BARRIER[0] += 1
    client().wait_at_barrier(f"bench_{_BARRIER[0]}", 120_000)


def gather_floats(name, value):
    c = client()
    c.key_value_set(f"bench/{name}/{ME}", repr(float(value)))
    return [float(c.blocking_key_value_get(f"bench/{name}/{r}", 120_000)) for r in range(R)]


def time_calls(fn, iters, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    jaxep.check()
    return statistics.median(ts)


def routing(rng, T, K, E):
    # uniform: K distinct experts per token (argsort of random keys is vectorized)
    return np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)


def expected_rows(xs, idxs, E, C):
    """This rank's dispatch rows (vectorized layout: key (local expert, source, t, k))."""
    L = E // R
    T, K = idxs[0].shape
    keys, src = [], []
    for s in range(R):
        e = idxs[s].reshape(-1)
        sel = np.nonzero(e // L == ME)[0]
        keys.append(np.stack([e[sel] % L, np.full(sel.shape, s), sel], 1))
    k = np.concatenate(keys)
    order = np.lexsort((k[:, 2], k[:, 1], k[:, 0]))[:C]
    k = k[order]
    rows = np.zeros((C, xs[0].shape[1]), xs[0].dtype)
    rows[: len(k)] = np.stack([xs[s][slot // K] for _, s, slot in k]) if len(k) else rows[:0]
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", default="64,256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="")
    a = p.parse_args()
    experts = [int(e) for e in a.experts.split(",")]
    T, H, K = a.tokens, a.hidden, a.topk
    cfg = jaxep.Config(num_experts=max(experts), topk=K, hidden=H, max_tokens_per_rank=T,
                       dtype="bfloat16", timeout_s=60.0)
    jaxep.initialize(cfg)
    C = cfg.capacity(R)
    results = []
    for E in experts:
        rng = np.random.default_rng(1234 + E)
        idxs = [routing(rng, T, K, E) for _ in range(R)]
        xs = [rng.standard_normal((T, H), np.float32).astype(jnp.bfloat16) for _ in range(R)]
        ws = [rng.uniform(0.1, 1.0, (T, K)).astype(np.float32) for _ in range(R)]
        L = E // R
        dedup = sum(len(np.unique(np.arange(T)[:, None] * R + idxs[s] // L)) for s in range(R))
        dedup_bytes = dedup * H * 2
        ecfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                            dtype="bfloat16")

        def disp(x, idx, w):
            return cuda_backend.dispatch(x, idx, w, axis_name="ep", config=ecfg, capacity=C)

        def comb(y, wts, send_row, recv_slot, idx_out):
            return cuda_backend.combine(y, wts, send_row, recv_slot, idx_out, axis_name="ep",
                                        num_experts=E)

        fd = jax.jit(jax.shard_map(disp, mesh=MESH, in_specs=(P("ep"),) * 3,
                                   out_specs=(P("ep"),) * 7))
        fc = jax.jit(jax.shard_map(comb, mesh=MESH, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
        x, idx, w = glob(xs[ME]), glob(idxs[ME]), glob(ws[ME])
        d = fd(x, idx, w)
        jax.block_until_ready(d)
        jaxep.check()
        rows, wts, gsz, send_row, recv_slot, idx_out, stats = d
        ok_rows = mine(rows).tobytes() == expected_rows(xs, idxs, E, C).tobytes()
        out = fc(rows, wts, send_row, recv_slot, idx_out)
        jax.block_until_ready(out)
        # combine of the dispatched rows: out[t] = x[t] * sum of kept weights (to rounding)
        sr = mine(send_row)
        wsum = np.where(sr >= 0, ws[ME], 0.0).sum(1)
        ok_comb = np.allclose(mine(out).astype(np.float64),
                              xs[ME].astype(np.float64) * wsum[:, None], rtol=2e-2, atol=2e-2)
        oks = gather_floats(f"ok{E}", float(ok_rows and ok_comb))
        t_d = time_calls(lambda: fd(x, idx, w), a.iters)
        t_c = time_calls(lambda: fc(rows, wts, send_row, recv_slot, idx_out), a.iters)
        td_all, tc_all = gather_floats(f"td{E}", t_d), gather_floats(f"tc{E}", t_c)
        # copies of the same bytes
        n = dedup_bytes // 2
        copy = jax.jit(lambda v: v + jnp.bfloat16(1))
        t_solo = 0.0
        if ME == 0:
            big = jnp.full((n,), 1.5, jnp.bfloat16)
            for _ in range(3):
                jax.block_until_ready(copy(big))
            ts = []
            for _ in range(a.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(copy(big))
                ts.append(time.perf_counter() - t0)
            t_solo = statistics.median(ts)
            del big
        barrier()
        part = jnp.full((n // R,), 1.5, jnp.bfloat16)
        t_part = time_calls(lambda: copy(part), a.iters)
        del part
        tp_all = gather_floats(f"tp{E}", t_part)
        t_solo = gather_floats(f"ts{E}", t_solo)[0]
        if ME == 0:
            td, tc, tp = max(td_all), max(tc_all), max(tp_all)
            r = dict(E=E, R=R, T=T, H=H, K=K, C=C, correct=all(v == 1.0 for v in oks),
                     dedup_bytes=dedup_bytes, dispatch_s=td, combine_s=tc, copy_solo_s=t_solo,
                     copy_all_s=tp, dispatch_GBps=dedup_bytes / td / 1e9,
                     combine_GBps=dedup_bytes / tc / 1e9, copy_solo_GBps=dedup_bytes / t_solo / 1e9,
                     copy_all_GBps=dedup_bytes / tp / 1e9,
                     dispatch_vs_solo=t_solo / td, combine_vs_solo=t_solo / tc,
                     dispatch_vs_all=tp / td, combine_vs_all=tp / tc,
                     dispatch_rank_medians=td_all, combine_rank_medians=tc_all)
            results.append(r)
            print("BENCH " + json.dumps(r), flush=True)
    if ME == 0:
        print(f"{'E':>4} {'ok':>3} {'dedup MB':>9} {'disp ms':>8} {'comb ms':>8} {'copy1 ms':>8} "
              f"{'copyR ms':>8} {'d/copy1':>7} {'c/copy1':>7} {'d/copyR':>7} {'c/copyR':>7}")
        for r in results:
            print(f"{r['E']:>4} {str(r['correct'])[0]:>3} {r['dedup_bytes'] / 1e6:>9.1f} "
                  f"{r['dispatch_s'] * 1e3:>8.3f} {r['combine_s'] * 1e3:>8.3f} "
                  f"{r['copy_solo_s'] * 1e3:>8.3f} {r['copy_all_s'] * 1e3:>8.3f} "
                  f"{r['dispatch_vs_solo']:>7.2f} {r['combine_vs_solo']:>7.2f} "
                  f"{r['dispatch_vs_all']:>7.2f} {r['combine_vs_all']:>7.2f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    barrier()
    jaxep.finalize()


if __name__ == "__main__":
    main()
