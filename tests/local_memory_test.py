"""Host segments and fd passing (jax_m2n/_src/local_memory.py), with no JAX device work.

- A segment round-trips through a read-only fd; the reader cannot write or map more
  than exists; closing with live views is refused.
- FdServer: a ticket is good once; unknown, expired, revoked, oversized and garbage
  requests are refused and the server keeps serving; a silent client does not hold up
  another; close() leaves no socket behind.
- kill -9 of the publisher while a reader maps its segment: the reader still reads what
  was written, and nothing is left in /dev/shm, the file system or the socket table; the
  same when the reader is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError
from jax_m2n._src.local_memory import (MAX_REQUEST_BYTES, TICKET_BYTES, FdServer, Segment,
                                       fetch_fd)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import local_worker  # noqa: E402


def _abstract_sockets() -> set[str]:
  """Names of the abstract Unix sockets bound on this host (network namespace)."""
  with open("/proc/net/unix") as f:
    return {line.split()[-1][1:] for line in f.readlines()[1:]
            if len(line.split()) >= 8 and line.split()[-1].startswith("@")}


def _shm() -> set[str]:
  return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _memfd_maps() -> int:
  with open("/proc/self/maps") as f:
    return sum("memfd:jax_m2n" in line for line in f)


def test_segment_round_trip_read_only():
  with Segment.create(8192) as seg:
    seg.array[:] = np.arange(8192) % 256
    with Segment.open(seg.read_only_fd(), 8192) as reader:
      assert np.array_equal(reader.array, seg.array)
      seg.array[5] = 99  # the same pages
      assert reader.array[5] == 99
      with pytest.raises(ValueError):
        reader.array[0] = 1
    with pytest.raises(ReshardValueError, match="at least nbytes"):
      Segment.open(seg.read_only_fd(), 8193)
    with pytest.raises(ReshardValueError, match="must be a memfd segment"):
      Segment.open(os.open("/dev/null", os.O_RDONLY), 16)
    view = seg.array[:10]
    with pytest.raises(ReshardValueError, match="released first"):
      seg.close()
    del view
  with pytest.raises(ReshardValueError, match="nbytes must be an int > 0"):
    Segment.create(0)
  assert _memfd_maps() == 0


def test_ticket_is_good_once():
  with Segment.create(4096) as seg, FdServer() as server:
    seg.array[:4] = [1, 2, 3, 4]
    ticket = server.offer(seg.read_only_fd())
    assert server.pending() == 1
    with Segment.open(fetch_fd(server.name, ticket), 4096) as reader:
      assert reader.array[:4].tolist() == [1, 2, 3, 4]
    assert server.pending() == 0
    with pytest.raises(ReshardRuntimeError, match="refused the ticket"):
      fetch_fd(server.name, ticket, timeout_s=5)


def test_unknown_expired_revoked_tickets_are_refused():
  with Segment.create(4096) as seg, FdServer() as server:
    with pytest.raises(ReshardRuntimeError, match="refused"):
      fetch_fd(server.name, os.urandom(TICKET_BYTES), timeout_s=5)
    expired = server.offer(seg.read_only_fd(), ttl_s=0.05)
    revoked = server.offer(seg.read_only_fd())
    server.revoke(revoked)
    time.sleep(0.3)
    for ticket in (expired, revoked):
      with pytest.raises(ReshardRuntimeError, match="refused"):
        fetch_fd(server.name, ticket, timeout_s=5)
    assert server.pending() == 0
    with pytest.raises(ReshardValueError, match="ticket must be 32 bytes"):
      fetch_fd(server.name, b"short")


def _raw(name: str, payload: bytes, timeout_s: float = 5.0) -> bytes:
  """Sends `payload` to the server and returns what comes back before it closes."""
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(timeout_s)
    sock.connect("\0" + name)
    try:
      sock.sendall(payload)
      return sock.recv(64)
    except (BrokenPipeError, ConnectionResetError):
      return b""


def test_garbage_and_oversized_requests_are_refused_and_the_server_lives():
  with Segment.create(4096) as seg, FdServer(client_timeout_s=0.5) as server:
    ticket = server.offer(seg.read_only_fd())
    # Oversized: the valid ticket followed by more bytes; then megabytes of garbage.
    assert _raw(server.name, ticket + b"x" * MAX_REQUEST_BYTES) == b""
    assert _raw(server.name, os.urandom(1 << 20)) == b""
    assert _raw(server.name, b"\0" * 5) == b""  # too short: dropped after the timeout
    assert server.refused >= 3
    # A client that connects and says nothing does not hold up the next one.
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect("\0" + server.name)
    try:
      fresh = server.offer(seg.read_only_fd())
      t0 = time.monotonic()
      os.close(fetch_fd(server.name, fresh, timeout_s=5))
      assert time.monotonic() - t0 < 0.4
    finally:
      silent.close()
    # The oversized request consumed nothing: the first ticket was never honoured.
    assert server.pending() == 1
    os.close(fetch_fd(server.name, ticket, timeout_s=5))
  assert server.name not in _abstract_sockets()


def _segment_process():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "local_worker.py"),
                           "--role", "segment", "--timeout", "60"], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  line = proc.stdout.readline()
  assert line, "the segment process printed nothing"
  return proc, json.loads(line)


def test_publisher_killed_while_a_reader_maps_its_segment():
  shm_before = _shm()
  proc, info = _segment_process()
  try:
    fd = fetch_fd(info["name"], bytes.fromhex(info["ticket"]), timeout_s=10)
    reader = Segment.open(fd, info["nbytes"])
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    # Its socket is gone with it; what it wrote is still there.
    assert info["name"] not in _abstract_sockets()
    assert np.array_equal(reader.array, local_worker.pattern(info["nbytes"]))
    assert _shm() == shm_before
    reader.close()
    assert _memfd_maps() == 0  # the last reference is gone: the kernel frees the pages
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_reader_killed_while_mapping_leaves_nothing():
  """The reader side killed mid-read: the publisher's segment is unharmed, and nothing
  is left in /dev/shm once both are gone."""
  shm_before = _shm()
  with Segment.create(1 << 20, name="jax_m2n_test") as seg, FdServer() as server:
    seg.array[:] = local_worker.pattern(1 << 20)
    ticket = server.offer(seg.read_only_fd())
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
            "from jax_m2n._src.local_memory import Segment, fetch_fd;"
            "s = Segment.open(fetch_fd(sys.argv[2], bytes.fromhex(sys.argv[3])), 1 << 20);"
            "print(int(s.array.sum()), flush=True); time.sleep(60)")
    reader = subprocess.Popen([sys.executable, "-c", code, ROOT, server.name, ticket.hex()],
                              stdout=subprocess.PIPE, text=True)
    try:
      assert int(reader.stdout.readline()) == int(seg.array.sum())
      reader.kill()
      reader.wait(timeout=10)
    finally:
      if reader.poll() is None:
        reader.kill()
        reader.wait()
    assert np.array_equal(seg.array, local_worker.pattern(1 << 20))
  assert _shm() == shm_before
  assert _memfd_maps() == 0
