"""What one rank of `jaxep.nn.MoE` holds for a training step, estimated from the sizes: the worst
case's receive buffer (R * T * K rows, growing with the EP size R) against the dropless default's
budget (`recv_budget_factor`: min(R * T * K, ceil(m * T * K)) rows, rounds past it).

The model counts the arrays whose size is the receive rows C, the tokens T or the local experts'
weights, per rank, in bytes (b = the compute dtype's itemsize, p = the parameters'; H hidden, F
the expert width, L = E / R local experts; `experts.grouped_experts` computes gate and up in f32):
  - saved, per layer: what the backward keeps of a layer's expert matmuls, C x (H b + 8 F + F b):
    the received rows, gate and up (f32), the activation;
  - backward: one layer's temporaries at its peak, C x (H b + 4 H + 12 F): the rows' cotangent,
    their f32 gradient, and the f32 cotangents of the activation, gate and up;
  - round: with rounds possible (C below R * T * K), one more round's saved arrays while the
    rounds' backward takes its VJP (`jaxep.nn.rounds`): C x (H b + 8 F + F b);
  - stage: the CUDA backend's symmetric stage (NVSHMEM heap, outside XLA's pool), max(T, C) x H b;
  - tokens: x, y and their cotangents, 4 x T H b, and the layers' saved inputs, layers x T H b;
  - weights: layers x L x 3 H F x 2 p (the routed experts' weights and their gradients).
It leaves out the router, shared experts, optimizer state and XLA's scratch: a lower bound of
what a step needs, and the part that grows with R.
"""
from __future__ import annotations

import dataclasses

from jaxep import Config


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """recv_rows: C, the receive rows per rank; rounds: whether rows past C go in further rounds
    (C below the worst case); parts: bytes per rank by part (module docstring)."""
    recv_rows: int
    rounds: bool
    parts: dict

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def layer_memory(*, ep_size: int, tokens: int, hidden: int, ffn: int, num_experts: int,
                 topk: int, itemsize: int = 2, param_itemsize: int = 4,
                 recv_budget_factor: float | None = 2.0, layers: int = 1) -> LayerMemory:
    """Per-rank bytes of a training step of `layers` MoE layers (module docstring).

    recv_budget_factor: the layer's default, C = min(R * T * K, ceil(m * T * K)) rounded up to 8
      (`jaxep.Config(capacity_factor=m).capacity(R)`); None: the worst case, C = R * T * K.
    """
    cfg = Config(num_experts, topk, hidden, tokens, capacity_factor=recv_budget_factor)
    R, T, H, F, b = ep_size, tokens, hidden, ffn, itemsize
    C = cfg.capacity(R)
    saved = C * (H * b + 8 * F + F * b)
    parts = dict(saved=layers * saved,
                 backward=C * (H * b + 4 * H + 12 * F),
                 round=saved if C < cfg.no_drop_capacity(R) else 0,
                 stage=max(T, C) * H * b,
                 tokens=(4 + layers) * T * H * b,
                 weights=layers * cfg.local_experts(R) * 3 * H * F * 2 * param_itemsize)
    return LayerMemory(recv_rows=C, rounds=C < cfg.no_drop_capacity(R), parts=parts)


def deepseek_v3(ep_size: int, recv_budget_factor: float | None = 2.0) -> LayerMemory:
    """One DeepSeek-V3 MoE layer (T = 4096 tokens per rank, H = 7168, F = 2048, E = 256, K = 8,
    bf16 compute, f32 parameters) at `ep_size`."""
    return layer_memory(ep_size=ep_size, tokens=4096, hidden=7168, ffn=2048, num_experts=256,
                        topk=8, recv_budget_factor=recv_budget_factor)
