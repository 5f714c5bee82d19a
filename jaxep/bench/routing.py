"""Synthetic routing and inputs, deterministic from a seed so every process can rebuild every rank's.

Distributions (per token, K distinct experts, sampled without replacement):
- uniform: every expert equally likely (DeepEP's test routing for <= 4 nodes).
- zipf: expert popularity ~ 1 / rank^alpha over a seeded random order of experts.
- imbalanced: the experts of destination rank 0 are `imbalance` times as likely as the others
  (one hot rank, the usual cause of a slow dispatch).
Weights: a softmax over K random scores (positive, each token's weights sum to 1).
"""
from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("uniform", "zipf", "imbalanced")


def expert_probabilities(kind: str, num_experts: int, ep_size: int, *, seed: int = 0,
                         zipf_alpha: float = 1.0, imbalance: float = 4.0) -> np.ndarray:
    if kind == "uniform":
        p = np.ones(num_experts)
    elif kind == "zipf":
        p = np.empty(num_experts)
        p[np.random.default_rng([seed, 1]).permutation(num_experts)] = (
            1.0 / np.arange(1, num_experts + 1) ** zipf_alpha)
    elif kind == "imbalanced":
        p = np.ones(num_experts)
        p[: num_experts // ep_size] = imbalance
    else:
        raise ValueError(f"routing: kind must be one of {DISTRIBUTIONS}, got {kind!r}")
    return p / p.sum()


def topk_ids(kind: str, ep_size: int, tokens: int, topk: int, num_experts: int, *, seed: int = 0,
             zipf_alpha: float = 1.0, imbalance: float = 4.0) -> np.ndarray:
    """[R, T, K] int32 expert ids for every rank (Gumbel top-k: sampling without replacement)."""
    logp = np.log(expert_probabilities(kind, num_experts, ep_size, seed=seed, zipf_alpha=zipf_alpha,
                                       imbalance=imbalance)).astype(np.float32)
    out = np.empty((ep_size, tokens, topk), np.int32)
    for r in range(ep_size):  # per rank keeps memory at T*E floats
        g = np.random.default_rng([seed, 2, r]).gumbel(size=(tokens, num_experts)).astype(np.float32)
        out[r] = np.argpartition(-(logp + g), topk - 1, axis=1)[:, :topk]
    return out


def topk_weights(ep_size: int, tokens: int, topk: int, *, seed: int = 0) -> np.ndarray:
    """[R, T, K] float32 routing weights (softmax of random scores)."""
    s = np.random.default_rng([seed, 3]).standard_normal((ep_size, tokens, topk)).astype(np.float32)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def tokens_for_rank(rank: int, tokens: int, hidden: int, dtype, *, seed: int = 0) -> np.ndarray:
    """[T, H] payload of one rank: standard normal (never zeros), cast to `dtype`."""
    x = np.random.default_rng([seed, 4, rank]).standard_normal((tokens, hidden), dtype=np.float32)
    return x.astype(dtype)
