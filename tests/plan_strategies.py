"""Hypothesis strategies for random reshard cases, shared by the tests (a helper module:
every test target gets it, tests/BUILD): device-free layouts for the planner and
schedule tests; JAX meshes, PartitionSpecs and NamedShardings over the test devices for
the end-to-end tests (reshard_test, probe_test)."""

import math

import jax
import numpy as np
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_m2n._src.planner import ROUTES


@st.composite
def mesh_specs(draw, ndim, max_devices=8, first_max=8):
  n_axes = draw(st.integers(1, 3))
  sizes = [draw(st.sampled_from([1, 2, 2, 3, 4])) for _ in range(n_axes)]
  while math.prod(sizes) > max_devices:
    sizes[sizes.index(max(sizes))] = 1
  names = [f"a{i}" for i in range(n_axes)]
  order = draw(st.permutations(names))
  spec = [[] for _ in range(ndim)]
  for name in order:
    slot = draw(st.integers(-1, ndim - 1)) if ndim else -1
    if slot >= 0:
      spec[slot].append(name)
  first = draw(st.integers(0, first_max))
  mesh = ", ".join(f"{n}={s}" for n, s in zip(names, sizes))
  entries = ", ".join("None" if not e else (e[0] if len(e) == 1 else "(" + ", ".join(e) + ")")
                      for e in spec)
  return f"mesh({mesh}) P({entries}) @{first}", dict(zip(names, sizes)), spec


@st.composite
def reshard_cases(draw):
  ndim = draw(st.integers(0, 4))
  src_text, src_sizes, src_spec = draw(mesh_specs(ndim))
  dst_text, dst_sizes, dst_spec = draw(mesh_specs(ndim))
  shape = []
  for d in range(ndim):
    m = math.lcm(math.prod(src_sizes[a] for a in src_spec[d]),
                 math.prod(dst_sizes[a] for a in dst_spec[d]))
    shape.append(m * draw(st.integers(0 if d == 0 and draw(st.booleans()) and
                                         draw(st.integers(0, 9)) == 0 else 1, 3)))
  shape = tuple(shape)
  domain = draw(st.sampled_from([None, 1, 2, 3, 4, 8]))
  route = draw(st.sampled_from(ROUTES))
  chunk = draw(st.sampled_from([8, 64, 1 << 20]))
  itemsize = draw(st.sampled_from([1, 2, 4, 8]))
  return shape, src_text, dst_text, domain, route, chunk, itemsize


# ---------------------------------------------------------------------------------------
# JAX shardings over the test devices
# ---------------------------------------------------------------------------------------

def factorizations(n: int) -> list[tuple[int, ...]]:
  """Mesh shapes of 1-3 axes over n devices (at most one size-1 axis)."""
  out = set()

  def rec(rest, acc):
    if acc and rest == 1:
      out.add(tuple(acc))
    if len(acc) < 3:
      for f in range(1, rest + 1):
        if rest % f == 0 and not (f == 1 and 1 in acc):
          rec(rest // f, acc + [f])

  rec(n, [])
  return sorted(out)


@st.composite
def partition_specs(draw, names, rank):
  """Each mesh axis on a random dim or none; several axes on one dim in any order; a
  one-axis entry as a name or a 1-tuple; trailing Nones kept or dropped."""
  dims = {}
  for a in names:
    d = draw(st.integers(-1, rank - 1)) if rank else -1
    if d >= 0:
      dims.setdefault(d, []).append(a)
  entries = []
  for d in range(rank):
    axes = list(draw(st.permutations(dims.get(d, []))))
    entries.append(None if not axes else
                   axes[0] if len(axes) == 1 and draw(st.booleans()) else tuple(axes))
  if draw(st.booleans()):
    while entries and entries[-1] is None:
      entries.pop()
  return P(*entries)


def named_sharding(ids, mesh_shape, spec, explicit=False, names="abc") -> NamedSharding:
  """A NamedSharding on a mesh of devices `ids` (in that order) shaped `mesh_shape`."""
  devices = jax.devices()
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(mesh_shape)
  mesh = Mesh(np.array([devices[i] for i in ids]).reshape(mesh_shape),
              tuple(names[:len(mesh_shape)]), axis_types=types)
  return NamedSharding(mesh, spec)


@st.composite
def named_shardings(draw, ids, rank, explicit=False, names="abc"):
  """A random mesh shape over devices `ids` and a random PartitionSpec of `rank`."""
  shape = draw(st.sampled_from(factorizations(len(ids))))
  return named_sharding(ids, shape, draw(partition_specs(tuple(names[:len(shape)]),
                                                         rank)), explicit, names)


def shard_counts(sharding: NamedSharding, rank: int) -> list[int]:
  """Per tensor dim, how many pieces the sharding cuts it into."""
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
  out = [1] * rank
  for d, e in enumerate(sharding.spec):
    for a in (() if e is None else (e,) if isinstance(e, str) else e):
      out[d] *= sizes[a]
  return out
