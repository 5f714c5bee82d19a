"""Flax NNX layers on jaxep's dispatch and combine (needs `flax`: `pip install jaxep[nn]`)."""
from jaxep.nn.moe import (MoE, MoEShardingConfig, load_balancing_loss, moe_local,
                          moe_local_decode, moe_reference, route)

__all__ = ["MoE", "MoEShardingConfig", "load_balancing_loss", "moe_local", "moe_local_decode",
           "moe_reference", "route"]
