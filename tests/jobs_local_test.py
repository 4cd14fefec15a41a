"""The local data plane between jobs on one host (CPU: shared memory): a Subscriber on the
Publisher's host reads each version straight from the publisher's memory (jobs/local.py,
jobs/exports.py). Bitwise against jax.device_put(x.astype(dtype), dst) over random
layouts and dtypes; the path chosen automatically and forced; versions overwritten
while read never returned; a publisher or subscriber killed (SIGKILL) leaves nothing
behind and harms nobody else; retired layout sets free their memory."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import engine, exports, pulling, records

TOKEN = "local-test-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [np.float32, np.int32, ml_dtypes.bfloat16, np.uint8, np.float16, np.bool_]
CONVERSIONS = {np.dtype(np.float32): [None, ml_dtypes.bfloat16, np.float16, np.int32],
               np.dtype(ml_dtypes.bfloat16): [None, np.float32]}


def _bits(x):
  return np.asarray(x).reshape(-1).view(np.uint8)


def _spec(rng, rank, axes):
  return P(*[axes[i] if i < len(axes) and rng.random() < 0.6 else None
             for i in range(rank)])


def _case(rng, trainer, gen):
  """A random leaf: shape, dtype, source and destination shardings, a conversion."""
  rank = int(rng.integers(0, 4))
  shape = tuple(int(rng.choice([2, 4, 8])) for _ in range(rank))
  dtype = np.dtype(DTYPES[int(rng.integers(len(DTYPES)))])
  src = NamedSharding(trainer, _spec(rng, rank, trainer.axis_names))
  dst = NamedSharding(gen, _spec(rng, rank, list(rng.permutation(gen.axis_names))))
  conv = CONVERSIONS.get(dtype, [None])[int(rng.integers(len(CONVERSIONS.get(dtype,
                                                                          [None]))))]
  return shape, dtype, src, dst, conv


@pytest.fixture(scope="module")
def meshes():
  devs = np.array(jax.devices())
  return (Mesh(devs[:4].reshape(2, 2), ("a", "b")), Mesh(devs[4:].reshape(2, 2),
                                                        ("x", "y")))


@pytest.mark.parametrize("path", ["local", "network"])
@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_and_dtypes_bitwise(meshes, seed, path):
  """Both paths over the same cases: "network" on CPU composes each destination shard
  straight from the packs that arrived (engine._run_direct), cut out of the
  publisher's export as flat runs where boxes are contiguous (offering._cutter)."""
  trainer, gen = meshes
  rng = np.random.default_rng(seed)
  cases = [_case(rng, trainer, gen) for _ in range(12)]
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  try:
    before = dict(engine.stats)
    for v in range(1, 4):
      host = [(rng.standard_normal(s) * 8).astype(d) for s, d, *_ in cases]
      tree = [jax.device_put(h, src) for h, (_, _, src, _, _) in zip(host, cases)]
      assert pub.publish(tree) == v
      out = sub.pull([c[3] for c in cases], dtype=[c[4] for c in cases], path=path)
      assert sub.version == v and sub._state.path == path
      for x, y, (_, _, _, dst, conv) in zip(tree, out, cases):
        want = jax.device_put(x if conv is None else x.astype(conv), dst)
        assert y.sharding == dst and y.dtype == want.dtype
        np.testing.assert_array_equal(_bits(y), _bits(want))
    if path == "local":
      assert dict(engine.stats) == before  # nothing crossed the transport
  finally:
    sub.close()
    pub.close()


def test_the_path_is_forced_either_way(meshes):
  trainer, gen = meshes
  x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                     NamedSharding(trainer, P("a", "b")))
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish({"x": x})
    dst = NamedSharding(gen, P(None, "y"))
    net = sub.pull(dst, version=1, path="network")
    assert sub._state.path == "network"
    loc = sub.pull(dst, version=1, path="local")
    assert sub._state.path == "local"
    np.testing.assert_array_equal(_bits(net["x"]), _bits(loc["x"]))
    with pytest.raises(jax_m2n.ReshardValueError, match="path must be one of"):
      sub.pull(dst, version=1, path="shm")


def test_local_is_refused_where_the_publisher_is_elsewhere(meshes, monkeypatch):
  trainer, gen = meshes
  x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(trainer, P("a")))
  with jax_m2n.Publisher(token=TOKEN) as pub:
    pub.publish({"x": x})
    # This process now looks like another host to the manifest's publisher.
    monkeypatch.setattr(exports, "host_identity", lambda: "another-host")
    with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
      dst = NamedSharding(gen, P())
      with pytest.raises(jax_m2n.ReshardValueError, match="path='local' needs"):
        sub.pull(dst, version=1, path="local")
      out = sub.pull(dst, version=1)  # auto: the network
      assert sub._state.path == "network"
      np.testing.assert_array_equal(np.asarray(out["x"]), np.ones((8, 8), np.float32))


def test_a_reused_slot_is_never_read_as_the_old_version(meshes):
  trainer, gen = meshes
  mk = lambda v: {"x": jax.device_put(np.full((8, 8), v, np.float32),  # noqa: E731
                                      NamedSharding(trainer, P("a")))}
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(mk(1))
    sub.pull(NamedSharding(gen, P()), version=1)
    imp = next(iter(sub._state.imports.values()))
    pub.publish(mk(2))
    pub.publish(mk(3))  # takes version 1's slot
    with pytest.raises(jax_m2n.ReshardValueError):
      imp.slot_of(1, time.monotonic() + 1.0)
    assert imp.slot_of(3, time.monotonic() + 1.0) in range(2)
    out = sub.pull(NamedSharding(gen, P()))  # the newest
    assert sub.version == 3 and float(np.asarray(out["x"])[0, 0]) == 3.0


def test_a_steady_local_pull_copies_while_the_publisher_confirms(meshes, monkeypatch):
  """Where the exports already hold a newer version, a pull copies it while the
  publisher answers which version is the newest; an answer naming another version
  (here a newer one of another layout set) is what the pull returns."""
  trainer, gen = meshes
  seen = []
  confirmed = pulling.Ahead.confirmed
  monkeypatch.setattr(pulling.Ahead, "confirmed",
                      lambda self: seen.append(confirmed(self)) or seen[-1])
  a = lambda v: {"x": jax.device_put(np.full((8, 8), v, np.float32),  # noqa: E731
                                     NamedSharding(trainer, P("a")))}
  b = lambda v: {"x": jax.device_put(np.full((4, 16), v, np.float32),  # noqa: E731
                                     NamedSharding(trainer, P(None, "b")))}
  dst = NamedSharding(gen, P("x"))
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(a(1))
    sub.pull(dst)
    assert seen == []  # the first pull asks first
    for v in (2, 3):
      pub.publish(a(v))
      out = sub.pull(dst)
      assert sub.version == v and (np.asarray(out["x"]) == v).all()
      assert sub.last_pull.path == "local"
    assert seen == [True, True]
    pub.publish(a(4))
    pub.publish(b(5))  # the newest is of another layout set
    out = sub.pull(dst)
    assert seen == [True, True, False]
    assert sub.version == 5 and out["x"].shape == (4, 16)
    assert (np.asarray(out["x"]) == 5).all()
    pub.publish(b(6))
    out = sub.pull(dst, donate=out)
    assert seen[-1] is True and (np.asarray(out["x"]) == 6).all()
    # A version asked by number: the same, where the export holds it.
    pub.publish(b(7))
    out = sub.pull(dst, version=7)
    assert seen[-1] is True and len(seen) == 5 and (np.asarray(out["x"]) == 7).all()
    out = sub.pull(dst, version=6)  # an older one still held
    assert seen[-1] is True and (np.asarray(out["x"]) == 6).all()
    with pytest.raises(jax_m2n.ReshardValueError, match="holds"):
      sub.pull(dst, version=5)  # dropped (keep=2): refused before anything is read


def test_a_steady_pull_copies_once_its_slot_commits_and_records_its_steps(meshes,
                                                                        monkeypatch):
  """A steady local pull whose version's slot is still being written (-v: a GPU
  snapshot's copy in flight) is begun ahead all the same: it waits for the commit, then
  copies while the publisher confirms; `last_pull.steps` says where its time went."""
  trainer, gen = meshes
  seen = []
  confirmed = pulling.Ahead.confirmed
  monkeypatch.setattr(pulling.Ahead, "confirmed",
                      lambda self: seen.append(confirmed(self)) or seen[-1])
  mk = lambda v: {"x": jax.device_put(np.full((8, 8), v, np.float32),  # noqa: E731
                                      NamedSharding(trainer, P("a")))}
  dst = NamedSharding(gen, P("x"))
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(mk(1))
    sub.pull(dst)
    pub.publish(mk(2))
    export, = pub._versions.exports()
    slot = export.slot_of(2)
    export.header[slot] = -2  # as while its copy is in flight
    commit = threading.Timer(0.05, lambda: export.header.__setitem__(slot, 2))
    commit.start()
    out = sub.pull(dst)
    commit.join()
    assert seen == [True] and sub.version == 2 and (np.asarray(out["x"]) == 2).all()
    steps = sub.last_pull.steps
    assert set(steps) <= set(records.LOCAL_STEPS)
    assert {"slot", "addresses", "dispatch", "ready", "check"} <= set(steps)
    assert steps["slot"] >= 0.03  # it waited for the commit (begun 50 ms before)
    assert sum(steps.values()) <= sub.last_pull.move_s


def test_a_closed_export_reads_as_gone_to_a_reader_that_mapped_it(meshes):
  """A reader's mapping outlives the publisher's close; the header it reads says no
  slot holds a version any more (on CUDA the memory itself is freed)."""
  trainer, gen = meshes
  x = {"x": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(trainer, P("a")))}
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(x)
    sub.pull(NamedSharding(gen, P()), version=1)
    imp = next(iter(sub._state.imports.values()))
    assert imp.slot_of(1, time.monotonic() + 1.0) in range(2)
    pub.close()
    with pytest.raises(jax_m2n.ReshardValueError, match="holds another version"):
      imp.slot_of(1, time.monotonic() + 1.0)
    with pytest.raises(jax_m2n.ReshardRuntimeError, match="closed"):
      sub.pull(NamedSharding(gen, P()), timeout_s=5.0)


def _memfds():
  out = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      out += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
      pass
  return out


def test_retired_layout_sets_and_closed_ends_free_their_memory(meshes):
  trainer, gen = meshes
  start = _memfds()
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  a = {"x": jax.device_put(np.ones((64, 64), np.float32), NamedSharding(trainer, P("a")))}
  b = {"y": jax.device_put(np.ones((32,), np.int32), NamedSharding(trainer, P()))}
  pub.publish(a)
  sub.pull(NamedSharding(gen, P()), version=1)
  assert len(pub._versions._exports) == 1
  pub.publish(b)
  pub.publish(b)  # layout set a is no longer held: its export is freed
  assert len(pub._versions._exports) == 1
  sub.pull(NamedSharding(gen, P()))
  sub.close()
  pub.close()
  assert _memfds() == start and not pub._versions._exports
  assert not os.listdir("/dev/shm") or not any(
      "jax_m2n" in f for f in os.listdir("/dev/shm"))


_PUBLISHER = textwrap.dedent("""
    import os, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np, jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    pub = jax_m2n.Publisher(token=sys.argv[2], keep=2)
    x = jax.device_put(np.arange(1 << 16, dtype=np.float32).reshape(256, 256),
                       NamedSharding(mesh, P("a", "b")))
    v = 0
    while True:
      v = pub.publish({"w": x + v})
      if v == 1:
        with open(d + "/addr.tmp", "w") as f:
          f.write(pub.address)
        os.replace(d + "/addr.tmp", d + "/addr")
      time.sleep(0.05)
""")


def _start_publisher(d):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, d, TOKEN], env=env)
  deadline = time.monotonic() + 120
  while not os.path.exists(d + "/addr"):
    assert p.poll() is None and time.monotonic() < deadline, "the publisher died"
    time.sleep(0.05)
  return p, open(d + "/addr").read()


def test_two_programs_on_one_host_and_a_killed_publisher(meshes):
  _, gen = meshes
  d = tempfile.mkdtemp()
  shm_before = set(os.listdir("/dev/shm"))
  memfds = _memfds()
  p, address = _start_publisher(d)
  try:
    with jax_m2n.Subscriber(address, token=TOKEN) as sub:
      dst = NamedSharding(gen, P(None, "y"))
      base = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
      for _ in range(5):
        out = sub.pull(dst, dtype=jnp.bfloat16, timeout_s=30)
        assert sub._state.path == "local"
        want = jax.device_put((base + (sub.version - 1)).astype(jnp.bfloat16), dst)
        np.testing.assert_array_equal(_bits(out["w"]), _bits(want))
      p.send_signal(signal.SIGKILL)
      p.wait(timeout=30)
      t0 = time.monotonic()
      with pytest.raises(jax_m2n.ReshardRuntimeError):
        for _ in range(100):  # a version published before the kill may still be read
          sub.pull(dst, timeout_s=30)
      assert time.monotonic() - t0 < 2.0
  finally:
    if p.poll() is None:
      p.kill()
  assert set(os.listdir("/dev/shm")) == shm_before  # nothing left behind
  assert _memfds() == memfds


def test_a_version_its_publisher_died_writing_fails_at_once():
  """A slot read while its version is being written waits only while the publisher
  process runs: killed between announcing a version and committing its slot, the
  pull fails with ReshardRuntimeError now, not at the commit wait's end (10 s)."""
  from jax_m2n._src.jobs import local  # noqa: PLC0415
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  imp = local.Import.__new__(local.Import)  # the wait alone: no export to map
  imp.name = "trainer process 0"
  imp.latest = np.array([2], np.int64)      # version 3 announced, not yet committed
  imp.header = np.array([2, -3], np.int64)  # slot 1 being written with it
  imp._liveness = local._pidfd(child.pid)
  if imp._liveness is None:
    child.kill()
    pytest.skip("no pidfd here: liveness is not checked")
  try:
    with pytest.raises(jax_m2n.ReshardTimeoutError):  # alive: waits to its deadline
      imp.slot_of(3, time.monotonic() + 0.2)
    child.kill()
    child.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(jax_m2n.ReshardRuntimeError, match="exited while writing it"):
      imp.slot_of(3, time.monotonic() + 10)
    assert time.monotonic() - t0 < 1.0
    imp.header[1] = 3  # committed: found whatever the process does next
    assert imp.slot_of(3, time.monotonic()) == 1
  finally:
    os.close(imp._liveness)
    if child.poll() is None:
      child.kill()


_SUBSCRIBER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np, jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sub = jax_m2n.Subscriber(sys.argv[1], token=sys.argv[2])
    mesh = Mesh(np.array(jax.devices()), ("y",))
    while True:
      sub.pull(NamedSharding(mesh, P("y")), timeout_s=30)
      print("pulled", sub.version, flush=True)
""")


def test_a_killed_subscriber_harms_nobody(meshes):
  _, gen = meshes
  d = tempfile.mkdtemp()
  p, address = _start_publisher(d)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  victim = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, address, TOKEN], env=env,
                            stdout=subprocess.PIPE, text=True)
  try:
    for _ in range(3):  # it pulls a few versions, then dies mid-loop
      assert victim.stdout.readline().startswith("pulled")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    with jax_m2n.Subscriber(address, token=TOKEN) as sub:
      out = sub.pull(NamedSharding(gen, P()), timeout_s=30)
      want = np.arange(1 << 16, dtype=np.float32).reshape(256, 256) + (sub.version - 1)
      np.testing.assert_array_equal(np.asarray(out["w"]), want)
    assert p.poll() is None  # the publisher still publishes
  finally:
    for q in (victim, p):
      if q.poll() is None:
        q.kill()
        q.wait()
