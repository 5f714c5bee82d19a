"""Where the MoE layer's arrays live on the mesh (`MoEShardingConfig`), and the specs derived.

Every parameter is annotated with a full-rank PartitionSpec (one entry per dim), so that
`nnx.vmap` / `nnx.scan` with `transform_metadata` can insert and remove the stacked dim.

Inside the layer's `shard_map` each device sees:
  - tokens: its shard of the flattened activations [N, H] (dim 0 on the token axes);
  - expert weights: its L = E / R experts (dim 0 on the EP axis) and its slice of F (the tensor
    axes); the H dim, on the FSDP axes in storage, is gathered when entering the `shard_map`;
  - router, router_bias, selection_bias: whole (gathered when entering if stored sharded).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P


def _axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    """The PartitionSpec entry of a tuple of mesh axes."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _full(spec: P, rank: int, name: str) -> P:
    """`spec` padded with None to `rank` entries; ValueError if it has more."""
    if len(spec) > rank:
        raise ValueError(f"MoEShardingConfig: {name} must have at most {rank} entries (one per "
                         f"dim), got {spec}")
    return P(*(tuple(spec) + (None,) * (rank - len(spec))))


@dataclasses.dataclass(frozen=True)
class MoEShardingConfig:
    """How the MoE layer's arrays are laid out on the mesh (frozen; hashable).

    Args:
      axis_name: the EP mesh axis: jaxep's dispatch and combine run over it.
      tokens: spec of the flattened activations [N, H]. Dim 0 must include `axis_name`; it may name
        more axes (e.g. `P(("data", "ep"))`: EP groups along "ep", one per "data" slice); the hidden
        dim is replicated. Default `P(axis_name)`.
      router: spec of the router kernel [H, E] (router_bias and selection_bias [E] follow its E
        entry). Any axes: the layer gathers it. Default `P(None, None)` (replicated).
      experts: spec of w_gate / w_up [E, H, F]: `P(axis_name, fsdp, tensor)` with fsdp / tensor a
        mesh axis, a tuple of axes or None. w_down [E, F, H] is stored as `P(axis_name, tensor,
        fsdp)`, b_gate / b_up [E, F] as `P(axis_name, tensor)`, b_down [E, H] as `P(axis_name,
        fsdp)`, the shared experts' [H, Fs] / [Fs, H] as `P(fsdp, tensor)` / `P(tensor, fsdp)`
        and their gate [H, 1] as `P(fsdp, None)`.
        The FSDP axes are gathered in the layer; the tensor axes split F (the down projection's
        partials are summed over them), so they must not shard the tokens. Default
        `P(axis_name, None, None)`.
    """

    axis_name: str = "ep"
    tokens: P | None = None
    router: P | None = None
    experts: P | None = None

    def __post_init__(self):
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"MoEShardingConfig: axis_name must be a non-empty str, got "
                            f"{self.axis_name!r}")
        defaults = dict(tokens=P(self.axis_name, None), router=P(None, None),
                        experts=P(self.axis_name, None, None))
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is None:
                value = default
            if not isinstance(value, P):
                raise TypeError(f"MoEShardingConfig: {name} must be a PartitionSpec, got {value!r}")
            object.__setattr__(self, name, _full(value, len(default), name))
        self._check()

    def _check(self) -> None:
        if self.axis_name not in self.token_axes:
            raise ValueError(f"MoEShardingConfig: tokens dim 0 must include the EP axis "
                             f"{self.axis_name!r}, got tokens={self.tokens}")
        if self.tokens[1] is not None:
            raise ValueError(f"MoEShardingConfig: the hidden dim of tokens must be replicated: "
                             f"expected tokens=P(<token axes>, None), got tokens={self.tokens}")
        if _axes(self.experts[0]) != (self.axis_name,):
            raise ValueError(f"MoEShardingConfig: experts dim 0 must be the EP axis alone: "
                             f"expected P({self.axis_name!r}, fsdp, tensor), got {self.experts}")
        if self.axis_name in self.fsdp_axes + self.tensor_axes:
            raise ValueError(f"MoEShardingConfig: the EP axis {self.axis_name!r} may shard only "
                             f"dim 0 of experts: expected it outside dims 1 and 2, got "
                             f"experts={self.experts}")
        clash = set(self.tensor_axes) & set(self.token_axes)
        if clash:
            raise ValueError(f"MoEShardingConfig: the tensor axes of experts (dim 2, F) must not "
                             f"shard the tokens (the down projection's partials are summed over "
                             f"them): expected axes outside tokens dim 0 {self.token_axes}, got "
                             f"experts={self.experts} (both use {sorted(clash)})")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that dim 0 of the tokens is sharded over."""
        return _axes(self.tokens[0])

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """Mesh axes the H dim of the expert weights is stored on (gathered in the layer)."""
        return _axes(self.experts[1])

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        """Mesh axes the F dim of the expert weights is split over."""
        return _axes(self.experts[2])

    def storage_specs(self) -> dict[str, P]:
        """The full-rank spec each parameter is stored with (annotated on its nnx.Param)."""
        ep, fs, tp = self.axis_name, self.experts[1], self.experts[2]
        return dict(router=self.router, router_bias=P(self.router[1]),
                    selection_bias=P(self.router[1]), w_gate=P(ep, fs, tp), w_up=P(ep, fs, tp),
                    w_down=P(ep, tp, fs), b_gate=P(ep, tp), b_up=P(ep, tp), b_down=P(ep, fs),
                    shared_w_gate=P(fs, tp), shared_w_up=P(fs, tp), shared_w_down=P(tp, fs),
                    shared_gate=P(fs, None))

    def compute_specs(self) -> dict[str, P]:
        """The spec each parameter enters the layer's `shard_map` with: storage without the FSDP
        axes and the router's axes (those dims arrive whole)."""
        ep, tp = self.axis_name, self.experts[2]
        return dict(router=P(None, None), router_bias=P(None), selection_bias=P(None),
                    w_gate=P(ep, None, tp), w_up=P(ep, None, tp), w_down=P(ep, tp, None),
                    b_gate=P(ep, tp), b_up=P(ep, tp), b_down=P(ep, None),
                    shared_w_gate=P(None, tp), shared_w_up=P(None, tp),
                    shared_w_down=P(tp, None), shared_gate=P(None, None))

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis this config names."""
        names = [*self.token_axes, *_axes(self.router[0]), *_axes(self.router[1]),
                 *self.fsdp_axes, *self.tensor_axes, self.axis_name]
        return tuple(dict.fromkeys(names))

    def check_mesh(self, mesh_shape: dict[str, int], sizes: dict[str, int]) -> None:
        """ValueError unless every named axis is in the mesh and every sharded dim divides evenly.
        sizes: "hidden", "ffn", "num_experts" and, when the layer has shared experts,
        "shared_ffn"."""
        for a in self.mesh_axes():
            if a not in mesh_shape:
                raise ValueError(f"jaxep.nn.MoE: mesh axis {a!r} of the sharding config is not in "
                                 f"the mesh, whose axes are {tuple(mesh_shape)}")
        dims = [("hidden", self.fsdp_axes, "experts dim 1 (FSDP)"),
                ("ffn", self.tensor_axes, "experts dim 2 (tensor)"),
                ("shared_ffn", self.tensor_axes, "experts dim 2 (tensor)"),
                ("hidden", _axes(self.router[0]), "router dim 0"),
                ("num_experts", _axes(self.router[1]), "router dim 1")]
        for size_name, axes, where in dims:
            n = 1
            for a in axes:
                n *= mesh_shape[a]
            if size_name in sizes and sizes[size_name] % n:
                raise ValueError(f"jaxep.nn.MoE: {size_name} must be divisible by the {n} devices "
                                 f"of {where} on {axes}: expected {size_name} % {n} == 0, got "
                                 f"{size_name}={sizes[size_name]}")

    def stat_spec(self) -> P:
        """The spec of per-token-shard statistics (a leading dim over the token shards)."""
        return P(_entry(self.token_axes))
