"""Fails loudly when JAX renames a private name jax_m2n uses (jax_m2n/_src/jax_compat.py).

Each shim function is called on a real array, so an upgrade that moves one shows up here
by name rather than as a failing reshard.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_m2n._src import jax_compat  # noqa: E402


def test_jax_version_is_one_the_shim_was_written_for():
  assert jax_compat.version_supported(), (
      f"jax {jax.__version__} is not in {jax_compat.SUPPORTED_JAX}: re-check every "
      "function of jax_m2n/_src/jax_compat.py and extend SUPPORTED_JAX.")


def test_trace_state_clean_tells_eager_from_traced():
  assert jax_compat.trace_state_clean() is True
  seen = []
  jax.jit(lambda a: seen.append(jax_compat.trace_state_clean()) or a)(1.0)
  assert seen == [False]


def test_device_assignments_and_single_device_arrays():
  devs = np.array(jax.devices()[:4])
  s = NamedSharding(Mesh(devs[::-1].reshape(2, 2), ("a", "b")), P("a"))
  assert [d.id for d in jax_compat.device_assignment(s)] == [3, 2, 1, 0]
  assert [d.id for d in jax_compat.addressable_device_assignment(s)] == [3, 2, 1, 0]
  x = jax.device_put(np.arange(8.0).reshape(4, 2), s)
  arrays = jax_compat.single_device_arrays(x)
  assert [next(iter(a.devices())).id for a in arrays] == [3, 2, 1, 0]
  np.testing.assert_array_equal(np.asarray(arrays[0]), np.arange(4.0).reshape(2, 2))


def test_fast_array_construction_matches_the_checked_one():
  devs = jax.devices()[:2]
  s = NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
  x = jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3), s)
  arrays = jax_compat.single_device_arrays(x)
  y = jax_compat.array_from_single_device_arrays((2, 3), s, arrays, np.float32)
  aval = jax_compat.reusable_aval(y)
  assert aval is not None, "jax.Array is no longer jax._src.array.ArrayImpl"
  z = jax_compat.array_from_single_device_arrays((2, 3), s, arrays, np.float32, aval)
  assert type(z) is type(y) and z.sharding == s and z.committed
  # The fast path's type test (fast_path.key): concrete arrays only, never a tracer.
  assert jax_compat.array_type() is not None and type(x) is jax_compat.array_type()
  kinds = []
  jax.jit(lambda a: kinds.append(type(a) is jax_compat.array_type()) or a)(x)
  assert kinds == [False]
  np.testing.assert_array_equal(np.asarray(z), np.asarray(x))


def test_arrays_of_known_layouts_match_the_checked_construction():
  s = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P(None, "x"))
  xs = [jax.device_put(np.arange(8.0, dtype=np.float32).reshape(2, 4) + k, s)
        for k in range(3)]
  known = [(x.aval, s) for x in xs]
  got = jax_compat.arrays_of_known_layouts(
      known, [jax_compat.single_device_arrays(x) for x in xs])
  for g, x in zip(got, xs):
    assert type(g) is type(x) and g.sharding == s and g.committed
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


def test_runtime_execute_runs_a_compiled_program_as_its_checked_call_does():
  device = jax.devices()[1]
  a = jax.device_put(np.arange(4.0, dtype=np.float32), device)
  b = jax.device_put(np.ones(4, np.int32), device)
  plain = jax.jit(lambda u, v: [u * 2, v + 1, u]).lower(a, b).compile()
  assert jax_compat.runtime_parts(plain) is not None, (
      "JAX's Compiled no longer exposes its runtime executable and result handlers: "
      "eager programs take JAX's checked call (~14 ms a first call of 1,000 buffers)")
  parts = jax_compat.runtime_parts(plain)
  got, want = jax_compat.runtime_execute(plain, parts)([a, b]), plain(a, b)
  assert len(got) == 3
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.devices() == {device} and g.committed
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # An argument jit pruned (unused): the checked call, which drops it itself.
  pruned = jax.jit(lambda u, v: [u + 1]).lower(a, b).compile()
  assert jax_compat.runtime_parts(pruned) is None
  out, = jax_compat.runtime_execute(pruned, None)([a, b])
  np.testing.assert_array_equal(np.asarray(out), np.arange(4.0) + 1)


def test_result_handler_makes_the_output_the_array_of_that_sharding():
  # A program's one-device output made the destination's array by its own handler,
  # as jax.device_put would give it: a NamedSharding of a one-device mesh stays one.
  device = jax.devices()[2]
  a = jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3), device)
  named = NamedSharding(Mesh(np.array([device]), ("x",)), P("x"))
  plain = jax.jit(lambda u: [u * 2, u + 1]).lower(a).compile()
  execute, handlers = jax_compat.runtime_parts(plain)
  want = jax.device_put(np.asarray(a) * 2, named)
  handler = jax_compat.result_handler(want.aval, named)
  assert handler is not None, (
      "this JAX has no runtime result handler: one-device leaves are assembled again")
  got, other = jax_compat.runtime_execute(plain, (execute, [handler, handlers[1]]))([a])
  assert type(got) is type(want) and got.sharding == named and got.committed
  assert got.aval == want.aval and other.sharding == jax.sharding.SingleDeviceSharding(device)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Its group's array as it is (a sharding of None), beside one assembled.
  kept, made = jax_compat.arrays_of_known_layouts(
      [(got.aval, None), (want.aval, named)], [[got], [other]])
  assert kept is got and made.sharding == named
  np.testing.assert_array_equal(np.asarray(made), np.asarray(a) + 1)


def test_context_mesh_plain_aval_tangent_zero_and_staging():
  from jax.sharding import AxisType
  assert jax_compat.context_mesh() is None
  m = Mesh(np.array(jax.devices()[:2]), ("x",))
  with jax.set_mesh(m):
    assert jax_compat.context_mesh() == m
    seen = []
    jax.jit(lambda a: seen.append(jax_compat.context_mesh()) or a)(1.0)
    assert seen == [m]
  em = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(np.zeros((4, 2), np.float32), NamedSharding(em, P("x")))
  plain = jax_compat.plain_aval(jax.typeof(x))
  assert plain.shape == (4, 2) and not plain.sharding.spec or all(
      e is None for e in plain.sharding.spec)
  zero = jax_compat.tangent_zero(x)
  assert zero.aval.shape == (4, 2)
  xa = jax.device_put(np.zeros((4, 2), np.float32), NamedSharding(m, P("x")))
  flags = []
  jax.jit(lambda a: flags.append(jax_compat.is_staged(a)) or a)(xa)
  jax.grad(lambda a: flags.append(jax_compat.is_staged(a)) or a.sum())(xa)
  assert flags == [True, False]
  Primitive, ad, batching, mlir = jax_compat.primitive_machinery()
  assert hasattr(batching, "primitive_batchers") and hasattr(ad, "primitive_jvps")
  assert hasattr(mlir, "lower_fun") and callable(Primitive)


def test_with_partitioner_mesh_gives_custom_partitioning_the_devices():
  Primitive, _, _, mlir = jax_compat.primitive_machinery()
  probe = Primitive("jax_m2n_compat_probe")
  probe.def_abstract_eval(lambda a: a)
  m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  seen = []

  def rule(ctx, v):
    sub = jax_compat.with_partitioner_mesh(ctx, m)
    seen.append(sub.module_context.axis_context)
    seen.append(jax_compat.with_partitioner_mesh(ctx, Mesh(np.array(jax.devices()[:2]),
                                                           ("x",))))
    return [v]

  mlir.register_lowering(probe, rule)
  x = jax.device_put(np.zeros((8, 8), np.float32), NamedSharding(m, P("a", "b")))
  jax.jit(probe.bind).lower(x)
  context, other = seen
  assert [d.id for d in context.device_assignment] == [d.id for d in m.devices.flat]
  assert context.abstract_mesh == m.abstract_mesh
  assert other is None  # a mesh over another number of devices


def test_batching_rule_sees_the_vmaps_batch_axes():
  from jax.sharding import AxisType
  jc = jax_compat
  Prim, _, _, _ = jc.primitive_machinery()
  p = Prim("jax_m2n_compat_probe")
  p.def_impl(lambda v: v)
  p.def_abstract_eval(lambda a: a)
  seen = []

  def rule(axis_data, args, dims):
    seen.append(jc.vmap_batch_axes(axis_data))
    return p.bind(*args), dims[0]

  jc.register_batching_rule(p, rule)
  jax.vmap(p.bind, spmd_axis_name="x")(np.zeros((2, 3), np.float32))
  em = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Explicit,))
  xe = jax.device_put(np.zeros((2, 3), np.float32), NamedSharding(em, P("x")))
  with jax.set_mesh(em):
    jax.vmap(p.bind)(xe)
  assert seen[0][1] in ("x", ("x",)) and seen[0][0] is None
  assert seen[1][0] in ("x", ("x",))


def test_distributed_client_is_none_outside_a_job():
  # Outside jax.distributed there is no client; inside, processes/ uses its key-value
  # calls (tests/multiprocess_cpu_test.py runs them).
  assert jax_compat.distributed_client() is None


def test_device_to_device_guard_reads_every_way_of_setting_it():
  assert jax_compat.device_to_device_guard() == "allow"
  with jax.transfer_guard_device_to_device("log_explicit"):
    assert jax_compat.device_to_device_guard() == "log_explicit"
  with jax.transfer_guard("disallow_explicit"):
    assert jax_compat.device_to_device_guard() == "disallow_explicit"
    with jax.transfer_guard_device_to_device("log"):
      assert jax_compat.device_to_device_guard() == "log"
  with jax.transfer_guard_host_to_device("disallow"):
    assert jax_compat.device_to_device_guard() == "allow"
  jax.config.update("jax_transfer_guard_device_to_device", "disallow")
  try:
    assert jax_compat.device_to_device_guard() == "disallow"
  finally:
    jax.config.update("jax_transfer_guard_device_to_device", None)
  assert jax_compat.device_to_device_guard() == "allow"


def test_distributed_coordinator_address_is_none_outside_a_job():
  assert jax_compat.distributed_coordinator_address() is None

