"""`publish(..., lend=True)` and `wait_pulled` where no GPU is (CPU, as on CI): lending
is accepted and behaves as a snapshot (XLA's CPU buffers cannot be shared; the memfd
slots are the snapshot), bitwise on both paths, and says so in the stats; the caller
may delete its arrays at once; `wait_pulled` counts the subscribers that said they
pulled (local and network), times out naming the count, and refuses bad arguments;
`jobs status` shows the version a local subscriber last pulled; the device bytes held
are reported per device. The GPU side (XLA's allocations lent by fd) is
tests/gpu_lend_test.py."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.errors import ReshardTimeoutError, ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import status

TOKEN = "lend-test-token-0123456789"


@pytest.fixture(scope="module")
def meshes():
  devs = np.array(jax.devices())
  return Mesh(devs[:4], ("x",)), Mesh(devs[4:], ("y",))


def _tree(mesh, seed):
  rng = np.random.default_rng(seed)
  host = {"w": rng.standard_normal((8, 12)).astype(np.float32),
          "b": rng.integers(0, 100, (4,)).astype(np.int32)}
  tree = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("x"))),
          "b": jax.device_put(host["b"], NamedSharding(mesh, P()))}
  return host, tree


@pytest.mark.parametrize("path", ["local", "network"])
def test_lend_on_cpu_is_a_snapshot_bitwise(meshes, path):
  trainer, gen = meshes
  with jax_m2n.Publisher(token=TOKEN, keep=1) as pub, \
      jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    for v in (1, 2, 3):
      host, tree = _tree(trainer, v)
      assert pub.publish(tree, lend=True) == v
      for x in tree.values():  # a snapshot: the caller's arrays may go at once
        x.delete()
      out = sub.pull({"w": NamedSharding(gen, P(None, "y")),
                      "b": NamedSharding(gen, P("y"))}, path=path)
      assert sub.version == v and sub.last_pull.path == path
      for k in host:
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])
    s = pub.stats()
    assert [h.held_as for h in s.versions] == [
        "snapshot (CPU: XLA's CPU buffers cannot be shared)"]
    assert s.lent_allocations == 0 and s.lent_allocation_bytes == 0
    # CPU: the snapshot is the export's slots, counted per device.
    assert set(s.device_bytes) == {str(d) for d in trainer.devices.flat}
    assert sum(s.device_bytes.values()) >= s.held_bytes


def test_wait_pulled_counts_the_subscribers_that_pulled(meshes):
  trainer, gen = meshes
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, \
      jax_m2n.Subscriber(pub.address, token=TOKEN) as local_sub, \
      jax_m2n.Subscriber(pub.address, token=TOKEN) as net_sub:
    _, tree = _tree(trainer, 0)
    v = pub.publish(tree, lend=True)
    with pytest.raises(ReshardTimeoutError, match="0 did"):
      pub.wait_pulled(v, 1, timeout_s=0.2)
    dst = {"w": NamedSharding(gen, P()), "b": NamedSharding(gen, P())}
    local_sub.pull(dst, path="local")
    net_sub.pull(dst, path="network")
    assert pub.wait_pulled(v, 2, timeout_s=10) == 2
    assert pub.wait_pulled(v, 0) >= 0
    # A pull that ends while the trainer waits wakes it.
    v2 = pub.publish(_tree(trainer, 1)[1])
    got = []
    waiter = threading.Thread(target=lambda: got.append(pub.wait_pulled(v2, 1, 30)))
    waiter.start()
    local_sub.pull(dst, path="local")
    waiter.join(30)
    assert got == [1]


def test_wait_pulled_and_lend_refuse_bad_arguments(meshes):
  trainer, _ = meshes
  with jax_m2n.Publisher(token=TOKEN) as pub:
    _, tree = _tree(trainer, 0)
    with pytest.raises(ReshardTypeError, match="lend must be a bool"):
      pub.publish(tree, lend="yes")
    with pytest.raises(ReshardValueError, match="version must be one published"):
      pub.wait_pulled(1, 1)
    pub.publish(tree)
    with pytest.raises(ReshardValueError, match="n must be an int >= 0"):
      pub.wait_pulled(1, -1)
  for bad in (0.5, "2", True):
    with pytest.raises(ReshardValueError, match="lend_limit must be None or a number"):
      jax_m2n.Publisher(token=TOKEN, lend_limit=bad)


def test_status_shows_the_version_a_local_subscriber_pulled(meshes):
  """The subscriber says so after its pull: a local pull asks nothing after the copy,
  and `jobs status` showed the version it asked about before (0 for a first pull)."""
  trainer, gen = meshes
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, \
      jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    for seed in range(3):
      pub.publish(_tree(trainer, seed)[1])
    sub.pull({"w": NamedSharding(gen, P()), "b": NamedSharding(gen, P())}, path="local")
    assert sub.version == 3
    pub.wait_pulled(3, 1, timeout_s=10)  # (the word is sent, not awaited)
    reply = status.ask(pub.address, TOKEN)
    [peer] = [p for p in reply["stats"]["peers"]]
    assert peer["version"] == 3
    text = status.summary(reply)
    assert "version 3, last call pulled" in text
    assert "device memory held for weight sync" in text
