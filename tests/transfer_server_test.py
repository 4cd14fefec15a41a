"""JAX's transfer server as jax_m2n drives it (jax_m2n/_src/transfer_server.py), in one
process: a server on 127.0.0.1 offers CPU arrays that another server's connection pulls
onto another device, bitwise; an offer is taken once; cancel fails a pending pull.
Fails loudly when a JAX upgrade changes one of the behaviours the module papers over.
"""

import doctest
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_m2n._src import transfer_server  # noqa: E402

# Every wait here is bounded by this (a pull between two servers of one process takes
# well under a second).
WAIT_S = 30.0


def _spec(x, device):
  return jax.ShapeDtypeStruct(x.shape, x.dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def _ready(arrays, timeout_s=WAIT_S):
  """Whether every array became ready within timeout_s."""
  deadline = time.monotonic() + timeout_s
  while not all(a.is_ready() for a in arrays):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


@pytest.fixture(scope="module")
def servers():
  return transfer_server.start("127.0.0.1"), transfer_server.start("127.0.0.1")


def test_start_binds_the_host_given(servers):
  sender, receiver = servers
  for server in servers:
    host, _, port = server.address().rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
  assert sender.address() != receiver.address()


def test_bind_address_brackets_ipv6():
  assert transfer_server.bind_address("10.0.0.2", 7) == "10.0.0.2:7"
  assert transfer_server.bind_address("::1") == "[::1]:0"


def test_offer_then_pull_between_two_devices_is_bitwise(servers):
  sender, receiver = servers
  src, dst = jax.devices()[0], jax.devices()[1]
  xs = [jax.device_put(np.arange(24, dtype=np.float32).reshape(4, 6), src),
        jax.device_put(np.array([1, -2, 3], np.int8), src)]
  transfer_server.await_pull(sender, 101, xs, time.monotonic() + WAIT_S)
  conn = transfer_server.connect(receiver, sender.address())
  ys = transfer_server.pull(conn, 101, [_spec(x, dst) for x in xs],
                            deadline=time.monotonic() + WAIT_S)
  assert _ready(ys)
  for x, y in zip(xs, ys):
    assert y.devices() == {dst}
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_cancel_fails_a_pending_pull(servers):
  # Nobody offers this uuid: the pull stays pending until the connection is cancelled,
  # then fails at once.
  sender, receiver = servers
  dev = jax.devices()[2]
  conn = transfer_server.connect(receiver, sender.address())
  (pending,) = transfer_server.pull(
      conn, 202, [jax.ShapeDtypeStruct((4,), np.float32,
                                       sharding=jax.sharding.SingleDeviceSharding(dev))])
  assert not _ready([pending], timeout_s=0.5)
  transfer_server.cancel(conn)
  assert _ready([pending])
  with pytest.raises(Exception):
    pending.block_until_ready()


def test_an_offer_is_taken_once(servers):
  # The second pull of one uuid finds no offer: it stays pending (then cancelled).
  sender, receiver = servers
  dev = jax.devices()[3]
  x = jax.device_put(np.ones(8, np.float32), jax.devices()[0])
  transfer_server.await_pull(sender, 303, [x], time.monotonic() + WAIT_S)
  conn = transfer_server.connect(receiver, sender.address())
  (first,) = transfer_server.pull(conn, 303, [_spec(x, dev)])
  assert _ready([first])
  np.testing.assert_array_equal(np.asarray(first), np.ones(8, np.float32))
  (second,) = transfer_server.pull(conn, 303, [_spec(x, dev)])
  assert not _ready([second], timeout_s=0.5)
  transfer_server.cancel(conn)
  with pytest.raises(Exception):
    second.block_until_ready()


def test_module_doctests():
  result = doctest.testmod(transfer_server, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
