"""Large pytrees: one reshard call is one program per participating device over every
leaf (no groups of leaves, no change at 64/65 leaves), compiled once per (device's
schedule, buffers) and reused by every later build of the same layouts, also another
pytree's. Results, donation, a delegated leaf and the repeated call (fast path) are
checked bitwise against jax.device_put; compiles are counted with jax.monitoring's
backend-compile events (timings are the scale suite's: jax_m2n/bench/scale.py)."""

import jax
import jax.monitoring
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import eager, fast_path
from jax_m2n._src.eager import programs

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **_: _compiles.append(event) if event == _COMPILE_EVENT
    else None)


@pytest.fixture(scope="module")
def devs():
  return np.array(jax.devices()[:8])


@pytest.fixture
def compiles():
  """Counts the XLA compiles from here on (compiles() -> how many)."""
  start = len(_compiles)
  return lambda: len(_compiles) - start


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


def _tree(devs, n, shapes, offset=0, layouts=None):
  layouts = layouts or [NamedSharding(Mesh(devs[:4], ("x",)), P("x"))]
  return {f"p{i:04d}": jax.device_put(
      np.arange(np.prod(shapes[i % len(shapes)]), dtype=np.float32).reshape(
          shapes[i % len(shapes)]) + i + offset, layouts[i % len(layouts)])
          for i in range(n)}


def _same(out, ref):
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for y, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert y.sharding == r.sharding and y.dtype == r.dtype and y.shape == r.shape
    for a, b in zip(sorted(y.addressable_shards, key=lambda s: s.device.id),
                    sorted(r.addressable_shards, key=lambda s: s.device.id)):
      assert a.device == b.device
      assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()


def _reference(tree, dsts):
  """jax.device_put(tree, dsts) from the leaves' host copies: the same arrays (values,
  shardings, dtypes). Not jax.device_put of the device arrays themselves: that runs one
  XLA program with a collective-permute per leaf, dispatched asynchronously, and with
  hundreds in flight XLA's CPU client deadlocks now and then under load (jax 0.10.2:
  "Termination timeout for `collective permute` ... only 7 of 8 arrived", then abort;
  reproduced without jax_m2n)."""
  return jax.tree.map(lambda x, d: jax.device_put(np.asarray(x), d), tree,
                      jax.tree.broadcast(dsts, tree))


def _participants(out, tree) -> int:
  return len({d for v in [*jax.tree.leaves(out), *jax.tree.leaves(tree)]
              for d in v.sharding.device_set})


@pytest.mark.parametrize("n", [64, 65])
def test_the_64_65_boundary_is_one_build_of_one_program_per_device(devs, builds,
                                                                   compiles, n):
  tree = _tree(devs, n, [(8, 12), (4, 8)], offset=n)
  dst = NamedSharding(Mesh(devs[4:], ("y",)), P(None, "y"))
  ref = _reference(tree, dst)
  before = compiles()
  out = jax_m2n.reshard(tree, dst)
  _same(out, ref)
  assert builds == [n]
  assert compiles() - before <= _participants(out, tree)
  entry = eager.eager_cache[next(reversed(list(eager.eager_cache)))]
  assert len(entry.programs) == _participants(out, tree)


def test_1000_leaves_of_mixed_layouts_then_a_repeat_that_compiles_nothing(
    devs, builds, compiles):
  mesh4 = Mesh(devs[:4], ("x",))
  mesh22 = Mesh(devs.reshape(2, 4), ("a", "b"))
  layouts = [NamedSharding(mesh4, P("x")), NamedSharding(mesh4, P()),
             NamedSharding(mesh22, P("a", "b")), NamedSharding(mesh22, P(None, "a"))]
  tree = _tree(devs, 1000, [(8, 16), (16, 8), (4, 4), (8, 8)], offset=3,
               layouts=layouts)
  dsts = {k: [NamedSharding(Mesh(devs[4:], ("y",)), P("y")),
              NamedSharding(mesh22, P("b", None)),
              NamedSharding(Mesh(devs[::-1].reshape(4, 2), ("p", "q")), P("q", "p")),
              NamedSharding(mesh4, P(None, "x"))][i % 4]
          for i, k in enumerate(tree)}
  ref = _reference(tree, dsts)
  before = compiles()
  out = jax_m2n.reshard(tree, dsts)
  _same(out, ref)
  assert builds == [1000]
  first = compiles()
  assert 0 < first - before <= 8
  again = jax_m2n.reshard(tree, dsts)  # the fast path: one program per device
  _same(again, ref)
  assert compiles() == first and builds == [1000]
  assert len(fast_path.cache)


def test_another_pytree_of_the_same_layouts_reuses_the_programs(devs, builds, compiles):
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[2:6], ("y",)), P(None, "y"))
  one = _tree(devs, 70, [(8, 8), (4, 12)], offset=11, layouts=[src])
  ref = _reference(one, dst)
  before = compiles()
  _same(jax_m2n.reshard(one, dst), ref)
  first = compiles()
  assert first > before
  # Another structure (a list, other values) of the same leaves' layouts, in the same
  # order: a new cache entry (its own tree), the same per-device programs.
  other = [jax.device_put(np.asarray(v) * 2 + 1, src) for v in one.values()]
  ref = _reference(other, dst)
  first = compiles()
  _same(jax_m2n.reshard(other, dst), ref)
  assert builds == [70, 70]
  assert compiles() == first
  assert len(programs.program_cache) >= 6


def test_mixed_layouts_donation_and_a_delegated_leaf(devs, builds):
  shapes = [(4, 8), (8, 4), (12, 4)]
  n = 2 * 64 + 7
  tree = _tree(devs, n, shapes, offset=1000)
  tree["host"] = np.arange(8.0)  # handed to jax.device_put
  dst = NamedSharding(Mesh(devs[2:6], ("y",)), P("y"))
  ref = _reference(tree, dst)
  donate = {k: k != "p0003" for k in tree}
  out = jax_m2n.reshard(tree, dst, donate=donate)
  _same(out, ref)
  assert builds == [n]  # every device leaf in one build
  assert not tree["p0003"].is_deleted()
  assert all(v.is_deleted() for k, v in tree.items() if k not in ("p0003", "host"))
