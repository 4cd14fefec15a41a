"""Relays among subscriber jobs. In this process (8 CPU devices: a publisher on 0-3,
subscribers on 4-7): a chain and a tree of three members bitwise with one copy from
the trainer, and properly sealed malformed relay calls refused while the publisher
serves on. As separate programs on 127.0.0.1: subscribers of one group (same dst layouts and dtype) form a relay per version, a bfloat16 subscriber
relays in its own group; over several versions one joins late, one leaves cleanly,
one dies mid-version while others pull from it, one is killed at a random point.
Every surviving subscriber gets every version from its first bitwise, the trainer
sends the group one copy per version while nobody fails, and the publisher keeps
publishing. Workers: tests/jobs_relay_worker.py; every launch is bounded and every
process killed at the end."""

import os
import random
import re
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.errors import ReshardError
from jax_m2n._src.jobs import auth, channel, relay
from jax_m2n.testing.hosts import EmulatedHosts

import launcher
from jobs_faults import pass_over

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "jobs_relay_worker.py")
VERSIONS = 6
MIB = 4


TOKEN = "relay-test-token"


@pytest.fixture(scope="module")
def published():
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  rng = np.random.default_rng(0)
  host = {"w": rng.standard_normal((256, 96)).astype(np.float32),
          "n": np.arange(64 * 40, dtype=np.int32).reshape(64, 40)}
  tree = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("x"))),
          "n": jax.device_put(host["n"], NamedSharding(mesh, P(None, "x")))}
  pub.publish(tree)
  yield pub, host
  pub.close()


def _bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("fanout", [1, 2], ids=["chain", "tree"])
def test_members_in_one_process_relay_bitwise_with_one_copy_from_the_trainer(
    published, fanout):
  pub, host = published
  gen = Mesh(np.array(jax.devices()[4:]), ("y",))
  dst = {"w": NamedSharding(gen, P(None, "y")), "n": NamedSharding(gen, P("y"))}
  subs = [jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True) for _ in range(3)]
  for s in subs:
    s._state.relay.fanout = fanout
    s._state.relay.chunk_bytes = 4096  # several chunks per pack
  before = dict(relay.stats)
  try:
    for s in subs:  # one after the other: the later ones pull from the earlier
      out = s.pull(dst, dtype={"w": jnp.bfloat16, "n": None}, version=1, timeout_s=60,
                   path="network")
      np.testing.assert_array_equal(_bits(out["w"]),
                                    _bits(host["w"].astype(jnp.bfloat16)))
      np.testing.assert_array_equal(_bits(out["n"]), _bits(host["n"]))
      assert out["w"].sharding == dst["w"] and out["n"].sharding == dst["n"]
  finally:
    for s in subs:
      s.close()
  one_copy = host["w"].size * 2 + host["n"].nbytes
  got = {k: relay.stats[k] - before.get(k, 0) for k in
         ("from_trainer_bytes", "from_peers_bytes", "offered_chunk_bytes")}
  assert got == {"from_trainer_bytes": one_copy, "from_peers_bytes": 2 * one_copy,
                 "offered_chunk_bytes": one_copy}, got


def test_a_lying_member_is_caught_and_its_child_gets_the_right_bytes(published,
                                                                    monkeypatch):
  # The first member flips a byte of every chunk it forwards: the second checks each
  # against the publisher's digest, takes the rest from the trainer, and returns the
  # published values bitwise (never what the liar sent).
  _, host = published
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)  # its own: the module's keeps version 1
  gen = Mesh(np.array(jax.devices()[4:]), ("y",))
  dst = {"w": NamedSharding(gen, P(None, "y")), "n": NamedSharding(gen, P("y"))}
  liar = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
  honest = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
  for s in (liar, honest):
    s._state.relay.chunk_bytes = 4096
  init = relay._Forwarder.__init__

  def lying(self, member, v, transport, timeout_s):
    if member is not liar._state.relay:
      return init(self, member, v, transport, timeout_s)

    class Flipping:
      def offer(self_, arrays, *a, **k):
        bad = [jnp.asarray(np.asarray(x).reshape(-1).view(np.uint8) ^ np.uint8(1)).view(
            x.dtype).reshape(x.shape) for x in arrays]
        return transport.offer([jax.device_put(b, x.devices().pop())
                                for b, x in zip(bad, arrays)], *a, **k)

      def __getattr__(self_, name):
        return getattr(transport, name)
    init(self, member, v, Flipping(), timeout_s)
  monkeypatch.setattr(relay._Forwarder, "__init__", lying)
  version = pub.publish({"w": jax.device_put(host["w"] * 2, NamedSharding(
      Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))), "n": jax.device_put(
          host["n"], NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)),
                                   P(None, "x")))})
  before = dict(relay.stats)
  try:
    liar.pull(dst, version=version, timeout_s=60, path="network")
    out = honest.pull(dst, version=version, timeout_s=60, path="network")
  finally:
    liar.close()
    honest.close()
    pub.close()
  np.testing.assert_array_equal(_bits(out["w"]), _bits(host["w"] * 2))
  np.testing.assert_array_equal(_bits(out["n"]), _bits(host["n"]))
  assert relay.stats["bad_chunks"] > before.get("bad_chunks", 0)
  assert relay.stats["reroutes"] == before.get("reroutes", 0) + 1


def test_an_upstream_dead_before_the_pull_connects_is_passed_over_at_once(published):
  # A pull from an address nothing listens on would wait forever (the transfer
  # server's behaviour): the member finds its upstream gone before pulling and takes
  # the version from the trainer. The upstream "dies" here by its address pointing
  # at a closed port in the coordinator's record.
  pub, host = published
  gen = Mesh(np.array(jax.devices()[4:]), ("y",))
  first = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
  second = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
  try:
    version = pub.publish({"w": jax.device_put(host["w"] + 1, NamedSharding(
        Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))), "n": jax.device_put(
            host["n"], NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)),
                                     P(None, "x")))})
    dst = NamedSharding(gen, P("y"))
    first.pull(dst, version=version, timeout_s=60, path="network")
    pass_over(pub, version, first._state.relay.id)
    before = relay.stats["reroutes"]
    t0 = time.monotonic()
    out = second.pull(dst, version=version, timeout_s=60, path="network")
    seconds = time.monotonic() - t0
  finally:
    first.close()
    second.close()
  np.testing.assert_array_equal(_bits(out["w"]), _bits(host["w"] + 1))
  np.testing.assert_array_equal(_bits(out["n"]), _bits(host["n"]))
  assert relay.stats["reroutes"] == before + 1
  print(f"a dead upstream passed over: the pull took {seconds:.2f} s")


def _call(pub, body):
  client = channel.Client("test", pub.address, auth.as_key("test", TOKEN), 10.0,
                          "the publisher")
  try:
    return client.call(body, 5.0, "a relay call")
  finally:
    client.close()


@pytest.mark.parametrize("body", [
    {"op": "relay_join"},
    {"op": "relay_join", "version": 1, "group": "g" * 33, "member": "m",
     "address": "x", "fanout": 1},
    {"op": "relay_join", "version": 1, "group": "g", "member": "m", "address": "x",
     "fanout": 99},
    {"op": "relay_join", "version": 1 << 63, "group": "g", "member": "m",
     "address": "x", "fanout": 1},
    {"op": "relay_children", "version": 1, "group": "g", "member": "nobody",
     "known": 0, "wait_ms": 0},
    {"op": "relay_reroute", "version": 1, "group": "g", "member": "nobody",
     "upstream": 3},
    {"op": "relay_leave"},
    {"op": "relay_leave", "member": "m", "versions": [0]},
    {"op": "relay_leave", "member": "m", "versions": "1"},
    {"op": "relay_done", "version": "1", "group": "g", "member": "m"},
    {"op": "pieces", "version": 1, "wire": [[0, "float32"]], "timeout_ms": 1000,
     "groups": [[[[0, 0, 0, 0, 64, 96]]]], "chunk_bytes": 1, "chunks": [0]},
    {"op": "pieces", "version": 1, "wire": [[0, "float32"]], "timeout_ms": 1000,
     "groups": [[[[0, 0, 0, 0, 64, 96]]]], "chunk_bytes": 4096, "chunks": [10 ** 6]},
    {"op": "pieces", "version": 1, "wire": [[0, "float32"]], "timeout_ms": 1000,
     "groups": [[[[0, 0, 0, 0, 64, 96]]]], "chunk_bytes": 4096, "chunks": []},
], ids=lambda b: b["op"])
def test_malformed_relay_calls_are_refused_and_the_publisher_serves_on(published, body):
  pub, host = published
  with pytest.raises(ReshardError):
    _call(pub, body)
  assert pub._server._thread.is_alive()
  gen = Mesh(np.array(jax.devices()[4:]), ("y",))
  with jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True) as sub:
    out = sub.pull(NamedSharding(gen, P()), version=1, timeout_s=60, path="network")
  np.testing.assert_array_equal(_bits(out["w"]), _bits(host["w"]))


class Procs(launcher.Procs):
  """Started workers sharing one directory; each with its log file."""

  def __init__(self):
    super().__init__("m2n_relay_")
    self.hosts = None  # EmulatedHosts: the trainer on host 0, subscriber i on i + 1

  def start(self, role, name, *extra):
    argv = [WORKER, "--role", role, "--name", name, "--dir", self.dir,
            "--versions", VERSIONS, "--mib", MIB, *extra]  # later flags win (argparse)
    i = len(self.procs)
    if self.hosts is not None:
      argv += ["--host", self.hosts.address(i)]
    return super().start(name, argv, hosts=self.hosts, host=i)


@pytest.fixture
def procs():
  p = Procs()
  yield p
  p.kill()


def _published(procs, version, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if any(int(f["version"]) >= version for _, f, _ in procs.results("published")):
      return
    if procs.proc("trainer").poll() is not None:
      break
    time.sleep(0.05)
  pytest.fail(f"version {version} was not published in time:\n" + procs.logs())


def test_a_two_process_trainer_job_sends_each_version_once(procs):
  # The trainer a jax.distributed job of 2 processes (1 device each: each serves its
  # own shards); 3 subscribers relay 3 versions: the head asks both trainer processes
  # for its chunks, the others get them from the head's chain.
  port = launcher.free_port()
  for i in range(2):
    procs.start("trainer", f"trainer{i}", "--wait-for", 3, "--period", 0.5,
                "--devices", 1, "--num-processes", 2, "--process-id", i, "--port", port,
                "--versions", 3)
  for name in "abc":
    procs.start("subscriber", name, "--chunk-kib", 256, "--versions", 3)
  procs.wait(["a", "b", "c"], 240)
  open(os.path.join(procs.dir, "done"), "w").close()
  procs.wait(["trainer0", "trainer1"], 60)
  text = procs.logs()
  for name in ("a", "b", "c", "trainer0", "trainer1"):
    assert procs.proc(name).returncode == 0, (name, text)
  pulled = procs.results("pulled")
  assert all(f["ok"] == "1" for _, f, _ in pulled), text
  assert sorted(int(f["version"]) for _, f, _ in pulled) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
  payload = MIB << 20  # two float32 leaves of MIB in all
  for v in (1, 2, 3):
    got = [f for _, f, _ in pulled if f["version"] == str(v)]
    assert sum(int(f["trainer"]) for f in got) == payload, text
    assert sum(int(f["peers"]) for f in got) == 2 * payload, text


_NO_HOSTS = EmulatedHosts.unavailable()


@pytest.mark.skipif(_NO_HOSTS is not None, reason=str(_NO_HOSTS))
def test_a_member_that_leaves_lets_its_child_finish_the_version(procs):
  # Three emulated hosts on 25 Mbit/s links: a pulls version 1 from the trainer and
  # leaves as soon as it has it; b joined a second later, as a's child, and is a chunk
  # or more behind when a leaves. a waits until b says it has the version (the chunks
  # a offered are still in flight when a's own pull returns): b takes none of it from
  # the trainer and never re-routes.
  procs.hosts = EmulatedHosts(3, rate="25mbit").start()
  try:
    procs.start("trainer", "trainer", "--wait-for", 1, "--versions", 1, "--mib", 16)
    procs.start("subscriber", "a", "--chunk-kib", 1024, "--leave-after", 1, "--mib", 16)
    procs.start("subscriber", "b", "--chunk-kib", 1024, "--versions", 1, "--mib", 16,
                "--pull-delay", 1.0)
    procs.wait(["a", "b"], 240)
    open(os.path.join(procs.dir, "done"), "w").close()
    procs.wait(["trainer"], 60)
  finally:
    procs.kill()
    procs.hosts.close()
  text = procs.logs()
  for name in ("a", "b", "trainer"):
    assert procs.proc(name).returncode == 0, (name, text)
  pulled = {name: f for name, f, _ in procs.results("pulled")}
  payload = 16 << 20
  assert pulled["a"]["ok"] == pulled["b"]["ok"] == "1", text
  assert int(pulled["a"]["trainer"]) == payload and procs.results("left"), text
  assert (int(pulled["b"]["trainer"]), int(pulled["b"]["peers"]),
          int(pulled["b"]["reroutes"])) == (0, payload, 0), text


@pytest.mark.parametrize("network", [
    "loopback", pytest.param("hosts", marks=pytest.mark.skipif(
        _NO_HOSTS is not None, reason=str(_NO_HOSTS)))])
def test_joins_leaves_and_deaths_over_versions(procs, network):
  # "hosts": each program on its own emulated host (its own address, a 1 Gbit/s link).
  if network == "hosts":
    procs.hosts = EmulatedHosts(7, rate="1gbit").start()
  try:
    _joins_leaves_and_deaths(procs, 34 if network == "loopback" else 35)
  finally:
    procs.kill()
    if procs.hosts is not None:
      procs.hosts.close()


def _joins_leaves_and_deaths(procs, seed):
  rng = random.Random(int(os.environ.get("JAX_M2N_RELAY_SEED", seed)))
  leave, die, join = rng.randint(1, 3), rng.randint(2, 3), rng.randint(1, 3)
  chunks = rng.randint(1, 6)
  print(f"b leaves after version {leave}; c dies from version {die} once it forwarded "
        f"{chunks} chunk(s); f joins after version {join}")
  procs.start("trainer", "trainer", "--wait-for", 5, "--period", 2.0)
  # a: stays; b: leaves cleanly; c: dies mid-version (once it has forwarded some
  # chunks to a child); d: killed at a random point; e: its own group (bfloat16);
  # f: joins later.
  procs.start("subscriber", "a", "--chunk-kib", 256)
  procs.start("subscriber", "b", "--chunk-kib", 256, "--leave-after", leave)
  procs.start("subscriber", "c", "--chunk-kib", 256, "--die-version", die,
              "--die-chunks", chunks)
  procs.start("subscriber", "d", "--chunk-kib", 256)
  procs.start("subscriber", "e", "--chunk-kib", 256, "--dtype", "bfloat16")
  _published(procs, join)
  procs.start("subscriber", "f", "--chunk-kib", 256)
  _published(procs, 3)
  time.sleep(rng.uniform(0.0, 2.0 * 2))  # a random point within versions 3-4
  open(os.path.join(procs.dir, "gone_d"), "w").close()  # the trainer waits for it no more
  procs.proc("d").send_signal(signal.SIGKILL)
  procs.wait(["d"], 30)
  procs.wait(["a", "b", "c", "e", "f"], 240)
  open(os.path.join(procs.dir, "done"), "w").close()
  procs.wait(["trainer"], 60)
  text = procs.logs()

  pulled = {}
  for name, f, line in procs.results("pulled"):
    assert f["ok"] == "1", line
    pulled.setdefault(name, []).append(int(f["version"]))
  # Every survivor got every version from its first, in order, bitwise (checked by
  # the worker), and exited cleanly.
  for name in ("a", "e"):
    assert pulled.get(name) == list(range(1, VERSIONS + 1)), (name, text)
  assert pulled["f"] == list(range(pulled["f"][0], VERSIONS + 1)) and (
      pulled["f"][0] >= join), text
  for name in ("a", "b", "e", "f", "trainer"):
    assert procs.proc(name).returncode == 0, (name, text)
  # A clean leave.
  assert pulled["b"] == list(range(1, leave + 1)) and procs.results("left"), text
  # c died mid-version (rc 9) and d was killed; the publisher published every version.
  assert procs.proc("c").returncode == 9 and procs.results("dying"), text
  assert procs.proc("d").returncode == -signal.SIGKILL, text
  assert len(procs.results("published")) == VERSIONS, text

  # The trainer sent the float32 group one copy of version 1 (everyone was present:
  # the trainer publishes the next version once every subscriber has this one), and
  # each other member got it from another member.
  payload = 2 * int(re.search(r"trainer=(\d+)", next(
      line for n, f, line in procs.results("pulled") if n == "e")).group(1))
  v1 = [f for n, f, _ in procs.results("pulled") if f["version"] == "1" and n != "e"]
  assert len(v1) in (4, 5) and sum(int(f["trainer"]) for f in v1) == payload, text
  assert sum(int(f["peers"]) for f in v1) == (len(v1) - 1) * payload, text  # (f may
  # have joined in time for version 1)
  # Where c died while forwarding, the member after it re-routed and still got that
  # version bitwise (above).
  dying = procs.results("dying")[0][1]
  if "forwarding" in dying:
    v = dying["version"]
    rerouted = [f for _, f, _ in procs.results("pulled")
                if f["version"] == v and int(f["reroutes"]) > 0]
    assert rerouted, text
    # How long after the death the re-routed member had the version (a measurement,
    # printed; the bench reports it over shaped links).
    recovered = max(float(f["at"]) for f in rerouted) - float(dying["at"])
    print(f"c died forwarding version {v}; the member after it had it "
          f"{recovered:.3f} s later")
  print("\n".join(line for _, _, line in procs.results("pulled") + procs.results("dying")
                  + procs.results("left")))
