"""Train a small MoE transformer language model with `jaxep.nn.MoE`, end to end.

The model: token + position embeddings, `--layers` blocks of (RMSNorm, causal self-attention,
RMSNorm, jaxep MoE FFN), a final norm and an LM head. The data is made here, nothing is downloaded:
sequences from three "languages" the model must tell apart from context (a type marker, then an
arithmetic progression mod V, a repeated random pattern, or a walk on a fixed sparse bigram graph).
Training uses optax AdamW. At the end the MoE layer of block 0 is checked against the dense
single-device computation of the same layer on real activations (`MoE.reference`). Then a short
greedy generation (`--generate_tokens`, default 8): a few sequences, one token per step, each step
through the attention KV cache and the MoE layers' decode path (`moe(x, decode=True)`: jaxep's
`mode="low_latency"`), with the first step's logits checked against the normal full-sequence path.

Commands:
    python examples/moe_flax.py             # CPU: 4 emulated devices, EP size 4, reference backend
    python examples/moe_flax.py --short     # what CI runs (< 2 minutes on 2 cores)
    python examples/moe_flax.py --ep 8 --steps 500
    python examples/moe_flax.py --generate_tokens 16   # longer generation (0: none)
    python examples/moe_flax.py --arch deepseek_v3     # the MoE block of DeepSeek-V3 (also: qwen3,
        # qwen2_moe, mixtral, gpt_oss) at tiny sizes: its routing, activation, biases, shared
        # experts and balance loss
    python examples/moe_flax.py --backend cuda --ep 1 --dtype bfloat16   # one GPU, CUDA custom calls
    python examples/moe_flax.py --compare_backends --dtype bfloat16      # one GPU, EP 1: the same
        # training with the CUDA backend, then with the reference backend, in this one process;
        # prints both tokens/s and their ratio

Emulated devices: on CPU, unless XLA_FLAGS already sets --xla_force_host_platform_device_count, this
script adds `--xla_force_host_platform_device_count=8` to XLA_FLAGS for its own process before jax is
imported, and prints that it did (it never does so with `--backend cuda` or JAX_PLATFORMS naming a
GPU). Set XLA_FLAGS yourself to choose another count.

With ep > 1 the only collectives besides jaxep's dispatch/combine are the data-parallel ones of the
sharded model (gradient all-reduce of the replicated weights, the loss mean); with ep = 1 there are
none.
"""
from __future__ import annotations

import os
import sys


def _emulate_cpu_devices(count: int = 8) -> None:
    """Adds the host device count flag to XLA_FLAGS (CPU runs only; the user's setting wins)."""
    flags = os.environ.get("XLA_FLAGS", "")
    gpu = any(a in ("--backend=cuda", "cuda") or a.startswith("--compare_backends")
              for a in sys.argv[1:]) or any(
        p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu", "rocm"))
    if gpu or "xla_force_host_platform_device_count" in flags:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()
    print(f"moe_flax: set XLA_FLAGS={os.environ['XLA_FLAGS']!r} for this process "
          "(CPU device emulation; set XLA_FLAGS yourself to override)", flush=True)


if __name__ == "__main__":
    _emulate_cpu_devices()

import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

try:  # flax, optax, absl-py and rich: the [nn] extra
    import optax  # noqa: E402
    from absl import app, flags  # noqa: E402
    from flax import nnx  # noqa: E402
    from rich import progress as rp  # noqa: E402
    from rich.console import Console  # noqa: E402
except ModuleNotFoundError as e:
    raise SystemExit(f"moe_flax: needs {e.name}: pip install -e '.[nn]'") from e

import jaxep  # noqa: E402
import jaxep.nn  # noqa: E402
from jaxep.nn import archs  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 500, "training steps", lower_bound=1)
_SHORT = flags.DEFINE_bool("short", False,
                           "a quick run (CI): at most 100 steps; the loss is reported, not enforced")
_BATCH = flags.DEFINE_integer("batch", 32, "sequences per step (divisible by --ep)", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq_len", 32, "tokens per sequence", lower_bound=4, upper_bound=4096)
_VOCAB = flags.DEFINE_integer("vocab", 64, "vocabulary size", lower_bound=16, upper_bound=65536)
_D = flags.DEFINE_integer("d_model", 64, "model width H", lower_bound=8)
_HEADS = flags.DEFINE_integer("heads", 4, "attention heads", lower_bound=1)
_LAYERS = flags.DEFINE_integer("layers", 2, "transformer blocks", lower_bound=1, upper_bound=64)
_ARCH = flags.DEFINE_enum("arch", "default", list(archs.ARCHS),
                          "the MoE block's design: jaxep.nn.MoE's defaults, or that model's "
                          "routing, activation, biases and shared experts (docs/nn.md's table)")
_E = flags.DEFINE_integer("experts", None, "experts per MoE layer (divisible by --ep; default 8, "
                          "16 with --arch deepseek_v3)", lower_bound=1)
_K = flags.DEFINE_integer("topk", None, "experts per token (default 2, 4 with --arch deepseek_v3 "
                          "or gpt_oss)", lower_bound=1)
_F = flags.DEFINE_integer("ffn", 128, "hidden width F of each expert", lower_bound=1)
_EP = flags.DEFINE_integer("ep", None, "EP size (default: 4, or 1 with --backend cuda)",
                           lower_bound=1, upper_bound=1024)
_BACKEND = flags.DEFINE_enum("backend", "auto", ["auto", "reference", "cuda"], "jaxep backend")
_COMPARE = flags.DEFINE_bool("compare_backends", False,
                             "train twice in this process, --backend cuda then --backend reference "
                             "(same flags, seed and device; --ep defaults to 1), and print both "
                             "tokens/s and their ratio")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute/payload dtype")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "receive capacity factor; 0 = never drop "
                         "(the layer's default: R * T * K receive rows per rank, ~3x slower here "
                         "on CPU)",
                         lower_bound=0.0)
_LB = flags.DEFINE_float("lb_weight", 1e-2, "weight of the load-balancing loss (with --arch "
                         "deepseek_v3 its sequence-wise balance loss)", lower_bound=0.0)
_LR = flags.DEFINE_float("lr", 3e-3, "peak learning rate", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "seed for data and parameters")
_GEN = flags.DEFINE_integer("generate_tokens", 8,
                            "after training, tokens to generate greedily, one per step through the "
                            "MoE decode path (low_latency mode); 0 = no generation", lower_bound=0)


# ----------------------------------------------------------------------------------------------
# Data: three synthetic "languages", generated deterministically from (seed, step).

def make_batch(rng: np.random.Generator, batch: int, length: int, vocab: int,
               bigram: np.ndarray) -> np.ndarray:
    """[batch, length] int32. Token 0..2 is the type marker; the rest uses ids 3..vocab-1."""
    n = vocab - 3
    kind = rng.integers(0, 3, batch)
    pos = np.arange(length - 1)
    start = rng.integers(0, n, (batch, 1))
    step = rng.integers(1, 6, (batch, 1))
    progression = (start + step * pos) % n                                   # kind 0
    period = rng.integers(2, 6, (batch, 1))
    pattern = rng.integers(0, n, (batch, 5))
    repeat = np.take_along_axis(pattern, pos % period, axis=1)                # kind 1
    walk = np.empty((batch, length - 1), np.int64)                            # kind 2
    walk[:, 0] = start[:, 0]
    choice = rng.random((batch, length - 1)) < 0.75
    for i in range(1, length - 1):
        walk[:, i] = np.where(choice[:, i], bigram[walk[:, i - 1], 0], bigram[walk[:, i - 1], 1])
    body = np.select([kind[:, None] == 0, kind[:, None] == 1], [progression, repeat], walk) + 3
    return np.concatenate([kind[:, None], body], axis=1).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Model.

def arch_settings() -> tuple[int, int, dict, float]:
    """(experts, topk, MoE kwargs, selection-bias rate) of --arch (`jaxep.nn.archs.ARCHS`, the
    same table `jaxep-bench --layer --arch` uses), --experts / --topk winning."""
    return archs.arch_settings(_ARCH.value, _F.value, _E.value, _K.value)


class Block(nnx.Module):
    """Pre-norm block: causal self-attention, then the jaxep MoE FFN."""

    def __init__(self, d: int, heads: int, moe_kw: dict, *, rngs: nnx.Rngs, dtype):
        self.norm1 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, qkv_features=d, decode=False, dtype=dtype,
                                           rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.moe = jaxep.nn.MoE(d, rngs=rngs, dtype=dtype, **moe_kw)

    def attend(self, h):
        mask = nnx.make_causal_mask(h[..., 0])
        return h + self.attn(self.norm1(h), mask=mask)

    def __call__(self, h):
        h = self.attend(h)
        y, aux = self.moe(self.norm2(h))
        return h + y, aux

    def decode(self, h):
        """One new position per sequence (h: [B, 1, d]): attention over the KV cache, then the MoE
        layer's decode path (jaxep low_latency mode)."""
        h = h + self.attn(self.norm1(h), decode=True)
        y, _ = self.moe(self.norm2(h), decode=True)
        return h + y


class MoELM(nnx.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, heads: int, layers: int, moe_kw: dict,
                 *, rngs: nnx.Rngs, dtype):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.pos = nnx.Embed(seq_len, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, moe_kw, rngs=rngs, dtype=dtype)
                                for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, dtype=dtype, rngs=rngs)

    def embed_tokens(self, tokens):
        return self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]

    def __call__(self, tokens):
        """(logits, mean balance loss (the sequence-wise one where the layer computes it), mean
        drop fraction, each block's expert counts)."""
        h = self.embed_tokens(tokens)
        lb, drop, counts = 0.0, 0.0, []
        for block in self.blocks:
            h, aux = block(h)
            balance = aux.get("sequence_balancing_loss", aux["load_balancing_loss"])
            lb, drop = lb + balance, drop + aux["drop_fraction"]
            counts.append(aux["expert_counts"])
        n = len(self.blocks)
        return self.head(self.norm(h)).astype(jnp.float32), lb / n, drop / n, counts

    def decode(self, tokens, pos):
        """Logits [B, 1, V] of the next token after `tokens` [B, 1] at position `pos` (a scalar),
        given the KV caches of the positions before it (`init_cache`)."""
        h = self.embed(tokens) + self.pos(pos)[None, None]
        for block in self.blocks:
            h = block.decode(h)
        return self.head(self.norm(h)).astype(jnp.float32)

    def init_cache(self, batch: int, length: int, dtype):
        for block in self.blocks:
            block.attn.init_cache((batch, length, block.attn.in_features), dtype)


@nnx.jit(static_argnames=("lb_weight", "bias_rate"))
def train_step(model, optimizer, tokens, lb_weight, bias_rate=0.0):
    def loss_fn(model):
        logits, lb, drop, counts = model(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + lb_weight * lb, (ce, lb, drop, counts)

    grads, (ce, lb, drop, counts) = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    if bias_rate:  # DeepSeek-V3's auxiliary-loss-free balancing: outside the gradient
        for block, c in zip(model.blocks, counts):
            block.moe.update_selection_bias(c, bias_rate)
    return ce, lb, drop


def to_host(a):
    """A NumPy copy of an array, also when it spans several processes."""
    if not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def place_on_mesh(obj, mesh):
    """Puts every array of `obj` on the mesh: its annotated spec (the experts), else replicated."""
    state = nnx.state(obj)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, P))
    nnx.update(obj, jax.device_put(state, shardings))


@nnx.jit
def moe_input_of_block0(model, tokens):
    """The activations that block 0's MoE layer sees."""
    b = model.blocks[0]
    return b.norm2(b.attend(model.embed_tokens(tokens)))


# ----------------------------------------------------------------------------------------------

class Progress:
    """The training progress: a rich progress bar on a terminal; in a pipe or a file (where a bar
    cannot redraw) one plain line every 10% of the steps instead."""

    def __init__(self, total: int):
        self.console = Console(highlight=False, markup=False)
        self.total, self.last = total, -1
        self.bar = rp.Progress(rp.TextColumn("train"), rp.BarColumn(), rp.MofNCompleteColumn(),
                               rp.TextColumn("{task.fields[stats]}"), rp.TimeRemainingColumn(),
                               console=self.console, disable=not self.console.is_terminal)
        self.task = self.bar.add_task("train", total=total, stats="compiling")

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def update(self, i: int, text: str):
        self.bar.update(self.task, completed=i, stats=text)
        if not self.console.is_terminal and (10 * i) // self.total != self.last:
            self.last = (10 * i) // self.total
            self.console.print(f"step {i:>5}/{self.total} {text}", soft_wrap=True)


def backend_choice(requested: str | None, ep: int) -> str:
    """'backend: NAME (why)': what jaxep.backends.choose decides for these ops, and the reason."""
    from jaxep import backends  # pylint: disable=g-import-not-at-top
    name, why = backends.choose("dispatch", requested, ep)
    return f"backend: {name} ({f'--backend {requested}' if requested else why})"


def run(steps: int, short: bool, backend_flag: str | None = None) -> dict:
    backend_flag = backend_flag or _BACKEND.value
    backend = None if backend_flag == "auto" else backend_flag
    ep = _EP.value or (1 if backend == "cuda" or _COMPARE.value else min(4, jax.device_count()))
    if ep > jax.device_count():
        raise app.UsageError(f"--ep={ep} needs {ep} devices, this process sees {jax.device_count()}"
                             " (on CPU: raise --xla_force_host_platform_device_count in XLA_FLAGS)")
    if _BATCH.value % ep:
        raise app.UsageError(f"--batch={_BATCH.value} must be divisible by --ep={ep}")
    prompt_len = _SEQ.value // 4  # generation: prompt + new tokens fit the position embedding
    if prompt_len + _GEN.value > _SEQ.value:
        raise app.UsageError(f"--generate_tokens={_GEN.value} must be <= seq_len - prompt = "
                             f"{_SEQ.value} - {prompt_len} = {_SEQ.value - prompt_len}")
    dtype = jnp.dtype(_DTYPE.value)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
    # Generation: a few sequences (a multiple of the EP size), so gen_batch / ep tokens per rank
    # per decode step; that is the decode config's max_tokens_per_rank (M = ep * it: no drops).
    gen_batch = ep * max(2, -(-4 // ep))
    experts, topk, arch_kw, bias_rate = arch_settings()
    decode_config = jaxep.Config(experts, topk, _D.value, gen_batch // ep,
                                 mode="low_latency", dtype=dtype.name)
    moe_kw = dict(ffn=_F.value, num_experts=experts, topk=topk, mesh=mesh, backend=backend,
                  capacity_factor=_CF.value or None, decode_config=decode_config, **arch_kw)
    model = MoELM(_VOCAB.value, _SEQ.value, _D.value, _HEADS.value, _LAYERS.value, moe_kw,
                  rngs=nnx.Rngs(_SEED.value), dtype=dtype)
    warmup = max(1, steps // 10)  # optax's cosine part needs at least one step after the warmup
    schedule = optax.warmup_cosine_decay_schedule(0.0, _LR.value, warmup, max(steps, warmup + 1),
                                                  _LR.value / 10)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
    place_on_mesh(model, mesh)  # so that step 2 does not recompile
    place_on_mesh(optimizer, mesh)

    tokens_sharding = NamedSharding(mesh, P("ep"))
    data_rng = np.random.default_rng(_SEED.value)
    bigram = data_rng.integers(0, _VOCAB.value - 3, (_VOCAB.value - 3, 2))

    def batch(step: int):
        rng = np.random.default_rng((_SEED.value, step))
        b = make_batch(rng, _BATCH.value, _SEQ.value + 1, _VOCAB.value, bigram)
        return jax.make_array_from_callback(b.shape, tokens_sharding, lambda i: b[i])

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    moe = model.blocks[0].moe
    tokens_per_rank = _BATCH.value * _SEQ.value // ep
    capacity = moe.ep_config(tokens_per_rank).capacity(ep)
    print(f"moe_flax: devices={jax.device_count()}x{jax.devices()[0].platform} ep={ep} "
          f"backend={backend or 'auto'} dtype={dtype.name} layers={_LAYERS.value} d={_D.value} "
          f"arch={_ARCH.value} experts={experts} topk={topk} ffn={_F.value} "
          f"batch={_BATCH.value}x{_SEQ.value} steps={steps} params={n_params}", flush=True)
    print(f"moe_flax: {backend_choice(backend, ep)}", flush=True)
    worst = ep * tokens_per_rank * topk
    print(f"moe_flax: MoE {', '.join(f'{k}={v}' for k, v in arch_kw.items()) or 'defaults'}; "
          f"capacity {capacity} receive rows per rank: "
          + (f"--capacity_factor={_CF.value} drops the rows past it (the layer's default, "
             f"--capacity_factor 0, is dropless: a budget of min(R * T * K = {worst}, "
             f"{moe.recv_budget_factor} * T * K) rows, rounds past it)"
             if _CF.value else f"dropless, rows past the budget in further rounds "
             f"(worst case R * T * K = {worst}; aux['rounds'] counts them)"),
          flush=True)

    with jax.set_mesh(mesh):
        result = _train_and_check(model, optimizer, batch, steps, dtype, bias_rate)
        result["generate_ok"] = True
        if _GEN.value:
            rng = np.random.default_rng((_SEED.value, 2**31 - 1))  # not a training step
            seqs = make_batch(rng, gen_batch, _SEQ.value, _VOCAB.value, bigram)
            result["generate_ok"] = generate(model, seqs, prompt_len, _GEN.value, mesh, dtype)
        return result


def _train(model, optimizer, batch, steps, bar, bias_rate):
    """The training loop; returns (losses, drop fractions, compile seconds, t0 after step 1)."""
    losses, drops, pending = [], [], []
    lb_name = "seq-lb" if model.blocks[0].moe.sequence_loss else "lb"  # the balance loss trained
    t_compile = time.perf_counter()
    t0 = None
    for step in range(1, steps + 1):
        pending.append(train_step(model, optimizer, batch(step), _LB.value, bias_rate))
        # Read the results back (a host sync) only every 10 steps, so the device runs ahead of the
        # Python loop and tokens/s measures the steps, not one host round trip per step.
        if step > 1 and step % 10 and step != steps:
            continue
        for ce, lb, drop in pending:
            losses.append(float(ce))
            drops.append(float(drop))
        lb, pending = float(pending[-1][1]), []
        if step == 1:
            t_compile, t0 = time.perf_counter() - t_compile, time.perf_counter()
        tok_s = (step - 1) * _BATCH.value * _SEQ.value / (time.perf_counter() - t0) if step > 1 else 0
        bar.update(step, f"loss {losses[-1]:.3f}  {lb_name} {lb:.3f}  drop {100 * drops[-1]:.1f}%  "
                         f"{tok_s / 1e3:.1f}k tok/s")
    return losses, drops, t_compile, t0


def _train_and_check(model, optimizer, batch, steps, dtype, bias_rate) -> dict:
    with Progress(steps) as bar:
        losses, drops, t_compile, t0 = _train(model, optimizer, batch, steps, bar, bias_rate)
    tok_s = (steps - 1) * _BATCH.value * _SEQ.value / (time.perf_counter() - t0) if steps > 1 else 0
    first, last = losses[0], float(np.mean(losses[-min(10, steps):]))
    print(f"loss: first {first:.4f}, last (mean of last {min(10, steps)} steps) {last:.4f}; "
          f"ln(vocab) = {math.log(_VOCAB.value):.4f}")
    print(f"throughput: {tok_s:.0f} tokens/s after the first step (first step incl. compile: "
          f"{t_compile:.1f}s); mean drop rate {100 * np.mean(drops):.2f}% of routed rows", flush=True)

    # The dense-equivalence check: block 0's MoE on the activations it sees, vs the dense layer.
    t_check = time.perf_counter()
    x = moe_input_of_block0(model, batch(steps + 1)[:, :-1])
    moe = model.blocks[0].moe
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, _ = moe.reference(x, slot_mask=aux["kept"])
    y_np, y_ref = np.asarray(to_host(y), np.float32), np.asarray(y_ref, np.float32)
    err = float(np.max(np.abs(y_np - y_ref)))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2 * max(1.0, float(np.max(np.abs(y_ref))))
    ok = bool(err <= tol)
    print(f"dense check (block 0 MoE vs single-device dense layer, {x.shape[0] * x.shape[1]} "
          f"tokens, {int(np.sum(aux['dropped_rows']))} rows dropped and masked alike): "
          f"max |diff| = {err:.3e}, tol {tol:.1e}: {'PASS' if ok else 'FAIL'} "
          f"({time.perf_counter() - t_check:.1f}s)", flush=True)
    return dict(first=first, last=last, tokens_per_s=tok_s, dense_ok=ok, dense_err=err)


def generate(model, seqs: np.ndarray, prompt_len: int, new_tokens: int, mesh, dtype) -> bool:
    """Greedy generation of `new_tokens` after the first `prompt_len` tokens (the prompt) of each
    sequence of `seqs` [B, S] (prompt_len + new_tokens <= S), one
    token per sequence per step through `MoELM.decode` (KV cache + the MoE decode path); the
    prompt goes in through the same step, one position at a time. Prints the generated ids, how
    many equal the sequence's true continuation, the time per step, and checks the logits of the
    first generated token against the normal path (`model(prompt)`, full causal attention, the
    MoE layers' normal mode without capacity drops, as the decode config never drops). Returns
    whether that check passed."""
    B = seqs.shape[0]
    sharding = NamedSharding(mesh, P("ep"))
    host_prompt = np.ascontiguousarray(seqs[:, :prompt_len])
    prompt = jax.make_array_from_callback(host_prompt.shape, sharding, lambda i: host_prompt[i])

    normal = nnx.clone(model)  # the normal path, without drops: same weights
    for block in normal.blocks:
        block.moe.capacity_factor = None
    ref = nnx.jit(lambda m, t: m(t)[0][:, -1])(normal, prompt)

    model.init_cache(B, prompt_len + new_tokens, dtype)
    place_on_mesh(model, mesh)
    step = nnx.jit(lambda m, tok, pos: m.decode(tok, pos)[:, 0])
    t_compile = time.perf_counter()
    for p in range(prompt_len):  # prefill through the decode step
        logits = step(model, prompt[:, p:p + 1], jnp.int32(p))
    first = np.asarray(to_host(logits))
    t_compile = time.perf_counter() - t_compile
    out, times = [], []
    for i in range(new_tokens):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        out.append(np.asarray(to_host(tok))[:, 0])
        if i == new_tokens - 1:
            break
        t = time.perf_counter()
        logits = step(model, tok, jnp.int32(prompt_len + i))
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
    gen = np.stack(out, axis=1)  # [B, new_tokens]

    ref = np.asarray(to_host(ref))
    err = float(np.max(np.abs(first - ref)))
    scale = max(1.0, float(np.max(np.abs(ref))))
    tol = (1e-4 if dtype == jnp.float32 else 5e-2) * scale
    ok = bool(err <= tol)
    truth = seqs[:, prompt_len:prompt_len + new_tokens]
    cfg = model.blocks[0].moe.decode_config
    print(f"generate: {B} sequences, prompt {prompt_len} tokens, {new_tokens} new tokens, one "
          f"token per sequence per step; MoE decode path mode={cfg.mode} "
          f"({cfg.max_tokens_per_rank} tokens per rank per step, M={cfg.expert_rows(mesh.size)} "
          f"rows per expert), backend={model.blocks[0].moe.decode_backend or 'auto'}")
    for b in range(B):
        print(f"  seq {b}: prompt {seqs[b, :prompt_len].tolist()} -> {gen[b].tolist()}")
    ms = 1e3 * np.asarray(times) if times else np.zeros(1)
    print(f"generate: {int(np.sum(gen == truth))}/{gen.size} tokens equal the true continuation; "
          f"per decode step {ms.mean():.2f} ms mean ({ms.min():.2f} min, {ms.max():.2f} max, "
          f"{len(times)} steps after compile; prefill and compile {t_compile:.1f}s)")
    print(f"generate check (first step's logits, decode path vs normal path over the prompt): "
          f"max |diff| = {err:.3e}, tol {tol:.1e}: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def quiet_backend_probe() -> None:
    """absl routes Python logging at INFO, so jax's backend probe prints "Unable to initialize
    backend 'tpu'" on every machine without a TPU (logger jax._src.xla_bridge, INFO). This
    application raises that one logger to WARNING before the backends start, unless the user asked
    for more (--verbosity, JAX_LOGGING_LEVEL); a backend that was asked for and fails still raises."""
    if flags.FLAGS["verbosity"].present or os.environ.get("JAX_LOGGING_LEVEL"):
        return
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_backend_probe()
    short = _SHORT.value
    steps = min(_STEPS.value, 100) if short else _STEPS.value
    if _COMPARE.value:
        results = {}
        for b in ("cuda", "reference"):
            print(f"moe_flax: --compare_backends: training with backend={b}", flush=True)
            results[b] = run(steps, short, b)
        c, ref = results["cuda"]["tokens_per_s"], results["reference"]["tokens_per_s"]
        print(f"moe_flax: compare (same process and device, {steps} steps each, run one after the "
              f"other): cuda {c:.0f} tokens/s, reference {ref:.0f} tokens/s, cuda/reference = "
              f"{c / ref if ref else float('nan'):.3f}; loss last cuda "
              f"{results['cuda']['last']:.4f} reference {results['reference']['last']:.4f}",
              flush=True)
    else:
        results = {_BACKEND.value: run(steps, short)}
    for b, r in results.items():
        if not r["dense_ok"]:
            raise SystemExit(f"moe_flax: FAILED ({b}): the MoE layer differs from its dense reference")
        if not r["generate_ok"]:
            raise SystemExit(f"moe_flax: FAILED ({b}): the decode path's logits differ from the "
                             "normal path's")
        fell = r["last"] < 0.75 * r["first"]
        if not fell:
            msg = (f"loss did not fall enough ({b}): checked that the last step's loss is below "
                   f"0.75x the first's over {steps} steps: first {r['first']:.4f}, last "
                   f"{r['last']:.4f} (needed < {0.75 * r['first']:.4f})")
            if not short:
                raise SystemExit("moe_flax: FAILED: " + msg + "; a run this short may not get "
                                 "there: use the default --steps, or --short for the short "
                                 "configuration (which only notes a loss that did not fall)")
            print("moe_flax: note (short mode): " + msg)
    print("moe_flax: OK")


if __name__ == "__main__":
    app.run(main)
