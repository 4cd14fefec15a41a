"""The local line (jobs/line.py): a lent pull's confirmation between two programs on
one host over a Unix socket, not the control channel. A request gets its handler's
answer, bound to the connection its one-use ticket was issued for; a bad, reused or
late ticket, a closed server and a failing handler end that connection only; a local
subscriber gets a line and its confirmations count as its pulls (`wait_pulled`),
falling back to the control channel where the line alone failed."""

import socket
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError, VersionGone
from jax_m2n._src.jobs import line, local

TOKEN = "line-test-token-0123456789abcdef"


def test_requests_get_the_handlers_answer_for_the_bound_connection():
  seen = []
  server = line.Server(lambda bound, n: seen.append((bound, n)) or n % 2 == 1)
  try:
    a, b = line.Client(server.name, server.offer("a")), line.Client(server.name,
                                                                    server.offer("b"))
    assert [a.ask(1), b.ask(2), a.ask(3)] == [True, False, True]
    assert seen == [("a", 1), ("b", 2), ("a", 3)]
    a.close()
    b.close()
  finally:
    server.close()


def test_bad_reused_and_late_tickets_are_refused():
  server = line.Server(lambda bound, n: True)
  try:
    ticket = server.offer("a")
    first = line.Client(server.name, ticket)
    assert first.ask(1)
    for bad in (ticket, b"x" * line.TICKET_BYTES):  # used once; unknown
      client = line.Client(server.name, bad)
      with pytest.raises(ReshardRuntimeError, match="closed the line|sending"):
        client.ask(1)  # (its request may meet the closed connection, or its answer)
      assert client.closed
    with pytest.raises(ReshardValueError, match="ticket must be 32 bytes"):
      line.Client(server.name, b"short")
    refused = server.refused
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects, shows nothing
    sock.connect("\0" + server.name)
    deadline = time.monotonic() + 5
    while server.refused == refused and time.monotonic() < deadline:
      time.sleep(0.05)
    assert server.refused == refused + 1  # dropped after CLIENT_S
    assert sock.recv(1) == b""
    sock.close()
    assert first.ask(2)  # the good connection served throughout
    first.close()
  finally:
    server.close()


def test_a_failing_handler_or_a_closed_server_ends_the_connection_only():
  def handler(bound, n):
    if n == 13:
      raise RuntimeError("a bug")
    return True
  server = line.Server(handler)
  a, b = line.Client(server.name, server.offer("a")), line.Client(server.name,
                                                                  server.offer("b"))
  with pytest.raises(ReshardRuntimeError, match="closed the line"):
    a.ask(13)
  assert b.ask(1)
  server.close()
  with pytest.raises(ReshardRuntimeError, match="closed the line|sending"):
    b.ask(2)
  with pytest.raises(ReshardRuntimeError, match="must be reachable"):
    line.Client(server.name, b"y" * line.TICKET_BYTES)


def test_a_local_subscribers_confirmations_take_the_line(monkeypatch):
  devs = np.array(jax.devices())
  trainer, gen = Mesh(devs[:4], ("a",)), Mesh(devs[4:], ("x",))
  mk = lambda v: {"x": jax.device_put(np.full((8, 8), v, np.float32),  # noqa: E731
                                      NamedSharding(trainer, P("a")))}
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(mk(1))
    sub.pull(NamedSharding(gen, P()), path="local")
    (key, imp), = sub._state.imports.items()
    assert imp.line is not None and not imp.line.closed
    pub.publish(mk(2))
    pub.publish(mk(3))  # version 1 dropped (keep=2)
    assert imp.line.ask(3) and not imp.line.ask(1)
    assert pub.wait_pulled(3, 1, timeout_s=5) == 1  # counted as that connection's pull
    [peer] = pub.stats().peers
    assert peer.version == 3 and peer.last_op == "pulled"
    # local.confirm (a lent version's, as on GPUs) takes the line: no control call.
    monkeypatch.setattr(local.Import, "lent", lambda self, slot: True)
    root = sub._state.connections.root()
    pull = type("P", (), {})()
    pull.number, pull.links = 3, {key[0]: type("L", (), {"client": root})()}
    calls = root.stats["calls"]
    local.confirm(pull, {key[0]: imp}, {key[0]: 0}, 1.0)
    assert root.stats["calls"] == calls
    pull.number = 1
    with pytest.raises(VersionGone):
      local.confirm(pull, {key[0]: imp}, {key[0]: 0}, 1.0)
    # The line alone gone (the publisher runs): the control channel confirms.
    pub._service._line.close()
    pull.number = 3
    local.confirm(pull, {key[0]: imp}, {key[0]: 0}, 1.0)
    assert imp.line is None and root.stats["calls"] == calls + 1
