"""A Publisher and a Subscriber free everything they hold: ports, threads, file
descriptors, offers and buffers, whether closed by close(), by leaving a `with` block
(also through an exception) or by garbage collection of the last reference (no thread
refers back to them; weakref.finalize closes). 50 of each made and closed in one
process leave the fd count, the thread count and the RSS flat (after a warm-up that
fills the bounded caches: compiled copies, plans, requests). A subscriber that asks
for pieces and never fetches them leaves one pull's offers per plan, withdrawn with
their version."""

import gc
import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n

TOKEN = "lifecycle-test-token-0123456789"
RSS_SLACK = 4 << 20  # allocator noise over 50 rounds once the caches are full


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _counts():
  gc.collect()
  return len(os.listdir("/proc/self/fd")), threading.active_count(), _rss()


@pytest.fixture(scope="module")
def case():
  devs = jax.devices()
  x = jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64),
                     NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x")))
  return x, NamedSharding(Mesh(np.array(devs[4:]), ("y",)), P(None, "y"))


def _closed(x, dst, path):
  pub = jax_m2n.Publisher(token=TOKEN)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  pub.publish({"x": x})
  out = sub.pull(dst, version=1, path=path)
  sub.close()
  pub.close()
  return out


def _with_an_exception(x, dst, path):
  with pytest.raises(KeyError):
    with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
        pub.address, token=TOKEN) as sub:
      pub.publish({"x": x})
      sub.pull(dst, version=1, path=path)
      raise KeyError("the caller's own error")


def _dropped(x, dst, path):
  pub = jax_m2n.Publisher(token=TOKEN)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  pub.publish({"x": x})
  return sub.pull(dst, version=1, path=path)  # both go with this frame


@pytest.mark.parametrize("path", ["local", "network"])
def test_fifty_made_and_closed_leave_fds_threads_and_rss_flat(case, path):
  x, dst = case
  for _ in range(30):  # warm-up: compiled copies, plan and request caches fill
    _closed(x, dst, path)
  fds, threads, rss = _counts()
  for _ in range(50):
    out = _closed(x, dst, path)
  np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
  del out
  fds_after, threads_after, rss_after = _counts()
  assert (fds_after, threads_after) == (fds, threads)
  assert rss_after - rss <= RSS_SLACK, (rss >> 20, rss_after >> 20)


@pytest.mark.parametrize("how", [_with_an_exception, _dropped])
def test_an_exception_in_with_and_garbage_collection_close_too(case, how):
  x, dst = case
  for _ in range(3):
    how(x, dst, "network")
  fds, threads, _ = _counts()
  for _ in range(20):
    how(x, dst, "network")
  assert _counts()[:2] == (fds, threads)


def test_unfetched_offers_are_one_pull_per_plan_and_go_with_their_version(case,
                                                                          monkeypatch):
  # A subscriber that asks for its pieces and never fetches them (a client that went
  # away, or a hostile one) leaves on the publisher one pull's offers per plan,
  # however often it asks, and none once their version is dropped.
  from jax_m2n._src.jobs import engine
  x, dst = case
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  try:
    pub.publish({"x": x})
    grabbed = []
    run = engine.run
    monkeypatch.setattr(engine, "run",
                        lambda pull, *a, **k: grabbed.append(pull) or run(pull, *a, **k))
    sub.pull({"x": dst}, path="network")
    monkeypatch.setattr(engine, "run", run)
    pull, transport = grabbed[0], pub._transport

    def held(want):  # (offers, bytes) once they are `want`, or after 10 s
      deadline = time.monotonic() + 10  # (withdrawals and sends finish on threads)
      while transport.held != want and time.monotonic() < deadline:
        time.sleep(0.01)
      return transport.held

    _, opened = engine.request(pull, 10.0)
    engine.confirm(pull, opened, 10.0)
    deadline = time.monotonic() + 10
    while transport.held[1] > x.nbytes and time.monotonic() < deadline:
      time.sleep(0.01)  # the first pull's replies still going out
    one = transport.held
    assert one[0] >= 1 and one[1] == x.nbytes, one
    for _ in range(10):
      _, opened = engine.request(pull, 10.0)
      engine.confirm(pull, opened, 10.0)
    assert held(one) == one
    time.sleep(0.2)  # nothing more arrives late
    assert transport.held == one
    pub.publish({"x": x + 1})
    pub.publish({"x": x + 2})  # version 1 dropped (keep=2): its offers withdrawn
    assert held((0, 0)) == (0, 0)
    got = sub.pull({"x": dst}, path="network")
    np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(x + 2))
  finally:
    sub.close()
    pub.close()
