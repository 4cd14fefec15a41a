"""A large pytree's first call (issue 26): leaves of one layout are moved in groups of
at most eager.cache._GROUP_LEAVES, and each group layout's programs are built once,
not one program per device over every leaf (whose compile grew with the leaf count:
2,000 leaves took 4.4 s against 0.30 s for jax.device_put). The results, donation and
the repeated call (fast path) are checked against jax.device_put; the time itself is
scripts/first_call.py's."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import eager, fast_path


@pytest.fixture(scope="module")
def devs():
  return np.array(jax.devices()[:8])


@pytest.fixture
def builds(monkeypatch):
  """The leaf counts of the entries built during the test."""
  built = []
  build = eager.cache.build_programs

  def counted(request, dsts):
    built.append(len(request))
    return build(request, dsts)
  monkeypatch.setattr(eager.cache, "build_programs", counted)
  return built


def _tree(devs, n, shapes, offset=0):
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  return {f"p{i:04d}": jax.device_put(
      np.full(shapes[i % len(shapes)], i + offset, np.float32), src) for i in range(n)}


def _same(out, ref):
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for y, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert y.sharding == r.sharding and y.dtype == r.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(r))


def test_one_layout_builds_its_group_programs_once(devs, builds):
  group = eager.cache._GROUP_LEAVES
  n = 4 * group  # four groups of one size: one build
  tree = _tree(devs, n, [(8, 12)])
  dst = NamedSharding(Mesh(devs[4:], ("y",)), P(None, "y"))
  _same(jax_m2n.reshard(tree, dst), jax.device_put(tree, dst))
  assert builds == [group]
  again = jax_m2n.reshard(tree, dst)  # the fast path: no build, same result
  _same(again, jax.device_put(tree, dst))
  assert builds == [group]
  odd = _tree(devs, 3 * group + 5, [(8, 12)], offset=7)  # 4 groups: 50, 50, 50, 47
  _same(jax_m2n.reshard(odd, dst), jax.device_put(odd, dst))
  size = -(-(3 * group + 5) // 4)
  assert builds == [group, size, 3 * group + 5 - 3 * size]
  assert len(fast_path.cache)


def test_mixed_layouts_donation_and_a_delegated_leaf(devs, builds):
  group = eager.cache._GROUP_LEAVES
  shapes = [(4, 8), (8, 4), (12, 4)]
  n = 2 * group + 7
  tree = _tree(devs, n, shapes, offset=1000)
  tree["host"] = np.arange(8.0)  # handed to jax.device_put
  dst = NamedSharding(Mesh(devs[2:6], ("y",)), P("y"))
  ref = jax.device_put(tree, dst)
  donate = {k: k != "p0003" for k in tree}
  out = jax_m2n.reshard(tree, dst, donate=donate)
  _same(out, ref)
  assert all(len(builds) <= 2 * len(shapes) and b <= group for b in builds)
  assert not tree["p0003"].is_deleted()
  assert all(v.is_deleted() for k, v in tree.items() if k not in ("p0003", "host"))
