"""Flax NNX layers on jaxep's dispatch and combine (needs `flax`: `pip install jaxep[nn]`)."""
from jaxep.nn.experts import ACTIVATIONS, GatedMLP, gpt_oss_glu, silu_glu
from jaxep.nn.hf import moe_kwargs
from jaxep.nn.hf_weights import load_hf_weights, save_hf_weights
from jaxep.nn.local import moe_local, moe_local_decode
from jaxep.nn.phases import PHASES
from jaxep.nn.moe import PARAM_NAMES, MoE, SelectionBias
from jaxep.nn.plain import moe_local_plain
from jaxep.nn.reference import moe_reference
from jaxep.nn.routing import (SCORE_FNS, Routed, Routing, load_balancing_loss, route,
                              route_full, route_given, router_z_loss, sequence_balancing_loss,
                              token_slots, update_selection_bias)
from jaxep.nn.sharding import MoEShardingConfig

__all__ = ["ACTIVATIONS", "GatedMLP", "MoE", "MoEShardingConfig", "PARAM_NAMES", "PHASES",
           "Routed", "Routing", "SCORE_FNS", "SelectionBias", "gpt_oss_glu",
           "load_balancing_loss", "load_hf_weights", "moe_kwargs", "moe_local",
           "moe_local_decode", "moe_local_plain", "moe_reference", "route", "route_full",
           "route_given", "router_z_loss", "save_hf_weights", "sequence_balancing_loss",
           "silu_glu", "token_slots", "update_selection_bias"]
