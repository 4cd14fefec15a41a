"""Donation with aliased leaves: one array at several leaves of x, or returned as it is
(a None destination), is deleted by neither jax.device_put nor jax_m2n.reshard unless
every leaf holding it is donated and no result is it. Each case runs both and compares
which arrays are still alive and what the results hold."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402

D = jax.devices()


def _fresh():
  return jax.device_put(np.arange(8.0, dtype=np.float32), D[0])


def _two(s):
  return NamedSharding(Mesh(np.array(D[s]), ("x",)), P("x"))


# (x builder taking the source array, dst, donate): run with device_put and reshard.
CASES = {
    "none_destination_and_donated_alias": (
        lambda a: {"a": a, "b": a}, lambda: {"a": D[1], "b": None},
        {"a": True, "b": False}),
    "list_alias_one_kept": (lambda a: [a, a], lambda: D[1], [True, False]),
    "list_alias_kept_first": (lambda a: [a, a], lambda: D[1], [False, True]),
    "list_alias_both_donated": (lambda a: [a, a], lambda: D[1], True),
    "list_alias_both_donated_two_dsts": (lambda a: [a, a], lambda: [D[1], D[2]], True),
    "none_destination_donated": (lambda a: {"a": a}, lambda: {"a": None}, True),
    "alias_none_and_move_both_donated": (
        lambda a: {"a": a, "b": a}, lambda: {"a": _two(slice(2, 4)), "b": None},
        {"a": True, "b": True}),
    "tuple_alias_three_leaves": (
        lambda a: (a, a, a), lambda: (D[2], _two(slice(4, 6)), D[3]),
        (True, False, True)),
}


def _run(fn, name):
  build, dst, donate = CASES[name]
  a = _fresh()
  x = build(a)
  try:
    out = fn(x, dst(), donate=donate)
  except Exception as e:  # noqa: BLE001 - compared with the other function's outcome
    return a, None, type(e)
  return a, out, None


@pytest.mark.parametrize("name", sorted(CASES))
def test_aliased_donation_keeps_what_device_put_keeps(name):
  ref_src, ref_out, ref_err = _run(jax.device_put, name)
  src, out, err = _run(jax_m2n.reshard, name)
  if ref_err is not None:  # JAX refuses: so must we (a ValueError either way)
    assert err is not None and issubclass(err, ValueError), (ref_err, err)
    assert not src.is_deleted()
    return
  assert err is None
  assert src.is_deleted() == ref_src.is_deleted()
  for r, y in zip(jax.tree.leaves(ref_out), jax.tree.leaves(out)):
    assert y.is_deleted() == r.is_deleted()
    if not r.is_deleted():
      np.testing.assert_array_equal(np.asarray(y), np.asarray(r))
      assert y.sharding == r.sharding


def test_a_returned_source_is_never_deleted():
  a = _fresh()
  out = jax_m2n.reshard({"a": a, "b": a}, {"a": D[1], "b": None},
                        donate={"a": True, "b": False})
  assert not out["b"].is_deleted() and not a.is_deleted()
  np.testing.assert_array_equal(np.asarray(out["b"]), np.arange(8.0))
  np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(8.0))


def test_unaliased_donation_still_deletes():
  a, b = _fresh(), _fresh()
  out = jax_m2n.reshard([a, b], D[1], donate=[True, False])
  assert a.is_deleted() and not b.is_deleted()
  np.testing.assert_array_equal(np.asarray(out[0]), np.arange(8.0))


def test_a_quantized_leaf_sharing_its_array_with_another_leaf_is_not_donated():
  a = jax.device_put(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), D[0])
  spec = jax_m2n.Quantize("float8_e4m3fn", channelwise_axes=(0,))
  out = jax_m2n.reshard({"q": a, "p": a}, D[1], dtype={"q": spec, "p": None},
                        donate={"q": True, "p": True})
  assert not a.is_deleted()
  np.testing.assert_array_equal(np.asarray(out["p"]), np.asarray(a))
