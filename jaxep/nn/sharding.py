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
import math
import warnings
from typing import Any

from jax.sharding import PartitionSpec as P

_WARNED: set = set()  # (config, mesh shape) pairs whose replicated-tokens warning was given


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


def _check_axis_name(axis_name: Any) -> tuple[str, ...]:
    """The EP axes of `axis_name` (a mesh axis name or a non-empty tuple of distinct names)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if (not names or len(set(names)) != len(names)
            or not all(isinstance(a, str) and a for a in names)):
        raise TypeError(f"MoEShardingConfig: axis_name must be a non-empty str or a non-empty "
                        f"tuple of distinct non-empty str (mesh axes), got {axis_name!r}")
    return names


@dataclasses.dataclass(frozen=True)
class MoEShardingConfig:
    """How the MoE layer's arrays are laid out on the mesh (frozen; hashable).

    Args:
      axis_name: the EP mesh axis, or a tuple of mesh axes whose product is the EP group (e.g.
        `("context", "expert")`; ranks are numbered over the tuple row-major, the order jax uses
        for collectives over those axes): jaxep's dispatch and combine run over it.
      tokens: spec of the flattened activations [N, H]. Dim 0 must include every EP axis; it may
        name more axes (e.g. `P(("data", "ep"))`: EP groups along "ep", one per "data" slice); the
        hidden dim is replicated. Default (None): every mesh axis of the layer's mesh but the
        tensor axes, in the mesh's order (`for_mesh`); a layer whose tokens are replicated over
        a mesh axis of more than one device other than the tensor axes warns once.
      router: spec of the router kernel [H, E] (router_bias and selection_bias [E] follow its E
        entry). Any axes: the layer gathers it. Default `P(None, None)` (replicated).
      experts: spec of w_gate / w_up [E, H, F]: `P(axis_name, fsdp, tensor)` with fsdp / tensor a
        mesh axis, a tuple of axes or None. w_down [E, F, H] is stored as `P(axis_name, tensor,
        fsdp)`, b_gate / b_up [E, F] as `P(axis_name, tensor)`, b_down [E, H] as `P(axis_name,
        fsdp)`, the shared experts' [H, Fs] / [Fs, H] as `P(fsdp, tensor)` / `P(tensor, fsdp)`
        and their gate [H, 1] as `P(fsdp, None)`; an expert function's own arrays [E, ...] as
        `P(axis_name)`.
        The FSDP axes are gathered in the layer; the tensor axes split F (the down projection's
        partials are summed over them), so they must not shard the tokens. Default
        `P(axis_name, None, None)`.
    """

    axis_name: str | tuple[str, ...] = "ep"
    tokens: P | None = None
    router: P | None = None
    experts: P | None = None

    def __post_init__(self):
        if isinstance(self.axis_name, list):
            object.__setattr__(self, "axis_name", tuple(self.axis_name))
        ep = _entry(_check_axis_name(self.axis_name))
        defaults = dict(tokens=P(ep, None), router=P(None, None), experts=P(ep, None, None))
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is None:
                if name == "tokens":  # resolved against the mesh by `for_mesh`
                    continue
                value = default
            if not isinstance(value, P):
                raise TypeError(f"MoEShardingConfig: {name} must be a PartitionSpec, got {value!r}")
            object.__setattr__(self, name, _full(value, len(default), name))
        self._check()

    @property
    def ep_axes(self) -> tuple[str, ...]:
        """The mesh axes of the EP group, in rank order."""
        return _check_axis_name(self.axis_name)

    def for_mesh(self, mesh_shape: dict[str, int]) -> "MoEShardingConfig":
        """This config with its default tokens spec resolved on a mesh of `mesh_shape` (axis ->
        size, in the mesh's order): tokens over every mesh axis but the tensor axes. Warns
        (once per config and mesh shape) when the tokens are replicated over a mesh axis of more
        than one device that is not a tensor axis: those devices compute the same tokens."""
        out = self
        if self.tokens is None:
            axes = tuple(a for a in mesh_shape if a not in self.tensor_axes)
            out = dataclasses.replace(self, tokens=P(_entry(axes), None))
        idle = [a for a, n in mesh_shape.items()
                if n > 1 and a not in out.token_axes and a not in out.tensor_axes]
        key = (out, tuple(mesh_shape.items()))
        if idle and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"jaxep.nn.MoE: tokens=P({out.tokens[0]!r}) replicates the tokens over "
                          f"mesh axes {idle} (sizes {[mesh_shape[a] for a in idle]}): those "
                          f"devices compute the same tokens. Name them in tokens dim 0 (or leave "
                          f"tokens=None: every axis but the tensor axes)", stacklevel=3)
        return out

    def ep_size(self, mesh_shape: dict[str, int]) -> int:
        """The EP size R on a mesh: the product of the EP axes' sizes."""
        return math.prod(mesh_shape[a] for a in self.ep_axes)

    def _check(self) -> None:
        ep = self.ep_axes
        missing = [a for a in ep if a not in self.token_axes]
        if missing:
            raise ValueError(f"MoEShardingConfig: tokens dim 0 must include the EP axes {ep}, "
                             f"got tokens={self.tokens} (without {missing})")
        if self.tokens is not None and self.tokens[1] is not None:
            raise ValueError(f"MoEShardingConfig: the hidden dim of tokens must be replicated: "
                             f"expected tokens=P(<token axes>, None), got tokens={self.tokens}")
        if _axes(self.experts[0]) != ep:
            raise ValueError(f"MoEShardingConfig: experts dim 0 must be the EP axis alone "
                             f"(axis_name, one axis or a tuple of them): expected "
                             f"P({_entry(ep)!r}, fsdp, tensor), got {self.experts}")
        inner = set(ep) & set(self.fsdp_axes + self.tensor_axes)
        if inner:
            raise ValueError(f"MoEShardingConfig: the EP axes {ep} may shard only dim 0 of "
                             f"experts: expected them outside dims 1 and 2, got "
                             f"experts={self.experts} (both use {sorted(inner)})")
        clash = set(self.tensor_axes) & set(self.token_axes if self.tokens is not None else ())
        if clash:
            raise ValueError(f"MoEShardingConfig: the tensor axes of experts (dim 2, F) must not "
                             f"shard the tokens (the down projection's partials are summed over "
                             f"them): expected axes outside tokens dim 0 {self.token_axes}, got "
                             f"experts={self.experts} (both use {sorted(clash)})")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that dim 0 of the tokens is sharded over (before `for_mesh` resolves a
        default tokens spec: the EP axes)."""
        return self.ep_axes if self.tokens is None else _axes(self.tokens[0])

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
        ep, fs, tp = _entry(self.ep_axes), self.experts[1], self.experts[2]
        return dict(router=self.router, router_bias=P(self.router[1]),
                    selection_bias=P(self.router[1]), w_gate=P(ep, fs, tp), w_up=P(ep, fs, tp),
                    w_down=P(ep, tp, fs), b_gate=P(ep, tp), b_up=P(ep, tp), b_down=P(ep, fs),
                    shared_w_gate=P(fs, tp), shared_w_up=P(fs, tp), shared_w_down=P(tp, fs),
                    shared_gate=P(fs, None))

    def compute_specs(self) -> dict[str, P]:
        """The spec each parameter enters the layer's `shard_map` with: storage without the FSDP
        axes and the router's axes (those dims arrive whole)."""
        ep, tp = _entry(self.ep_axes), self.experts[2]
        return dict(router=P(None, None), router_bias=P(None), selection_bias=P(None),
                    w_gate=P(ep, None, tp), w_up=P(ep, None, tp), w_down=P(ep, tp, None),
                    b_gate=P(ep, tp), b_up=P(ep, tp), b_down=P(ep, None),
                    shared_w_gate=P(None, tp), shared_w_up=P(None, tp),
                    shared_w_down=P(tp, None), shared_gate=P(None, None))

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis this config names."""
        names = [*self.token_axes, *_axes(self.router[0]), *_axes(self.router[1]),
                 *self.fsdp_axes, *self.tensor_axes, *self.ep_axes]
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

    def expert_param_spec(self, rank: int) -> P:
        """The full-rank spec of an expert function's own array [E, ...] (dim 0 on the EP axes)."""
        return P(_entry(self.ep_axes), *([None] * (rank - 1)))

    def stat_spec(self) -> P:
        """The spec of per-token-shard statistics (a leading dim over the token shards)."""
        return P(_entry(self.token_axes))
