"""A pull is checked by reshard's own rules: the same bad destination or dtype gets the
same error class and the same rule from `jax_m2n.reshard` and `Subscriber.pull`, before
any byte moves (jobs/request.py builds a pull with checks.py's functions)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import engine

TOKEN = "request-test-token-0123456789"


@pytest.fixture(scope="module")
def published():
  trainer = Mesh(np.array(jax.devices()[:4]), ("x",))
  tree = {"w": jax.device_put(np.arange(128.0, dtype=np.float32).reshape(8, 16),
                              NamedSharding(trainer, P("x"))),
          "b": jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(trainer, P()))}
  pub = jax_m2n.Publisher(token=TOKEN)
  pub.publish(tree)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  yield tree, sub
  sub.close()
  pub.close()


def _rule(e: Exception) -> str:
  """The rule a message states: from 'must' to the first ';' (the api and the leaf's
  name differ between the two calls, the rule does not)."""
  m = re.search(r"must (.*?);", str(e), re.S)
  assert m, str(e)
  return m.group(1)


def _gen():
  return Mesh(np.array(jax.devices()[4:]), ("y",))


def _bad_destinations():
  devs = jax.devices()
  gen = _gen()
  three = Mesh(np.array(devs[4:7]), ("y",))
  cases = {
      "not a sharding": 3,
      "indivisible": NamedSharding(three, P("y")),
      "too many spec entries": NamedSharding(gen, P(None, None, "y")),
      "abstract mesh": NamedSharding(jax.sharding.AbstractMesh((4,), ("y",)), P("y")),
      "wrong shape": jax.ShapeDtypeStruct((4, 16), np.float32,
                                          sharding=NamedSharding(gen, P())),
  }
  try:
    cases["device twice"] = NamedSharding(
        Mesh(np.array([devs[4], devs[4], devs[5], devs[6]]), ("y",)), P("y"))
  except Exception:  # noqa: BLE001 - a JAX that refuses such a mesh itself
    pass
  try:
    cases["unreduced"] = NamedSharding(gen, P(None, None, unreduced={"y"}))
  except Exception:  # noqa: BLE001 - a JAX without unreduced specs
    pass
  return cases


@pytest.mark.parametrize("case", sorted(_bad_destinations()))
def test_a_bad_destination_gets_reshards_error(published, case):
  tree, sub = published
  bad = _bad_destinations()[case]
  before = dict(engine.stats)
  with pytest.raises(jax_m2n.ReshardError) as from_reshard:
    jax_m2n.reshard(tree["w"], bad)
  with pytest.raises(jax_m2n.ReshardError) as from_pull:
    sub.pull({"w": bad, "b": NamedSharding(_gen(), P())}, version=1)
  assert type(from_pull.value) is type(from_reshard.value), (from_reshard.value,
                                                             from_pull.value)
  assert _rule(from_pull.value) == _rule(from_reshard.value)
  assert dict(engine.stats) == before  # nothing moved


@pytest.mark.parametrize("dtype", ["not-a-dtype", 3, {"w": jnp.bfloat16, "zz": None}])
def test_a_bad_dtype_gets_reshards_error(published, dtype):
  tree, sub = published
  dst = NamedSharding(_gen(), P())
  with pytest.raises(jax_m2n.ReshardError) as from_reshard:
    jax_m2n.reshard(tree, dst, dtype=dtype)
  with pytest.raises(jax_m2n.ReshardError) as from_pull:
    sub.pull(dst, version=1, dtype=dtype)
  assert type(from_pull.value) is type(from_reshard.value)
  assert _rule(from_pull.value).replace("the published pytree", "x") == _rule(
      from_reshard.value)


def test_a_prefix_that_is_not_one_gets_reshards_error(published):
  tree, sub = published
  dst = {"w": NamedSharding(_gen(), P()), "extra": NamedSharding(_gen(), P())}
  with pytest.raises(jax_m2n.ReshardValueError) as from_reshard:
    jax_m2n.reshard(tree, dst)
  with pytest.raises(jax_m2n.ReshardValueError) as from_pull:
    sub.pull(dst, version=1)
  assert _rule(from_pull.value).replace("the published pytree", "x") == _rule(
      from_reshard.value)


def test_dtypes_canonicalize_as_jax_does(published):
  tree, sub = published
  # Without x64, float64 is float32 (as jax.device_put(x.astype(np.float64)) gives).
  out = sub.pull(NamedSharding(_gen(), P()), version=1, dtype={"w": np.float64,
                                                                "b": None})
  want = jax.device_put(tree["w"].astype(np.float64), NamedSharding(_gen(), P()))
  assert out["w"].dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(want))


def _huge_manifest():
  """A manifest as a publisher would send it, its one leaf announced as 16 TiB."""
  from jax_m2n._src.jobs import manifest as manifest_lib  # noqa: PLC0415
  x = jax.device_put(np.zeros((8, 16), np.float32),
                     NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), P()))
  body = manifest_lib.build([x], [("['w']",)], [np.dtype(np.float32)],
                            manifest_lib.skeleton_of({"w": x}),
                            [("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "", "net")]).to_json()
  shape = [1 << 20, 1 << 22]
  body["leaves"][0][1] = shape
  body["layouts"] = [[ds, [[0, shape[0], 0, shape[1]] for _ in boxes]]
                     for ds, boxes in body["layouts"]]
  return manifest_lib.from_json(body)


def test_a_manifest_announcing_absurd_sizes_is_refused_before_allocating():
  from jax_m2n._src.jobs import request  # noqa: PLC0415
  m = _huge_manifest()
  options = request.pull_options("Subscriber.pull")
  with pytest.raises(jax_m2n.ReshardValueError,
                     match=r"must fit this host's memory; .* take 6.55e\+04 GiB .*largest shard: \[.w.\]"):
    request.pull_request("Subscriber.pull", m, NamedSharding(_gen(), P()), None, None,
                         options)


def test_a_version_too_large_for_this_host_fails_before_any_byte_moves(published,
                                                                       monkeypatch):
  from jax_m2n._src.jobs import request  # noqa: PLC0415
  tree, sub = published
  dst = NamedSharding(_gen(), P(None, "y"))
  before = dict(engine.stats)
  monkeypatch.setattr(request, "_host_total", lambda: 100)  # a host of 100 bytes
  request._cache.clear()  # checked when a request is built (once per layout set)
  with pytest.raises(jax_m2n.ReshardValueError, match="must fit this host's memory"):
    sub.pull({"w": dst, "b": NamedSharding(_gen(), P())}, version=1, path="network")
  assert dict(engine.stats) == before
  monkeypatch.undo()
  out = sub.pull({"w": dst, "b": NamedSharding(_gen(), P())}, version=1,
                 path="network", timeout_s=30)
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))


def test_a_recurring_pull_reuses_its_checked_request(published, monkeypatch):
  """The checks are pure in (manifest, dst, dtype): a second pull with the same
  arguments takes the first one's request (its checks, e.g. the memory fit, not
  redone)."""
  from jax_m2n._src.jobs import request  # noqa: PLC0415
  _, sub = published
  dst = {"w": NamedSharding(_gen(), P(None, "y")), "b": NamedSharding(_gen(), P())}
  request._cache.clear()
  sub.pull(dst, version=1, path="network", timeout_s=30)
  fits = []
  monkeypatch.setattr(request, "check_fits", lambda *a: fits.append(a))
  sub.pull(dst, version=1, path="network", timeout_s=30)
  assert fits == []
