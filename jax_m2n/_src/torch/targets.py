"""What a torch rank holds, described without JAX, resolved against a published manifest.

Owns the placements (`Shard(dim)`, `Replicate()`, `Slice(offsets, sizes)` over the
generator's ranks), the name mapping's answer (`Into`: the torch name a trainer leaf
goes into, transposed or as one part of a fused tensor), and `resolve`: per target its
parts (leaf, this rank's box of the leaf, where that box lands in the local tensor),
with every check (a missing or extra name, a shape or dtype mismatch) made before any
byte moves. Knows no sockets, plans or copies.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import torch

from jax_m2n._src import schedule
from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.layout import Box

# torch dtypes and the numpy dtypes the manifest names (the ones both sides share).
TORCH_OF = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
            np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float64): torch.float64,
            np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
            np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32,
            np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
            np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
            np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}
NUMPY_OF = {t: n for n, t in TORCH_OF.items()}


@dataclasses.dataclass(frozen=True)
class Shard:
  """This tensor is split evenly along `dim` over the generator's ranks (rank r holds
  the r-th of `world_size` equal slices), as vLLM's column / row parallel layers."""
  dim: int


@dataclasses.dataclass(frozen=True)
class Replicate:
  """Every rank holds the whole tensor."""


@dataclasses.dataclass(frozen=True)
class Slice:
  """This rank holds the box starting at `offsets` of extent `sizes` (global indices of
  the target's shape)."""
  offsets: tuple[int, ...]
  sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Into:
  """Where a published leaf goes: the torch name, and how.

  Attributes:
    name: the torch parameter's name.
    part, parts, dim: the leaf is part `part` of `parts` concatenated along `dim` into
      that tensor (q/k/v into qkv: parts=3; gate/up: parts=2). Under `Shard(dim)` of
      the same dim each part is split over the ranks and a rank's slices are
      concatenated (vLLM's QKVParallelLinear, MergedColumnParallelLinear).
    transpose: the leaf (2-D) is transposed first (a JAX (in, out) kernel into a torch
      (out, in) weight).
  """
  name: str
  part: int = 0
  parts: int = 1
  dim: int = 0
  transpose: bool = False


@dataclasses.dataclass(frozen=True)
class Part:
  """One leaf's share of one target on this rank."""
  leaf: int
  box: Box                 # this rank's box of the leaf (the leaf's own coordinates)
  at: tuple[int, ...]      # where the box's first element lands in the local tensor
  transpose: bool


@dataclasses.dataclass(frozen=True)
class Target:
  """One torch tensor this rank receives."""
  name: str
  shape: tuple[int, ...]   # the local tensor's shape
  dtype: torch.dtype
  parts: tuple[Part, ...]


def dotted(path: tuple[str, ...]) -> str:
  """A manifest key path as a dotted name: ("['layers']", "[0]", "['w']") ->
  "layers.0.w" (what `names` receives)."""
  return ".".join(re.sub(r"^\.|^\[['\"]?|['\"]?\]$", "", k) for k in path)


def _as_into(api: str, got: Any, path: str) -> Into | None:
  if got is None or isinstance(got, Into):
    return got
  if isinstance(got, str):
    return Into(got)
  raise ReshardTypeError(f"{api}: names must return a str, an Into or None; got "
                         f"{type(got).__name__} for leaf {path!r}.")


def _rank_box(api: str, name: str, shape: tuple[int, ...], placement: Any, rank: int,
              world: int, dim_of_part: int | None) -> Box:
  """This rank's box of a tensor of `shape` under `placement`."""
  if isinstance(placement, Replicate):
    return tuple((0, s) for s in shape)
  if isinstance(placement, Shard):
    d = placement.dim
    if not -len(shape) <= d < len(shape):
      raise ReshardValueError(f"{api}: Shard(dim) must name a dim of {name!r} (shape "
                              f"{shape}); got dim={d}.")
    d %= len(shape)
    if shape[d] % world:
      raise ReshardValueError(f"{api}: Shard({d}) of {name!r} must split dim {d} "
                              f"(size {shape[d]}) evenly over {world} ranks; it does not.")
    n = shape[d] // world
    return tuple((rank * n, rank * n + n) if i == d else (0, s)
                 for i, s in enumerate(shape))
  if isinstance(placement, Slice):
    if dim_of_part is not None:
      raise ReshardValueError(f"{api}: Slice placements must not be used on fused "
                              f"tensors; got one for {name!r}.")
    offs, sizes = tuple(placement.offsets), tuple(placement.sizes)
    if len(offs) != len(shape) or len(sizes) != len(shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, sizes, shape)):
      raise ReshardValueError(f"{api}: Slice of {name!r} must lie inside its shape "
                              f"{shape}; got offsets {offs}, sizes {sizes}.")
    return tuple((o, o + n) for o, n in zip(offs, sizes))
  raise ReshardTypeError(f"{api}: a placement must be Shard(dim), Replicate() or "
                         f"Slice(offsets, sizes); got {type(placement).__name__} for "
                         f"{name!r}.")


def check_dtypes(api: str, name: str, published: np.dtype, want: torch.dtype) -> None:
  """A conversion the torch side makes bitwise as `x.astype(dtype)`: none, or one
  between float32, float16, bfloat16 and the float8s (rounded to nearest even on
  either path)."""
  if want not in NUMPY_OF:
    raise ReshardTypeError(f"{api}: the dtype of {name!r} must be one of "
                           f"{sorted(str(t) for t in NUMPY_OF)}; got {want}.")
  out = NUMPY_OF[want]
  if out != published and not schedule.fused_conversion(published, out):
    raise ReshardValueError(
        f"{api}: the dtype of {name!r} must be the published {published} or a "
        f"conversion among float32, float16, bfloat16 and float8; got {want}.")


def resolve(api: str, m: manifest_lib.Manifest, names: Callable[[str], Any],
            placements: Mapping[str, Any], dtypes: Mapping[str, torch.dtype],
            shapes: Mapping[str, tuple[int, ...]] | None, rank: int, world: int
            ) -> tuple[Target, ...]:
  """Per target (in the order of `dtypes`), its parts on this rank.

  `dtypes`: per torch name, its dtype (every name the mapping must produce);
  `shapes`: per torch name, the local shape the caller holds (checked), or None.

  Raises (before any byte moves): ReshardValueError naming the parameter for a name the
  mapping produces that is not a target (extra), a target nothing maps into (missing),
  parts that do not fit together, a local shape that is not this rank's slice, a
  dtype the torch side cannot convert to bitwise.
  """
  parts_of: dict[str, list[tuple[Into, int]]] = {}
  for t, leaf in enumerate(m.leaves):
    path = dotted(leaf.path)
    into = _as_into(api, names(path), path)
    if into is None:
      continue
    if into.name not in dtypes:
      raise ReshardValueError(f"{api}: every name the mapping gives must be a target; "
                              f"got {into.name!r} (from leaf {path!r}), which is not.")
    parts_of.setdefault(into.name, []).append((into, t))
  out = []
  for name, want in dtypes.items():
    got = sorted(parts_of.get(name, []), key=lambda p: p[0].part)
    if not got:
      raise ReshardValueError(f"{api}: every target must have a published leaf mapped "
                              f"into it; got none for {name!r}.")
    n, dim = got[0][0].parts, got[0][0].dim
    if [p.part for p, _ in got] != list(range(n)) or any(
        (p.parts, p.dim) != (n, dim) for p, _ in got):
      raise ReshardValueError(
          f"{api}: the parts of {name!r} must be 0..parts-1 with one parts and dim; "
          f"got {[(p.part, p.parts, p.dim) for p, _ in got]} from "
          f"{[dotted(m.leaves[t].path) for _, t in got]}.")
    shapes_of = []
    for p, t in got:
      leaf = m.leaves[t]
      check_dtypes(api, name, manifest_lib.dtype_of(leaf.dtype), want)
      if p.transpose and len(leaf.shape) != 2:
        raise ReshardValueError(f"{api}: transpose must be of a 2-D leaf; got shape "
                                f"{leaf.shape} for {name!r}.")
      shapes_of.append(tuple(reversed(leaf.shape)) if p.transpose else tuple(leaf.shape))
    if n > 1 and (any(len(s) != len(shapes_of[0]) or not 0 <= dim < len(s) or any(
        a != b for i, (a, b) in enumerate(zip(s, shapes_of[0])) if i != dim)
        for s in shapes_of)):
      raise ReshardValueError(f"{api}: the parts of {name!r} must agree on every dim but "
                              f"dim={dim}; got shapes {shapes_of}.")
    placement = placements.get(name, Replicate())
    fused = dim if n > 1 else None
    local_parts, offset, local_shape = [], 0, None
    for (p, t), s in zip(got, shapes_of):
      box = _rank_box(api, name, s, placement, rank, world, fused)
      ext = tuple(hi - lo for lo, hi in box)
      at = tuple(offset if i == fused else 0 for i in range(len(s)))
      local_shape = ext if local_shape is None else tuple(
          a + b if i == fused else a for i, (a, b) in enumerate(zip(local_shape, ext)))
      if fused is not None:
        offset += ext[fused]
      leaf_box = tuple(reversed(box)) if p.transpose else box
      local_parts.append(Part(t, leaf_box, at, p.transpose))
    if shapes is not None and tuple(shapes[name]) != local_shape:
      raise ReshardValueError(
          f"{api}: the tensor {name!r} must have this rank's shape {local_shape} "
          f"(rank {rank} of {world}, {placement}); got {tuple(shapes[name])}.")
    out.append(Target(name, local_shape, want, tuple(local_parts)))
  return tuple(out)
