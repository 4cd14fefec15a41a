"""The "net" transport (jax_m2n/_src/jobs/net/). In this process, between two
NetTransports on different CPU devices: every wire dtype, ranks 0-4, several arrays per
offer, bitwise; tickets given and random; a fetch before its offer waits and is served;
cancel, expiry, one fetch per offer, the bounds on offers, a wrong spec, forget().
Strangers at the serving port (random bytes, mutated ZMTP greetings, a huge declared
frame, half-open connections, 1,000 junk requests): the process lives, its memory stays
flat and a fetch works after. CurveZMQ: bitwise with the keys, nothing and a bounded
failure without them. Across processes (tests/jobs_net_worker.py): 64 MiB bitwise, and
a serving process killed mid-transfer fails the fetch within 2 s, naming the address.
Every launch and wait is bounded; every process is killed at the end."""

import os
import socket
import sys
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)
from jax_m2n._src.jobs import manifest, net, transports
from jax_m2n._src.jobs.net import curve, offers, wire

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import jobs_net_worker  # noqa: E402  (the worker's values: both sides agree on them)

SHAPES = [(), (5,), (3, 4), (2, 1, 3), (1, 2, 3, 2), (0, 3)]


def _spec(shape, dtype, device):
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def _random(rng, shape, dtype):
  """Random bits of `dtype` (NaN payloads, denormals and all)."""
  dtype = np.dtype(jax.numpy.dtype(dtype))
  n = int(np.prod(shape)) * dtype.itemsize
  raw = rng.integers(0, 256, n, dtype=np.uint8)
  if dtype == np.bool_:
    raw &= 1
  return raw.view(dtype).reshape(shape)


def _bits(a):
  a = np.asarray(a)
  return a.reshape(-1).view(np.uint8)


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def pair():
  a, b = net.NetTransport("127.0.0.1"), net.NetTransport("127.0.0.1")
  yield a, b
  a._close()  # pylint: disable=protected-access
  b._close()  # pylint: disable=protected-access


def _offer(a, rng, dtype, ticket=None):
  host = [_random(rng, s, dtype) for s in SHAPES]
  arrays = [jax.device_put(x, jax.devices()[0]) for x in host]
  return host, a.offer(arrays, 30.0, ticket=ticket)


@pytest.fixture
def x64():
  """64-bit dtypes exist as jax.Arrays only under jax_enable_x64 (global: the
  transport's threads see it too); restored after the test."""
  was = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", was)


@pytest.mark.parametrize("dtype", manifest.DTYPES)
def test_every_dtype_and_rank_bitwise(pair, dtype, x64):
  a, b = pair
  rng = np.random.default_rng(len(dtype))
  devices = jax.devices()
  for given_ticket in (None, int(rng.integers(0, 1 << 63)) * 2 + 1):
    host, ticket = _offer(a, rng, dtype, given_ticket)
    if given_ticket is not None:
      assert ticket == given_ticket
    specs = [_spec(x.shape, x.dtype, devices[1 + i % (len(devices) - 1)])
             for i, x in enumerate(host)]
    got = b.fetch(a.address, ticket, specs).result()
    for x, y, s in zip(host, got, specs):
      assert y.shape == x.shape and y.dtype == x.dtype
      assert y.devices() == s.sharding.device_set
      np.testing.assert_array_equal(_bits(y), _bits(x))


def test_a_fetch_before_its_offer_waits_and_is_served(pair):
  a, b = pair
  x = np.arange(1000, dtype=np.float32)
  f = b.fetch(a.address, 77, [_spec(x.shape, x.dtype, jax.devices()[2])])
  time.sleep(0.3)
  assert not f.done()
  a.offer([jax.device_put(x, jax.devices()[0])], 10.0, ticket=77)
  np.testing.assert_array_equal(np.asarray(f.result()[0]), x)


def test_many_fetches_before_their_offers_from_several_threads(pair):
  """A relay's pattern: every chunk fetched at once, offered as it arrives upstream
  (here in random order, from several threads; some large enough to be chunked)."""
  a, b = pair
  rng = np.random.default_rng(7)
  sizes = [int(rng.integers(1, 1 << 12)) for _ in range(200)] + [(wire.INLINE_BYTES + 5)] \
      + [wire.CHUNK_BYTES * 2 + 3]
  host = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
  tickets = [int(t) for t in rng.choice(1 << 40, len(sizes), replace=False) + 5000]
  fetches = [b.fetch(a.address, t, [_spec(x.shape, x.dtype, jax.devices()[4])],
                     timeout_s=30.0) for t, x in zip(tickets, host)]
  order = rng.permutation(len(sizes))
  def offer(part):
    for i in part:
      a.offer([jax.device_put(host[i], jax.devices()[0])], 30.0, ticket=tickets[i])
  threads = [threading.Thread(target=offer, args=(order[k::3],)) for k in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30.0)
  for f, x in zip(fetches, host):
    np.testing.assert_array_equal(np.asarray(f.result()[0]), x)


def test_one_fetch_per_offer_then_it_is_gone(pair):
  a, b = pair
  x = np.arange(10, dtype=np.int32)
  spec = [_spec(x.shape, x.dtype, jax.devices()[1])]
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  np.testing.assert_array_equal(np.asarray(b.fetch(a.address, ticket, spec).result()[0]), x)
  with pytest.raises(ReshardTimeoutError, match="not offered within"):
    b.fetch(a.address, ticket, spec, timeout_s=0.2).result()
  assert a.held == (0, 0)


def test_cancel_withdraws_an_offer_and_answers_its_waiters(pair):
  a, b = pair
  x = np.arange(10, dtype=np.int32)
  spec = [_spec(x.shape, x.dtype, jax.devices()[1])]
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  assert a.cancel(ticket) and not a.cancel(ticket)
  with pytest.raises(ReshardTimeoutError):
    b.fetch(a.address, ticket, spec, timeout_s=0.2).result()
  waiting = b.fetch(a.address, 991, spec)
  time.sleep(0.2)
  assert not a.cancel(991)  # nothing offered: the waiter is answered all the same
  with pytest.raises(ReshardRuntimeError, match="withdrawn"):
    waiting.result()


def test_offers_expire(pair, monkeypatch):
  a, b = pair
  monkeypatch.setattr(offers, "OFFER_GRACE_S", 0.1)
  x = np.arange(10, dtype=np.int32)
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 0.1)
  assert a.held[0] >= 1
  time.sleep(0.8)
  assert a.held == (0, 0)
  with pytest.raises(ReshardTimeoutError):
    b.fetch(a.address, ticket, [_spec(x.shape, x.dtype, jax.devices()[1])],
            timeout_s=0.1).result()


def test_the_bounds_on_offers_and_a_duplicate_ticket():
  t = net.NetTransport("127.0.0.1", max_offers=2, max_offer_bytes=1000)
  try:
    x = jax.device_put(np.zeros(100, np.uint8), jax.devices()[0])
    t.offer([x], 10.0, ticket=1)
    with pytest.raises(ReshardValueError, match="offered already"):
      t.offer([x], 10.0, ticket=1)
    t.offer([x], 10.0)
    with pytest.raises(ReshardRuntimeError, match="max_offers=2"):
      t.offer([x], 10.0)
    t.cancel(1)
    with pytest.raises(ReshardRuntimeError, match="max_offer_bytes=1000"):
      t.offer([jax.device_put(np.zeros(901, np.uint8), jax.devices()[0])], 10.0)
  finally:
    t._close()  # pylint: disable=protected-access


def test_a_wrong_spec_fails_clearly(pair):
  a, b = pair
  x = np.arange(12, dtype=np.float32)
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  with pytest.raises(ReshardValueError, match=f"from the peer at {a.address}.*"
                     r"must be the specs' sizes \[24\] bytes.*got \[48\]"):
    b.fetch(a.address, ticket, [_spec((12,), np.float16, jax.devices()[1])]).result()
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  with pytest.raises(ReshardValueError, match="specs' sizes"):
    b.fetch(a.address, ticket, [_spec((6,), np.float32, jax.devices()[1])] * 2).result()
  with pytest.raises(ReshardValueError, match="SingleDeviceSharding"):
    b.fetch(a.address, ticket, [jax.ShapeDtypeStruct((12,), np.float32)])


def test_forget_fails_pending_fetches_at_once(pair):
  a, b = pair
  f = b.fetch(a.address, 4242, [_spec((3,), np.float32, jax.devices()[1])])
  time.sleep(0.1)
  b.forget(a.address)
  assert f.done()
  with pytest.raises(ReshardRuntimeError, match=f"from {a.address}.*forgotten"):
    f.result()
  x = np.arange(3, dtype=np.float32)  # the next fetch connects anew
  ticket = a.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  np.testing.assert_array_equal(
      np.asarray(b.fetch(a.address, ticket, [_spec((3,), np.float32, jax.devices()[1])])
                 .result()[0]), x)


def test_close_frees_every_port_thread_and_fd():
  def fds():
    return len(os.listdir("/proc/self/fd"))
  x = jax.device_put(np.arange(1 << 16, dtype=np.uint8), jax.devices()[0])
  spec = [_spec(x.shape, x.dtype, jax.devices()[1])]
  counts = []
  for i in range(12):
    keys = net.CurveKeys.generate() if i % 2 else None
    a = transports.acquire("127.0.0.1", "net", curve=keys)
    b = net.NetTransport("127.0.0.1", curve=keys)
    ticket = a.offer([x], 10.0)
    b.fetch(a.address, ticket, spec).result()
    a.offer([x], 10.0)  # an offer left behind: dropped at close
    address = a.address
    transports.release(a)
    b._close()  # pylint: disable=protected-access
    counts.append((fds(), threading.active_count()))
    with pytest.raises(OSError):  # nothing listens there any more
      host, port = address.rsplit(":", 1)
      socket.create_connection((host, int(port)), timeout=1.0).close()
  assert counts[-1] == counts[1], counts


def test_acquire_shares_equal_arguments():
  keys = net.CurveKeys.generate()
  t1 = transports.acquire("127.0.0.1", "net")
  t2 = transports.acquire("127.0.0.1", "net")
  t3 = transports.acquire("127.0.0.1", "net", curve=keys)
  t4 = transports.acquire("127.0.0.1", "net", curve=net.CurveKeys(
      keys.server_secret, keys.server_public, keys.client_secret, keys.client_public))
  try:
    assert t1 is t2 and t3 is t4 and t1 is not t3
    with pytest.raises(ReshardValueError, match="kind must be one of"):
      transports.acquire("127.0.0.1", "carrier_pigeon")
  finally:
    for t in (t1, t2, t3, t4):
      transports.release(t)


# ---------------------------------------------------------------------------------------
# Strangers at the serving port
# ---------------------------------------------------------------------------------------

def _greeting(mechanism=b"NULL", major=3, minor=0):
  return (b"\xff" + b"\0" * 8 + b"\x7f" + bytes([major, minor])
          + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31)


def _ready(socket_type=b"DEALER"):
  body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") \
      + socket_type
  return b"\x04" + bytes([len(body)]) + body


def _send_raw(address, data, hold_s=0.0):
  host, port = address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=2.0) as s:
    try:
      s.sendall(data)
      if hold_s:
        time.sleep(hold_s)
    except OSError:
      pass  # the server closed on us: that is its right


def _fetch_works(server, client):
  x = np.arange(4096, dtype=np.uint8)
  ticket = server.offer([jax.device_put(x, jax.devices()[0])], 10.0)
  f = client.fetch(server.address, ticket, [_spec(x.shape, x.dtype, jax.devices()[1])])
  deadline = time.monotonic() + 10.0
  while not f.done() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert f.done(), "a legitimate fetch got no answer within 10 s"
  np.testing.assert_array_equal(np.asarray(f.result()[0]), x)


@pytest.fixture(scope="module")
def victim():
  """A serving transport the stranger tests attack, and a legitimate client."""
  a, b = net.NetTransport("127.0.0.1"), net.NetTransport("127.0.0.1")
  _fetch_works(a, b)
  yield a, b, _rss()
  _fetch_works(a, b)
  a._close()  # pylint: disable=protected-access
  b._close()  # pylint: disable=protected-access


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=4096),
    st.binary(min_size=1, max_size=200).map(lambda b: _greeting() + _ready() + b),
    st.tuples(st.integers(0, 63), st.integers(0, 255)).map(
        lambda iv: bytes(c if i != iv[0] else iv[1]
                         for i, c in enumerate(_greeting())) + _ready())))
def test_random_and_mutated_bytes_leave_the_server_serving(victim, data):
  a, _, _ = victim
  _send_raw(a.address, data)


def test_strangers_cannot_hurt_the_server(victim):
  a, b, rss0 = victim
  # Garbage greetings: other versions and mechanisms, a ROUTER-less socket type.
  for g in (_greeting(b"CURVE"), _greeting(b"PLAIN"), _greeting(major=9),
            _greeting(major=1), _greeting() + _ready(b"PUB"), b"\xff" * 64):
    _send_raw(a.address, g + b"\0" * 64)
  # A frame, and a handshake command, declaring 1 TiB (zmq refuses frames over 64 KiB
  # before allocating).
  _send_raw(a.address, _greeting() + _ready() + b"\x02" + (1 << 40).to_bytes(8, "big")
            + b"\0" * 4096)
  _send_raw(a.address, _greeting() + b"\x06" + (1 << 40).to_bytes(8, "big")
            + b"\x05READY" + b"\0" * 4096)
  # Half-open connections held while a legitimate fetch runs.
  host, port = a.address.rsplit(":", 1)
  idle = [socket.create_connection((host, int(port)), timeout=2.0) for _ in range(20)]
  try:
    _fetch_works(a, b)
  finally:
    for s in idle:
      s.close()
  # 1,000 junk requests through a real zmq socket: wrong sizes, wrong magic, several
  # frames, and well-formed requests for unknown tickets (those wait, bounded).
  zmq = wire.zmq_module()
  ctx = zmq.Context()
  s = ctx.socket(zmq.DEALER)
  s.setsockopt(zmq.LINGER, 0)
  s.connect(f"tcp://{a.address}")
  rng = np.random.default_rng(0)
  dropped = a.counters["dropped"]
  for i in range(1000):
    kind = i % 4
    if kind == 0:
      s.send(rng.bytes(int(rng.integers(0, 100))))
    elif kind == 1:
      s.send(b"XXXX" + rng.bytes(wire.REQUEST.size - 4))
    elif kind == 2:
      s.send_multipart([wire.REQUEST.pack(wire.REQUEST_MAGIC, 1, 2, 3), b"more"])
    else:
      s.send(wire.REQUEST.pack(wire.REQUEST_MAGIC, int(rng.integers(0, 1 << 62)), i, 100))
  deadline = time.monotonic() + 10.0
  while a.counters["dropped"] - dropped < 750 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert a.counters["dropped"] - dropped == 750
  replies = 0  # the well-formed ones are answered: not offered within their wait
  while s.poll(2000) and replies < 250:
    head = s.recv()
    assert wire.HEAD.unpack(head)[2] == wire.EXPIRED
    replies += 1
  assert replies == 250
  s.close(0)
  ctx.term()
  _fetch_works(a, b)
  grown = _rss() - rss0
  assert grown < 8 << 20, f"the server's process grew by {grown >> 20} MiB"


# ---------------------------------------------------------------------------------------
# CurveZMQ
# ---------------------------------------------------------------------------------------

def test_curve_keys_encrypt_and_keep_strangers_out():
  keys = net.CurveKeys.generate()
  other = net.CurveKeys.generate()
  server = net.NetTransport("127.0.0.1", curve=keys)
  client = net.NetTransport("127.0.0.1", curve=keys)
  wrong_client = net.NetTransport("127.0.0.1", curve=net.CurveKeys(
      keys.server_secret, keys.server_public, other.client_secret, other.client_public))
  wrong_server_key = net.NetTransport("127.0.0.1", curve=net.CurveKeys(
      other.server_secret, other.server_public, keys.client_secret, keys.client_public))
  plain = net.NetTransport("127.0.0.1")
  try:
    x = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    spec = [_spec(x.shape, x.dtype, jax.devices()[1])]
    ticket = server.offer([jax.device_put(x, jax.devices()[0])], 10.0)
    for stranger in (wrong_client, wrong_server_key, plain):
      started = time.monotonic()
      with pytest.raises(ReshardRuntimeError, match=f"peer at {server.address}"):
        stranger.fetch(server.address, ticket, spec).result()
      assert time.monotonic() - started < wire.HANDSHAKE_S + 2.0
    assert server.counters["refused"] >= 1  # the wrong client key, refused by the ZAP handler
    got = client.fetch(server.address, ticket, spec).result()  # the offer is intact
    np.testing.assert_array_equal(np.asarray(got[0]), x)
  finally:
    for t in (server, client, wrong_client, wrong_server_key, plain):
      t._close()  # pylint: disable=protected-access


def test_curve_keys_are_checked():
  keys = net.CurveKeys.generate()
  with pytest.raises(ReshardValueError, match="public key of server_secret"):
    net.CurveKeys(keys.server_secret, keys.client_public, keys.client_secret,
                  keys.client_public)
  with pytest.raises(ReshardValueError, match="40 z85 characters or 32 raw bytes"):
    net.CurveKeys(b"short", keys.server_public, keys.client_secret, keys.client_public)
  raw = net.CurveKeys.from_secrets(b"s" * 32, b"c" * 32)
  assert raw == net.CurveKeys.from_secrets(raw.server_secret.decode(),
                                           raw.client_secret.decode())
  assert "secret" not in repr(raw)


# ---------------------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------------------

def _worker():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the serving process inherits it
  return jobs_net_worker.Worker()


class _SlowLink:
  """A TCP relay to `upstream` that carries the bytes towards the client at `rate`
  B/s: a transfer that lasts long enough to kill its sender in the middle."""

  def __init__(self, upstream, rate):
    self._upstream, self._rate = upstream, rate
    self.carried = 0
    self._listen = socket.create_server(("127.0.0.1", 0))
    self._listen.settimeout(10.0)
    self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    try:
      down, _ = self._listen.accept()
    except OSError:
      return
    host, port = self._upstream.rsplit(":", 1)
    up = socket.create_connection((host, int(port)), timeout=10.0)
    for s in (up, down):
      s.settimeout(30.0)
    threading.Thread(target=self._pump, args=(down, up, 0), daemon=True).start()
    self._pump(up, down, self._rate)

  def _pump(self, src, dst, rate):
    try:
      while True:
        data = src.recv(1 << 16)
        if not data:
          break
        dst.sendall(data)
        if rate:
          self.carried += len(data)
          time.sleep(len(data) / rate)
    except OSError:
      pass
    for s in (src, dst):  # one side gone: the other learns it at once
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      s.close()

  def close(self):
    self._listen.close()


@pytest.fixture(scope="module")
def worker():
  w = _worker()
  yield w
  w.kill()


def test_64_mib_across_processes_bitwise(worker):
  b = net.NetTransport("127.0.0.1")
  try:
    n = 64 << 20
    worker.offer(5, n, 3)
    got = b.fetch(worker.address, 5, [_spec((n,), np.uint8, jax.devices()[3])]).result()
    np.testing.assert_array_equal(np.asarray(got[0]), jobs_net_worker.values(n, 3))
  finally:
    b._close()  # pylint: disable=protected-access


def test_a_peer_killed_mid_transfer_fails_the_fetch_within_2s():
  w = _worker()
  b = net.NetTransport("127.0.0.1")
  link = _SlowLink(w.address, rate=8 << 20)
  try:
    n = 64 << 20
    w.offer(9, n, 1)
    f = b.fetch(link.address, 9, [_spec((n,), np.uint8, jax.devices()[1])])
    deadline = time.monotonic() + 20.0
    while link.carried < 4 << 20 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert 4 << 20 <= link.carried < n, "the transfer must be under way"
    w.kill()
    killed = time.monotonic()
    while not f.done() and time.monotonic() < killed + 10.0:
      time.sleep(0.01)
    assert f.done() and time.monotonic() - killed < 2.0
    with pytest.raises(ReshardRuntimeError, match=f"peer at {link.address}.*closed"):
      f.result()
  finally:
    w.kill()
    link.close()
    b._close()  # pylint: disable=protected-access


def test_a_peer_killed_while_a_fetch_waits_fails_it_within_2s():
  w = _worker()
  b = net.NetTransport("127.0.0.1")
  try:
    f = b.fetch(w.address, 123, [_spec((8,), np.uint8, jax.devices()[1])])
    time.sleep(0.5)
    assert not f.done()
    w.kill()
    killed = time.monotonic()
    while not f.done() and time.monotonic() < killed + 10.0:
      time.sleep(0.01)
    assert time.monotonic() - killed < 2.0
    with pytest.raises(ReshardRuntimeError, match=f"peer at {w.address}"):
      f.result()
  finally:
    w.kill()
    b._close()  # pylint: disable=protected-access


@pytest.mark.parametrize("module", [net, curve], ids=["net", "curve"])
def test_the_docstring_examples_run(module):
  import doctest  # pylint: disable=import-outside-toplevel
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
