"""Flax NNX layers on jaxep's dispatch and combine (needs `flax`: `pip install jaxep[nn]`)."""
from jaxep.nn.experts import ACTIVATIONS, GatedMLP, gpt_oss_glu, silu_glu
from jaxep.nn.local import moe_local, moe_local_decode
from jaxep.nn.moe import PARAM_NAMES, MoE, SelectionBias
from jaxep.nn.reference import moe_reference
from jaxep.nn.routing import (SCORE_FNS, Routed, Routing, load_balancing_loss, route,
                              route_full, route_given, router_z_loss, sequence_balancing_loss,
                              token_slots, update_selection_bias)
from jaxep.nn.sharding import MoEShardingConfig

__all__ = ["ACTIVATIONS", "GatedMLP", "MoE", "MoEShardingConfig", "PARAM_NAMES", "Routed",
           "Routing", "SCORE_FNS", "SelectionBias", "gpt_oss_glu", "load_balancing_loss",
           "moe_local", "moe_local_decode", "moe_reference", "route", "route_full", "route_given",
           "router_z_loss", "sequence_balancing_loss", "silu_glu", "token_slots",
           "update_selection_bias"]
