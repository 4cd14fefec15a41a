"""jax_m2n.reshard under every transfer-guard level (allow, log, disallow, log_explicit,
disallow_explicit), set for all transfers or for one direction at a time.

A reshard between devices moves no host data, so it runs under every host guard, logs
nothing there and equals jax.device_put's result: eager across disjoint, overlapping and
identical device sets, every route, dtype=, pytrees; inside jit under every guard. Its
move between devices is an explicit device-to-device transfer, as jax.device_put's: the
device-to-device guard refuses it under disallow_explicit (before anything moves) and
logs it under log_explicit, on the fast path too; a reshard that copies only within
devices meets no guard. (Where jax.device_put goes through the host, e.g. onto one
device of a sharded array, its host guards apply and jax_m2n's device-to-device guard
does: each meets the guard of the path it takes.) The first call of a process (when
jax_m2n makes its own per-device state) runs under the strictest host guards, in a
fresh interpreter, blocking and asynchronous. Where jax_m2n hands a leaf to
jax.device_put (host -> device, device <-> host memory kinds, typed PRNG keys, Python
scalars), the guard applies exactly as to device_put: both succeed with equal results,
or both raise.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import textwrap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402
import launcher  # noqa: E402

D = jax.devices()
LEVELS = ("allow", "log", "disallow", "log_explicit", "disallow_explicit")
GUARDS = {
    "all": jax.transfer_guard,
    "host_to_device": jax.transfer_guard_host_to_device,
    "device_to_host": jax.transfer_guard_device_to_host,
    "device_to_device": jax.transfer_guard_device_to_device,
}
ROUTES = ("hierarchical", "flat", "gather_bcast")
# What JAX's guard prints (absl, to stderr) for a logged transfer; jax_m2n's log line
# (the "jax_m2n" logger) says the same.
GUARD_LOG = "transfer: aval="
# The levels at which the device-to-device guard acts on an explicit transfer.
EXPLICIT = ("log_explicit", "disallow_explicit")


def _d2d_level(guard, level):
  """The device-to-device guard's level under GUARDS[guard](level)."""
  return level if guard in ("all", "device_to_device") else "allow"


# (level, guard) pairs under which a move between devices is neither refused nor logged.
QUIET = [(level, guard) for level in LEVELS for guard in sorted(GUARDS)
         if _d2d_level(guard, level) not in EXPLICIT]


def _mesh(ids, shape, names):
  return Mesh(np.array([D[i] for i in ids]).reshape(shape), names)


SRC = _mesh(range(4), (2, 2), ("fsdp", "tp"))
# Destination device sets: disjoint from SRC, overlapping it, and SRC's own devices.
DSTS = {
    "disjoint": _mesh(range(4, 8), (4,), ("tp",)),
    "overlapping": _mesh(range(2, 6), (4,), ("tp",)),
    "same": _mesh((3, 2, 1, 0), (4,), ("tp",)),
}


def _params():
  """A pytree like a model's: matrices and vectors of several dtypes and layouts."""
  rng = np.random.default_rng(0)
  return {
      "w": jax.device_put(rng.standard_normal((64, 48), np.float32),
                          NamedSharding(SRC, P("fsdp", "tp"))),
      "b": jax.device_put(rng.standard_normal(48).astype(jnp.bfloat16),
                          NamedSharding(SRC, P("tp"))),
      "layers": [jax.device_put(rng.integers(-9, 9, (8, 16, 4), np.int32),
                                NamedSharding(SRC, P(None, "fsdp"))),
                 jax.device_put(rng.standard_normal((16, 8), np.float32),
                                NamedSharding(SRC, P()))],
  }


def _dst(mesh):
  return {"w": NamedSharding(mesh, P(None, "tp")), "b": NamedSharding(mesh, P()),
          "layers": [NamedSharding(mesh, P("tp")), NamedSharding(mesh, P(None, "tp"))]}


def _assert_same(out, ref, exact=True):
  """Equal values, dtypes and layouts; `exact`: the very sharding (eager), else an
  equivalent one (a jit's output spec is normalized: P('b') for P('b', None))."""
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert o.dtype == r.dtype and o.shape == r.shape
    if exact:
      assert o.sharding == r.sharding
    else:
      assert o.sharding.is_equivalent_to(r.sharding, o.ndim), (o.sharding, r.sharding)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


@pytest.fixture(scope="module")
def params():
  return _params()


def test_the_log_check_sees_a_logged_transfer(capfd):
  """The other tests look for GUARD_LOG on stderr: a host -> device put under
  log_explicit prints it (else those checks could not fail)."""
  capfd.readouterr()
  with jax.transfer_guard("log_explicit"):
    jax.block_until_ready(jax.device_put(np.ones(4, np.float32), D[5]))
  assert GUARD_LOG in capfd.readouterr().err


@pytest.mark.parametrize("level,guard", QUIET)
def test_eager_between_devices_moves_no_host_data(params, level, guard, capfd):
  refs = {k: jax.device_put(params, _dst(m)) for k, m in DSTS.items()}
  ref_bf16 = jax.device_put(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params),
                            _dst(DSTS["disjoint"]))
  ref_f32 = jax.device_put(params["layers"][0].astype(jnp.float32),
                           NamedSharding(DSTS["same"], P("tp")))
  jax.block_until_ready((refs, ref_bf16, ref_f32))
  capfd.readouterr()
  with GUARDS[guard](level):
    outs = {(k, r): jax_m2n.reshard(params, _dst(m), route=r)
            for k, m in DSTS.items() for r in ROUTES}
    # dtype=: fused into the copies (f32 -> bf16), and astype on the source first.
    out_bf16 = jax_m2n.reshard(params, _dst(DSTS["disjoint"]), dtype=jnp.bfloat16)
    out_f32 = jax_m2n.reshard(params["layers"][0], NamedSharding(DSTS["same"], P("tp")),
                              dtype=jnp.float32)
    jax.block_until_ready((outs, out_bf16, out_f32))
  assert GUARD_LOG not in capfd.readouterr().err
  for (k, _), out in outs.items():
    _assert_same(out, refs[k])
  _assert_same(out_bf16, ref_bf16)
  _assert_same(out_f32, ref_f32)


@pytest.mark.parametrize("level,guard", QUIET)
def test_donated_eager_reshard_moves_no_host_data(level, guard, capfd):
  src = _params()
  ref = jax.device_put(src, _dst(DSTS["overlapping"]))
  jax.block_until_ready(ref)
  capfd.readouterr()
  with GUARDS[guard](level):
    out = jax.block_until_ready(
        jax_m2n.reshard(src, _dst(DSTS["overlapping"]), donate=True))
  assert GUARD_LOG not in capfd.readouterr().err
  assert all(a.is_deleted() for a in jax.tree.leaves(src))
  _assert_same(out, ref)


@pytest.mark.parametrize("guard", ["all", "device_to_device"])
def test_device_to_device_guard_refuses_the_move_as_device_puts(params, guard):
  """Under disallow_explicit every move between devices is refused before anything
  moves (sources kept, even donated), first call and repeated (fast path) alike, as
  jax.device_put refuses its device-to-device copies; a reshard that only copies
  within devices (a dtype conversion in place) runs."""
  x = params["w"]
  same_layout = NamedSharding(DSTS["disjoint"], P())
  put_src = jax.device_put(params["layers"][1], NamedSharding(SRC, P()))
  jax_m2n.reshard(params, _dst(DSTS["overlapping"]))  # cached: the next is the fast path
  in_place = jax_m2n.reshard(x, x.sharding, dtype=jnp.bfloat16)
  for _ in range(2):
    for name, mesh in DSTS.items():
      with GUARDS[guard]("disallow_explicit"):
        with pytest.raises(jax_m2n.ReshardTransferGuardError,
                           match="Disallowed device-to-device transfer") as e:
          jax_m2n.reshard(params, _dst(mesh), donate=True)
      assert isinstance(e.value, jax.errors.JaxRuntimeError), name
      assert not any(a.is_deleted() for a in jax.tree.leaves(params)), name
    with GUARDS[guard]("disallow_explicit"):
      # jax.device_put copies shard for shard here, and refuses it too.
      with pytest.raises(jax.errors.JaxRuntimeError, match="device-to-device"):
        jax.device_put(put_src, same_layout)
      with pytest.raises(jax.errors.JaxRuntimeError, match="device-to-device"):
        jax_m2n.reshard(put_src, same_layout)
      out = jax_m2n.reshard(x, x.sharding, dtype=jnp.bfloat16)
      jax.block_until_ready(out)
    _assert_same(out, in_place)


@pytest.mark.parametrize("guard", ["all", "device_to_device"])
def test_device_to_device_guard_logs_the_move_as_device_puts(params, guard, caplog):
  """Under log_explicit a move between devices runs and is logged (the jax_m2n logger,
  JAX's words), first call and repeated alike; a copy within devices is not."""
  ref = jax.device_put(params, _dst(DSTS["disjoint"]))
  x = params["w"]
  for _ in range(2):
    caplog.clear()
    with caplog.at_level("WARNING", logger="jax_m2n"), GUARDS[guard]("log_explicit"):
      out = jax.block_until_ready(jax_m2n.reshard(params, _dst(DSTS["disjoint"])))
    assert "device-to-device " + GUARD_LOG in caplog.text
    _assert_same(out, ref)
    caplog.clear()
    with caplog.at_level("WARNING", logger="jax_m2n"), GUARDS[guard]("log_explicit"):
      jax.block_until_ready(jax_m2n.reshard(x, x.sharding, dtype=jnp.bfloat16))
    assert GUARD_LOG not in caplog.text


@pytest.mark.parametrize("level", ["disallow", "disallow_explicit"])
@pytest.mark.parametrize("scalar", [3.0, 2, True, 1.5j], ids=lambda v: type(v).__name__)
def test_python_scalars_follow_device_puts_guard(scalar, level):
  """A Python scalar goes to jax.device_put (an explicit host -> device transfer): it
  runs where device_put runs (under "disallow": no implicit transfer of jax_m2n's own
  first) and is refused where device_put is refused."""
  for guard in ("all", "host_to_device"):
    ref, ref_err = _outcome(jax.device_put, scalar, D[1], guard, level)
    out, err = _outcome(jax_m2n.reshard, scalar, D[1], guard, level)
    assert err == ref_err, (guard, level, err, ref_err)
    if ref is not None:
      assert out.sharding == ref.sharding and out.dtype == ref.dtype
      assert out.weak_type == ref.weak_type and out.item() == ref.item()


MESH8 = _mesh(range(8), (2, 4), ("a", "b"))


@pytest.mark.parametrize("route", ROUTES)
def test_in_jit_under_every_guard(route, capfd):
  x = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                     NamedSharding(MESH8, P("a", "b")))
  dst = NamedSharding(MESH8, P("b", None))
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, route=route))
  g = jax.jit(lambda v: jax_m2n.reshard(v, dst, route=route, dtype=jnp.bfloat16))
  ref = jax.device_put(x, dst)
  ref_bf16 = jax.device_put(x.astype(jnp.bfloat16), dst)
  jax.block_until_ready((ref, ref_bf16))
  capfd.readouterr()
  # The first call (tracing, compiling) runs under the strictest guard too.
  with jax.transfer_guard("disallow_explicit"):
    _assert_same(f(x), ref, exact=False)
    _assert_same(g(x), ref_bf16, exact=False)
  for level in LEVELS:
    for guard in GUARDS.values():
      with guard(level):
        out, out_bf16 = jax.block_until_ready((f(x), g(x)))
      _assert_same(out, ref, exact=False)
      _assert_same(out_bf16, ref_bf16, exact=False)
  assert GUARD_LOG not in capfd.readouterr().err
  assert "jax_m2n_reshard" in f.lower(x).compile().as_text()


# Leaves jax_m2n hands to jax.device_put: (source builder, destination).
KEYS = jax.random.split(jax.random.key(7), 8)
DELEGATED = {
    "host_to_device": (lambda: np.arange(32.0, dtype=np.float32).reshape(8, 4),
                       NamedSharding(DSTS["disjoint"], P("tp"))),
    "device_to_pinned_host_same_devices": (
        lambda: jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                               NamedSharding(SRC, P("fsdp"))),
        NamedSharding(SRC, P("fsdp"), memory_kind="pinned_host")),
    "device_to_pinned_host_other_devices": (
        lambda: jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                               NamedSharding(SRC, P("fsdp"))),
        NamedSharding(DSTS["disjoint"], P("tp"), memory_kind="pinned_host")),
    "pinned_host_to_device": (
        lambda: jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                               NamedSharding(SRC, P("fsdp"), memory_kind="pinned_host")),
        NamedSharding(DSTS["disjoint"], P("tp"))),
    "typed_keys_other_devices": (
        lambda: jax.device_put(KEYS, NamedSharding(SRC, P("fsdp"))),
        NamedSharding(DSTS["disjoint"], P("tp"))),
    "typed_keys_same_devices": (
        lambda: jax.device_put(KEYS, NamedSharding(SRC, P("fsdp"))),
        NamedSharding(SRC, P("tp"))),
}


def _outcome(fn, src, dst, guard, level):
  try:
    with GUARDS[guard](level):
      return jax.block_until_ready(fn(src, dst)), None
  except jax.errors.JaxRuntimeError as e:
    return None, str(e).split(":")[1].strip().split(" transfer")[0]


def _data(a):
  a = jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
  return np.asarray(a)


@pytest.mark.parametrize("case", sorted(DELEGATED))
def test_delegated_leaves_follow_device_puts_guard(case):
  build, dst = DELEGATED[case]
  src = build()
  refused = 0
  for level in LEVELS:
    for guard in GUARDS:
      ref, ref_err = _outcome(jax.device_put, src, dst, guard, level)
      out, err = _outcome(jax_m2n.reshard, src, dst, guard, level)
      assert err == ref_err, (level, guard, err, ref_err)
      refused += ref_err is not None
      if ref is not None:
        assert out.sharding == ref.sharding and out.dtype == ref.dtype
        np.testing.assert_array_equal(_data(out), _data(ref))
  # Each case crosses host memory or devices: disallow_explicit refuses it somewhere.
  assert refused, case


FIRST_CALL = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np, jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d = jax.devices()
    a = Mesh(np.array(d[:4]).reshape(2, 2), ("fsdp", "tp"))
    b = Mesh(np.array(d[4:]), ("tp",))
    x = jax.device_put(np.arange(64.0 * 48, dtype=np.float32).reshape(64, 48),
                       NamedSharding(a, P("fsdp", "tp")))
    ref = jax.device_put(x, NamedSharding(b, P(None, "tp")))
    jax.block_until_ready(ref)
    # The strictest host guards; device to device, the move itself is the explicit
    # transfer the caller asked for ("disallow" refuses implicit ones only).
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
         jax.transfer_guard_device_to_host("disallow_explicit"), \
         jax.transfer_guard_device_to_device("disallow"):
        out = jax_m2n.reshard(x, NamedSharding(b, P(None, "tp")))
        back = jax_m2n.reshard(out, x.sharding, route="flat")
        jax.block_until_ready((out, back))
    assert out.sharding == ref.sharding
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    print("first call ok")
""")


@pytest.mark.parametrize("cpu_async", ["0", "1"])
def test_first_call_of_a_process_under_disallow_explicit(cpu_async):
  """jax_m2n's own per-device state (the CPU generation tickets, programs) is made on
  the first call touching a device: under the caller's strictest host guards here."""
  proc = launcher.run_python(FIRST_CALL, {"JAX_PLATFORMS": "cpu",
                                          "JAX_M2N_CPU_ASYNC": cpu_async}, timeout_s=180)
  assert proc.returncode == 0 and "first call ok" in proc.stdout, proc.stderr[-3000:]
  assert GUARD_LOG not in proc.stderr
