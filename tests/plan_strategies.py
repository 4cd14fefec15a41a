"""Hypothesis strategies for random reshard cases, shared by the planner and schedule
tests (a helper module: every test target gets it, tests/BUILD)."""

import math

from hypothesis import strategies as st

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
