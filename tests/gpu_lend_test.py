"""Lending XLA's own GPU buffers between two programs on one GPU (skipped without one,
as on CI): the trainer (jax_m2n/bench/lend_trainer.py, a subprocess) publishes, this
program subscribes on the same GPU and reads the trainer's allocations in place.

- lent and snapshotted versions bitwise across shapes, ranks and dtypes, with and
  without the trainer's preallocated pool, also converted on the way (bfloat16,
  float16 -> float32); `lend_limit` refusing the pool (a snapshot, said in the stats);
- a pull racing the donation of its version, 200 times: every version returned
  bitwise right, the others VersionGone; the same with `wait_pulled` before donating;
- the memory: the trainer's extra memory (XLA's bytes in use plus the driver's used
  memory outside both programs' pools) after the last pull: lent <= 64 MiB for 1 GiB,
  snapshot <= keep x bytes + 64 MiB (keep 1 and 2); mappings released on retire and
  close; a killed subscriber leaves the trainer's memory as it was; a killed trainer
  fails the next pull within 2 s.

Run on the GPU machine (after building jax_m2n/_ffi_cuda.so):
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -s tests/gpu_lend_test.py
"""

import gpus  # first: keeps NVLink multicast off before JAX loads NCCL

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE = gpus.count_without_jax()
pytestmark = pytest.mark.skipif(HAVE < 1, reason="needs a GPU")
MIB = 1 << 20
LEAVES = [["a", [1024, 256], "float32"], ["b", [3, 5, 7], "bfloat16"],
          ["c", [4096], "int8"], ["d", [33, 17], "float16"], ["e", [64], "bool"],
          ["s", [], "float32"], ["z", [0, 4], "float32"]]


class Trainer:
  """The trainer program: one JSON command per line, one answer per line."""

  def __init__(self, keep=2, prealloc=False, lend_limit=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if prealloc:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.35"
    else:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    argv = [sys.executable, "-m", "jax_m2n.bench.lend_trainer", "--keep", str(keep)]
    if lend_limit is not None:
      argv += ["--lend_limit", str(lend_limit)]
    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env, cwd=ROOT)
    self.first = json.loads(self.proc.stdout.readline())
    self.address = self.first["address"]

  def send(self, **cmd):
    self.proc.stdin.write(json.dumps(cmd) + "\n")
    self.proc.stdin.flush()

  def read(self):
    got = json.loads(self.proc.stdout.readline())
    assert "error" not in got, got.get("trace", got)
    return got

  def __call__(self, **cmd):
    self.send(**cmd)
    return self.read()

  def close(self):
    if self.proc.poll() is None:
      try:
        self(op="exit")
      except (BrokenPipeError, ValueError, json.JSONDecodeError):
        pass
      self.proc.wait(timeout=30)


def _values(shape, dtype, seed):
  import jax.numpy as jnp  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import values  # noqa: PLC0415
  return values(jnp, tuple(shape), dtype, seed)


def _same_bits(got, want):
  import jax.numpy as jnp  # noqa: PLC0415
  assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
  if got.dtype == jnp.bool_ or got.size == 0:
    return bool(jnp.array_equal(got, want))
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[got.dtype.itemsize]
  import jax  # noqa: PLC0415
  return bool(jnp.array_equal(jax.lax.bitcast_convert_type(got, width),
                              jax.lax.bitcast_convert_type(want, width)))


def _dst():
  import jax  # noqa: PLC0415
  from jax.sharding import SingleDeviceSharding  # noqa: PLC0415
  return SingleDeviceSharding(gpus.devices()[0])


def _memory():
  import jax  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import memory  # noqa: PLC0415
  return memory(jax)


@pytest.fixture
def trainer(request):
  made = []

  def make(**kw):
    made.append(Trainer(**kw))
    return made[-1]
  yield make
  for t in made:
    t.close()


@pytest.mark.parametrize("prealloc", [False, True])
@pytest.mark.parametrize("lend", [True, False])
def test_lent_and_snapshot_bitwise(trainer, prealloc, lend):
  import jax.numpy as jnp  # noqa: PLC0415
  import jax_m2n  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  if not gpus.devices():
    pytest.skip("JAX sees no GPU")
  t = trainer(keep=2, prealloc=prealloc)
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    for seed in (1, 2, 3):
      t(op="make", leaves=LEAVES, seed=seed)
      v = t(op="publish", lend=lend)["version"]
      dst = {name: _dst() for name, _, _ in LEAVES}
      out = sub.pull(dst, path="local")
      assert sub.version == v and sub.last_pull.path == "local"
      for name, shape, dtype in LEAVES:
        assert _same_bits(out[name], _values(shape, dtype, seed)), (name, seed)
      conv = {"a": jnp.bfloat16, "b": jnp.float32, "d": jnp.float32}
      out = sub.pull(dst, version=v, dtype={n: conv.get(n) for n, _, _ in LEAVES},
                     path="local")
      for name, shape, dtype in LEAVES:
        want = _values(shape, dtype, seed)
        if name in conv:
          want = want.astype(conv[name])
        assert _same_bits(out[name], want), (name, seed, "converted")
    stats = t(op="stats")
  assert [v["held_as"] for v in stats["versions"]] == ["lent" if lend else "snapshot"] * 2
  if lend:
    assert stats["device_bytes"] == {}  # nothing held beside the caller's arrays
  else:
    assert sum(stats["device_bytes"].values()) >= 2 * 1024 * 256 * 4


def test_lend_limit_refuses_the_pool(trainer):
  import jax_m2n  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  t = trainer(keep=1, prealloc=True, lend_limit=4)
  t(op="make", leaves=LEAVES, seed=5)
  v = t(op="publish", lend=True)["version"]
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    out = sub.pull({name: _dst() for name, _, _ in LEAVES}, path="local")
    assert sub.version == v
    for name, shape, dtype in LEAVES:
      assert _same_bits(out[name], _values(shape, dtype, 5)), name
  [held] = t(op="stats")["versions"]
  # Never lent: refused by the limit, or (seen on one H100, jax 0.11.2, this trainer's
  # preallocated pool) not lendable at all (cuMemRetainAllocationHandle refused the
  # pool's address); either way a snapshot whose reason is named.
  assert held["held_as"].startswith(("snapshot (pooled memory", "snapshot (not lendable")), held


@pytest.mark.parametrize("wait_pulled", [False, True])
def test_a_pull_racing_a_donation(trainer, wait_pulled):
  """The trainer publishes lent, waits a random 0-4 ms (or for the pull), donates
  (x + 1) and publishes again; this program pulls meanwhile, 200 times: each version v
  it returns is bitwise x0 + (v - first); the others are VersionGone (retried inside
  the pull where it asked for the newest: `last_pull.retries`)."""
  import jax_m2n  # noqa: PLC0415
  from jax_m2n._src.errors import VersionGone  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  shape = [16 * MIB // 4]
  t = trainer(keep=2)
  t(op="make", leaves=[["w", shape, "float32"]], seed=0)
  x0 = _values(shape, "float32", 0)
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    first = t(op="stats")["last_version"] + 1
    n = 200 if wait_pulled else 600  # (waiting: each version is pulled once)
    t.send(op="race", n=n, sleep_s=0.004, wait_pulled=wait_pulled)
    ok = gone = 0
    while (sub.version < first + n - 1) if wait_pulled else (ok + gone < 200):
      try:
        out = sub.pull({"w": _dst()}, timeout_s=20)
      except VersionGone:
        gone += 1
        continue
      v = sub.version
      assert _same_bits(out["w"], x0 + float(v - first)), v
      ok += 1
      gone += sub.last_pull.retries.count("version gone")
    sub.close()
    versions = t.read()["versions"]
  assert versions[0] == first and ok >= 1
  print(f"race (wait_pulled={wait_pulled}): {ok} bitwise, {gone} VersionGone")


def _extra(before_t, after_t, before_s, after_s):
  """The trainer's extra memory: its XLA bytes in use, plus the device's used memory
  that neither program's pool accounts for (memory outside XLA)."""
  xla = after_t["bytes_in_use"] - before_t["bytes_in_use"]
  outside = ((after_t["device_used"] - before_t["device_used"])
             - (after_t["pool_bytes"] - before_t["pool_bytes"])
             - (after_s["pool_bytes"] - before_s["pool_bytes"]))
  return xla, max(0, outside)


@pytest.mark.parametrize("mode,keep", [("lend", 2), ("snapshot", 2), ("snapshot", 1)])
def test_the_trainers_extra_memory(trainer, mode, keep):
  import jax  # noqa: PLC0415
  import jax_m2n  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  t = trainer(keep=keep)
  gib = 1 << 30
  t(op="make", leaves=[["w", [gib // 4], "float32"]], seed=0)
  before_t, before_s = t(op="memory"), _memory()
  out = None
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    for _ in range(3):
      t(op="publish", lend=mode == "lend")
      out = None  # the last result's memory is reused
      out = sub.pull({"w": _dst()}, path="local")
      jax.block_until_ready(out)
    out = None
    after_t, after_s = t(op="memory"), _memory()
    xla, outside = _extra(before_t, after_t, before_s, after_s)
    stats = t(op="stats")
    print(f"memory {mode} keep={keep}, 1 GiB: trainer XLA +{xla / MIB:.0f} MiB, outside "
          f"XLA +{outside / MIB:.0f} MiB; stats device_bytes {stats['device_bytes']}, "
          f"lent allocations {stats['lent_allocations']} "
          f"({stats['lent_allocation_bytes'] / MIB:.0f} MiB)")
    limit = (64 * MIB if mode == "lend" else keep * gib + 64 * MIB)
    assert xla + outside <= limit, (xla, outside)
  used = _memory()["device_used"]
  assert used <= after_s["device_used"] + 64 * MIB  # the mappings went with the close


def test_mappings_released_on_retire_and_close(trainer):
  import jax_m2n  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  t = trainer(keep=1)
  t(op="make", leaves=LEAVES, seed=1)
  sub = jax_m2n.Subscriber(t.address, token=TOKEN)
  v = t(op="publish", lend=True)["version"]
  sub.pull({n: _dst() for n, _, _ in LEAVES}, path="local")
  [imp] = sub._state.imports.values()
  assert imp._maps and t(op="stats")["lent_allocations"] >= 1
  t(op="wait_pulled", version=v, n=1)  # stops lending it: nothing held now
  assert t(op="stats")["lent_allocations"] == 0
  t(op="drop")
  t(op="make", leaves=LEAVES, seed=2)
  t(op="publish")  # a snapshot: its own buffers
  out = sub.pull({n: _dst() for n, _, _ in LEAVES}, path="local")
  for name, shape, dtype in LEAVES:
    assert _same_bits(out[name], _values(shape, dtype, 2)), name
  live = {int(i) for i in imp.tables[imp.header != 0][:, :, 0].reshape(-1) if i}
  assert set(imp._maps) == live  # only what held versions lie in stays mapped
  sub.close()
  assert imp._maps == {}


def test_a_killed_subscriber_leaves_the_trainer_as_it_was(trainer):
  import jax_m2n  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  t = trainer(keep=2)
  t(op="make", leaves=LEAVES, seed=3)
  t(op="publish", lend=True)
  before = t(op="memory")
  code = textwrap.dedent(f"""
      import os, signal, jax, jax_m2n
      from jax.sharding import SingleDeviceSharding
      sub = jax_m2n.Subscriber({t.address!r}, token={TOKEN!r})
      d = SingleDeviceSharding(jax.devices()[0])
      jax.block_until_ready(sub.pull({{n: d for n in {[n for n, _, _ in LEAVES]!r}}},
                                     path="local"))
      os.kill(os.getpid(), signal.SIGKILL)
  """)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=300)
  assert r.returncode == -signal.SIGKILL
  assert t(op="memory")["bytes_in_use"] == before["bytes_in_use"]
  t(op="make", leaves=LEAVES, seed=4)
  t(op="publish", lend=True)
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    out = sub.pull({n: _dst() for n, _, _ in LEAVES}, path="local")
    for name, shape, dtype in LEAVES:
      assert _same_bits(out[name], _values(shape, dtype, 4)), name


@pytest.mark.parametrize("lend", [True, False])
def test_a_killed_trainer_fails_the_pull_within_2_s(trainer, lend):
  import jax_m2n  # noqa: PLC0415
  from jax_m2n._src.errors import ReshardError  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN  # noqa: PLC0415
  t = trainer(keep=2)
  t(op="make", leaves=LEAVES, seed=1)
  t(op="publish", lend=lend)
  with jax_m2n.Subscriber(t.address, token=TOKEN) as sub:
    sub.pull({n: _dst() for n, _, _ in LEAVES}, path="local")
    t(op="make", leaves=LEAVES, seed=2)
    t(op="publish", lend=lend)
    t.proc.send_signal(signal.SIGKILL)
    t.proc.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(ReshardError):
      sub.pull({n: _dst() for n, _, _ in LEAVES}, path="local", timeout_s=30)
    assert time.monotonic() - start < 2.0
    assert all(not imp._maps for imp in sub._state.imports.values())
