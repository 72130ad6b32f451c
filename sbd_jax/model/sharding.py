"""Device mesh, the logical-axis rules table, and shardings for params, optimizer state and batches.

Model code never names mesh axes. Parameters get logical axis names from their path (the weights'
table, `sbd_jax.model.params`); `LOGICAL_RULES` maps logical names to mesh axes. A dimension a mesh axis does not divide is
replicated instead, so small models still run on big meshes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sbd_jax.errors import UserError
from sbd_jax.model.params import WEIGHTS

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (None = replicated)
LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "norm": None,
    "rank": None,  # an adapter's low rank: small, replicated
}


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh; one size may be -1 to take all remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(MESH_AXES):
        raise UserError(f"mesh shape {tuple(shape)} must have {len(MESH_AXES)} sizes: {', '.join(MESH_AXES)}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise UserError(f"mesh shape {tuple(shape)}: sizes must be >= 1, with at most one -1 (fill)")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise UserError(f"mesh shape {tuple(shape)} does not divide the {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise UserError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, but there are "
                        f"{len(devices)}; use sizes whose product is {len(devices)} (or -1 to fill)")
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
    """Logical axis names of the param at `path` (a leading stacked-layers axis included)."""
    stacked = "layers" in path
    base = ndim - int(stacked)
    module, leaf = (("",) + tuple(path))[-2:]
    if module.endswith("_lora") and module[:-len("_lora")] in WEIGHTS:  # A [in, rank], B [rank, out]
        into, out = WEIGHTS[module[:-len("_lora")]]
        names: tuple[str | None, ...] = (into, "rank") if leaf == "a" else ("rank", out)
    elif leaf in ("kernel", "embedding") and module in WEIGHTS:
        names = tuple(WEIGHTS[module])
    elif leaf == "bias" and module in WEIGHTS:
        names = (WEIGHTS[module].outputs,)
    else:
        names = ("norm",) * base
    assert len(names) == base, (path, ndim)
    return (("layers",) if stacked else ()) + names


def logical_spec(shape: tuple[int, ...], names: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axis names; a dimension its mesh axes do not
    divide is replicated."""
    axes = []
    for size, name in zip(shape, names):
        mesh_axes = LOGICAL_RULES.get(name) if name else None
        group = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        ways = math.prod(mesh.shape[a] for a in group)
        axes.append(mesh_axes if group and size % ways == 0 else None)
    return PartitionSpec(*axes)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for a param tree (arrays or ShapeDtypeStructs), following the rules table."""
    def one(path, leaf):
        keys = tuple(getattr(p, "key", getattr(p, "name", str(p))) for p in path)
        return NamedSharding(mesh, logical_spec(leaf.shape, logical_axes(keys, len(leaf.shape)), mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over data and fsdp; the sequence replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
