"""Published models' MoE blocks as `jaxep.nn.MoE` arguments (docs/nn.md's table), in one place for
`examples/moe_flax.py --arch` and `jaxep-bench --layer --arch`.

`ARCHS[name]`: "experts" / "topk" (the tiny sizes the example trains at), "moe" (keyword arguments
of `jaxep.nn.MoE`; the value "ffn" stands for the expert width, so shared experts are one expert
wide) and "selection_bias_rate" (DeepSeek-V3's balancing update per step; 0: none).
"""
from __future__ import annotations

ARCHS = {
    "default": dict(experts=8, topk=2, moe=dict(), selection_bias_rate=0.0),
    "deepseek_v3": dict(experts=16, topk=4, selection_bias_rate=1e-3, moe=dict(
        score_fn="sigmoid", selection_bias=True, num_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, shared_ffn="ffn", sequence_loss=True)),
    "qwen3": dict(experts=8, topk=2, selection_bias_rate=0.0, moe=dict(score_fn="softmax",
                                                                       renormalize=True)),
    "qwen2_moe": dict(experts=8, topk=2, selection_bias_rate=0.0, moe=dict(
        score_fn="softmax", renormalize=False, shared_ffn="ffn", shared_gate=True)),
    "mixtral": dict(experts=8, topk=2, selection_bias_rate=0.0,
                    moe=dict(score_fn="softmax_after_topk")),
    "gpt_oss": dict(experts=8, topk=4, selection_bias_rate=0.0, moe=dict(
        score_fn="softmax_after_topk", router_bias=True, expert_bias=True, activation="gpt_oss")),
}


def arch_settings(arch: str, ffn: int, experts: int | None = None,
                  topk: int | None = None) -> tuple[int, int, dict, float]:
    """(experts, topk, MoE kwargs, selection-bias rate) of `arch` with expert width `ffn`; the
    given experts / topk win over the arch's. ValueError for an unknown arch."""
    if arch not in ARCHS:
        raise ValueError(f"jaxep.nn.archs: arch must be one of {tuple(ARCHS)}, got {arch!r}")
    a = ARCHS[arch]
    kw = {k: (ffn if v == "ffn" else v) for k, v in a["moe"].items()}
    return experts or a["experts"], topk or a["topk"], kw, a["selection_bias_rate"]
