"""The pytrees the `jobs` suite publishes and pulls, and their layouts on either side.

Owns the cases by name: what the trainer program builds from a name and what the
generator expects of it (the same host values from the same seed, for the bitwise
check), in which layout each side holds it. Knows no Publisher, Subscriber or timing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MIB = 1 << 20
KIB = 1 << 10
# Devices per side on CPU (the trainer program has 4 forced host devices, the generator
# uses 4 of its 8); one GPU each side on GPUs.
DEVICES = 4
COLS = 1024


@dataclasses.dataclass(frozen=True)
class Tree:
  """One case: float32 leaves of `shapes`, P(*trainer) on the trainer's devices and
  P(*generator) on the generator's (`devices` of them; 0: the side's default)."""

  name: str
  shapes: tuple[tuple[int, ...], ...]
  trainer: tuple[Any, ...] = ("x",)
  generator: tuple[Any, ...] = ("x",)
  devices: int = 0

  @property
  def nbytes(self) -> int:
    n = 0
    for s in self.shapes:
      size = 4
      for d in s:
        size *= d
      n += size
    return n


def same_layout(size: int, per_side: int = DEVICES) -> Tree:
  """`size` bytes of float32 as one [rows, 1024] leaf, P(x) -> P(x) (the throughput
  cases: the subscriber's shards are the publisher's, byte for byte)."""
  rows = max(per_side, size // 4 // COLS // per_side * per_side)
  return Tree(f"{size // MIB}MiB", ((rows, COLS),))


# The latency table's cases (issue 43) and the security table's leaf counts (issue 44).
NAMED = {
    "4KiB": Tree("4KiB", ((8, 128),)),
    "4KiB_1dev": Tree("4KiB_1dev", ((8, 128),), devices=1),
    "64x64KiB": Tree("64x64KiB", ((128, 128),) * 64),
    "1x4MiB": Tree("1x4MiB", ((1024, 1024),)),
    "20_leaves": Tree("20_leaves", ((256_000,),) * 20, devices=1),
    "20k_leaves": Tree("20k_leaves", ((256,),) * 20_000, devices=1),
}
# The Ray example's policy (examples/rl_refit.py's at its defaults, 26 leaves, 0.39 MiB
# float32), in its layouts (FSDP2 x TP2 -> TP2 x DP2), pulled as bfloat16 as there.
POLICY = "policy"


def by_name(name: str) -> Tree | None:
  """The Tree of a name ("<n>MiB" for same_layout(n MiB)); None for POLICY."""
  if name == POLICY:
    return None
  if name in NAMED:
    return NAMED[name]
  if name.endswith("MiB") and name[:-3].isdigit():
    return same_layout(int(name[:-3]) * MIB)
  raise ValueError(f"jobs bench: a tree must be one of {sorted(NAMED)}, {POLICY!r} or "
                   f"'<n>MiB'; got {name!r}.")


def build(jax: Any, name: str, devices: list[Any], side: str, seed: int
          ) -> tuple[list[Any], list[Any]]:
  """(host values, shardings) of the case `name` on `devices` (all of the side's; a
  one-device case takes the first), for `side` "trainer" or "generator": the same
  values on both sides (from `seed`)."""
  if name == POLICY:
    return _policy(jax, devices, side, seed)
  return build_tree(jax, by_name(name), devices, side, seed)


def build_tree(jax: Any, tree: Tree, devices: list[Any], side: str, seed: int
               ) -> tuple[list[Any], list[Any]]:
  """`build` of a Tree that has no name here."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = devices[:tree.devices or len(devices)]
  mesh = Mesh(np.array(devs), ("x",))
  spec = P(*(tree.trainer if side == "trainer" else tree.generator))
  rng = np.random.default_rng(seed)
  host = [rng.standard_normal(s, dtype=np.float32) for s in tree.shapes]
  sharding = NamedSharding(mesh, spec)
  return host, [sharding] * len(host)


def _policy(jax: Any, devices: list[Any], side: str, seed: int):
  import functools
  import numpy as np
  from examples import rl_refit as rl  # a checkout's examples/ (the bench runs from one)
  cfg = rl.RefitConfig(layouts="fsdp2xtp2->tp2xdp2@same", progress=False)
  sides = rl.make_sides(cfg, devices)
  shapes = jax.eval_shape(functools.partial(rl.init_params, cfg=cfg), jax.random.key(0))
  shardings = rl.param_shardings(shapes, sides[0 if side == "trainer" else 1])
  rng = np.random.default_rng(seed)
  host = [(rng.standard_normal(s.shape, dtype=np.float32) * 0.02).astype(s.dtype)
          for s in jax.tree.leaves(shapes)]
  return host, jax.tree.leaves(shardings)


def policy_nbytes(jax: Any) -> int:
  """The Ray example's policy bytes (float32)."""
  import functools
  from examples import rl_refit as rl
  cfg = rl.RefitConfig(progress=False)
  shapes = jax.eval_shape(functools.partial(rl.init_params, cfg=cfg), jax.random.key(0))
  return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
