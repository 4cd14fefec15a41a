"""jax_m2n.testing.hosts: emulated hosts (network namespaces) reach each other at the
shaped rate, cuts and partitions stop exactly the traffic they should, wire links delay
and drop, and nothing is left behind (close, SIGTERM, a dead owner's namespaces).
Skips with the reason where namespaces cannot be made (not root, no iproute2)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jax_m2n.testing import hosts as hosts_lib
from jax_m2n.testing.hosts import EmulatedHosts

pytestmark = pytest.mark.skipif(EmulatedHosts.unavailable() is not None,
                                reason=str(EmulatedHosts.unavailable()))

PORT = 7000

# A receiver that counts bytes until the sender closes, and a sender of N bytes; both
# print one line. Plain Python: no jax import (fast to start).
SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
    print("listening", flush=True)
    c, _ = s.accept()
    n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        t0 = t0 or time.perf_counter()
        n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
""")
SOURCE = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    c.sendall(b"x" * int(sys.argv[3]))
    c.close()
""")
# Exit status 0 when a TCP connection to (host, port) opens within the timeout (a
# refused connection counts as reachable: the host answered); prints the seconds.
REACH = textwrap.dedent("""
    import socket, sys, time
    t0 = time.perf_counter()
    try:
        address = (sys.argv[1], int(sys.argv[2]))
        socket.create_connection(address, timeout=float(sys.argv[3])).close()
        ok = True
    except ConnectionRefusedError:
        ok = True
    except OSError as e:
        ok = False
        print(type(e).__name__, e, file=sys.stderr)
    print(f"{time.perf_counter() - t0:.4f}")
    sys.exit(0 if ok else 1)
""")


def reachable(hosts, i, j, timeout=1.0) -> tuple[bool, float]:
  r = hosts.run(i, [sys.executable, "-c", REACH, hosts.address(j), str(PORT),
                    str(timeout)], timeout=timeout + 20)
  return r.returncode == 0, float(r.stdout.strip() or "nan")


def transfer(hosts, src, dst, nbytes) -> float:
  """Seconds to move nbytes over TCP from host src to host dst (receiver's clock)."""
  sink = hosts.popen(dst, [sys.executable, "-c", SINK, str(PORT)],
                     stdout=subprocess.PIPE, text=True)
  assert sink.stdout.readline().strip() == "listening"
  r = hosts.run(src, [sys.executable, "-c", SOURCE, hosts.address(dst), str(PORT),
                      str(nbytes)], timeout=60)
  assert r.returncode == 0, r.stderr
  got, seconds = sink.communicate(timeout=60)[0].split()
  assert int(got) == nbytes
  return float(seconds)


def test_addresses_and_shaped_rate():
  with EmulatedHosts(2, rate="100mbit") as hosts:
    assert [hosts.address(i) for i in range(2)] == ["10.77.0.1", "10.77.0.2"]
    out = hosts.run(1, ["ip", "-br", "-4", "addr", "show", "dev", "eth0"]).stdout
    assert "10.77.0.2/24" in out
    nbytes = 4 << 20
    seconds = transfer(hosts, 0, 1, nbytes)
    # The shaping bounds the rate from above (a slow machine only makes it slower):
    # 4 MiB at 100 Mbit/s takes at least ~0.34 s (minus the bucket's first burst).
    assert seconds >= 0.8 * nbytes * 8 / 100e6, seconds
    print(f"4 MiB over 100 Mbit/s: {seconds * 1e3:.0f} ms "
          f"({nbytes * 8 / seconds / 1e6:.0f} Mbit/s)")
    hosts.set_link(1, rate=None)  # unshaped: kernel speed
    print(f"unshaped: {transfer(hosts, 0, 1, nbytes) * 1e3:.0f} ms")


def test_cut_and_partition_stop_only_their_traffic():
  with EmulatedHosts(3, rate=None) as hosts:
    assert reachable(hosts, 1, 2)[0] and reachable(hosts, 2, 0)[0]
    hosts.partition(1, 2)
    assert not reachable(hosts, 1, 2)[0]
    assert not reachable(hosts, 2, 1)[0]
    assert reachable(hosts, 1, 0)[0] and reachable(hosts, 2, 0)[0]
    hosts.heal(1, 2)
    assert reachable(hosts, 1, 2)[0]
    hosts.set_link(2, up=False)  # a cut cable: silence, not an error
    ok, seconds = reachable(hosts, 0, 2, timeout=0.5)
    assert not ok and seconds >= 0.45
    assert reachable(hosts, 0, 1)[0]
    hosts.set_link(2, up=True)
    deadline = time.monotonic() + 10
    while not reachable(hosts, 0, 2)[0]:
      assert time.monotonic() < deadline, "host 2 unreachable after its link came back"


@pytest.mark.skipif(EmulatedHosts.unavailable(wire=True) is not None,
                    reason=str(EmulatedHosts.unavailable(wire=True)))
def test_wire_links_delay_and_drop():
  with EmulatedHosts(2, rate="100mbit", delay_ms=10) as hosts:
    ok, seconds = reachable(hosts, 0, 1)
    # A TCP handshake crosses 2 links each way: at least 4 x 10 ms.
    assert ok and seconds >= 0.04, seconds
    nbytes = 1 << 20
    print(f"1 MiB over 100 Mbit/s with 10 ms per link direction: "
          f"{transfer(hosts, 0, 1, nbytes) * 1e3:.0f} ms")
    hosts.set_link(1, loss=1.0)
    assert not reachable(hosts, 0, 1, timeout=0.5)[0]
    hosts.set_link(1, loss=0.0, delay_ms=0)
    assert reachable(hosts, 0, 1)[0]


def test_close_kills_processes_and_removes_namespaces():
  hosts = EmulatedHosts(2, rate=None).start()
  names = [hosts.switch, hosts.namespace(0), hosts.namespace(1)]
  p = hosts.popen(1, ["sleep", "600"])
  assert set(names) <= set(hosts_lib._namespaces())
  hosts.close()
  assert p.poll() is not None
  assert not set(names) & set(hosts_lib._namespaces())
  hosts.close()  # idempotent


def test_sigterm_cleans_up_and_stale_namespaces_are_swept():
  code = textwrap.dedent("""
      import sys, time
      from jax_m2n.testing.hosts import EmulatedHosts
      hosts = EmulatedHosts(2, rate="1gbit").start()
      hosts.popen(0, ["sleep", "600"])
      print(hosts.switch, hosts.namespace(0), hosts.namespace(1), flush=True)
      time.sleep(600)
  """)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                           text=True, env=env)
  try:
    names = owner.stdout.readline().split()
    assert len(names) == 3, names
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == -signal.SIGTERM
  finally:
    if owner.poll() is None:
      owner.kill()
      owner.wait()
  assert not set(names) & set(hosts_lib._namespaces())
  # An owner killed outright (no handler runs): the next EmulatedHosts sweeps its
  # namespaces (nobody holds their lock); a live owner's are left alone.
  stale = f"{hosts_lib.PREFIX}0badf00dsw"
  hosts_lib._run(["ip", "netns", "add", stale])
  with EmulatedHosts(1, rate=None) as live:
    assert stale not in hosts_lib._namespaces()
    assert live.switch in hosts_lib._namespaces()
    assert hosts_lib.sweep_stale() == []
