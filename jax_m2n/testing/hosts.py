"""Emulated hosts on one Linux machine: N network namespaces, each with its own address
and a shaped link to one switch, so that a multi-process job runs as if it spanned
machines with NIC-limited links.

Owns making and removing the namespaces, their links and the processes started in
them (and sweeping those left by an owner that died). Knows nothing of JAX and moves
no data itself. Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not.
Every address is inside namespaces made here: no traffic leaves the machine.

Usage:
  from jax_m2n.testing.hosts import EmulatedHosts
  reason = EmulatedHosts.unavailable()        # None, or why not here (a test's skip)
  with EmulatedHosts(3, rate="1gbit") as hosts:   # hosts 0, 1, 2
    hosts.address(0)                              # "10.77.0.1" (host i: 10.77.0.<i+1>)
    p = hosts.popen(1, [sys.executable, "worker.py"], stdout=log)   # runs in host 1
    hosts.run(2, ["ip", "-br", "addr"], timeout=10)                 # CompletedProcess
    hosts.set_link(2, up=False)        # cut host 2's cable: its frames vanish silently
    hosts.set_link(2, up=True, rate="100mbit")
    hosts.partition(1, 2)              # 1 and 2 cannot reach each other; both reach 0
    hosts.heal(1, 2)
  with EmulatedHosts(3, rate="1gbit", delay_ms=20, loss=0.01) as hosts: ...

Links: host i's `eth0` is joined to a bridge in a switch namespace. `rate` shapes each
direction of every link with tc tbf (what a host sends and what it receives: a NIC of
that speed). `delay_ms` and `loss` (each direction of a host's link: between two hosts
a frame crosses two links, so the round trip is 4 x delay_ms) need "wire" links: these
kernels lack netem (CONFIG_NET_SCH_NETEM), so a small process per link
(jax_m2n.testing.wire) copies frames between two TAP devices, delaying and dropping
them; `wire=True` asks for wire links without delay or loss (then `set_link` can add
them later). Veth links (the default) carry bytes at kernel speed.

Cleanup: `close()` (and leaving the `with`) kills every process started here (their
process groups and anything left in the namespaces) and deletes the namespaces, which
removes their links. It also runs at interpreter exit (atexit) and on SIGTERM / SIGINT
(then the previous handler runs). Processes started here get SIGKILL when their owner
dies (PR_SET_PDEATHSIG, through util-linux's setpriv), and a new EmulatedHosts sweeps
the namespaces whose owner is gone: each set is named `jm2n<8 hex digits>...`, and its
owner holds an flock on /run/jm2n/<that name>.lock while it lives (a lock, not a
process id: test runners such as Bazel's sandbox give each test its own pid numbers).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from typing import Sequence

PREFIX = "jm2n"
SUBNET = "10.77.0"
_NAME = re.compile(rf"^({PREFIX}[0-9a-f]{{8}})(?:h\d+|sw)$")
_LOCKS = "/run/jm2n"
_WIRE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire.py")
_KEEP = object()  # set_link: leave this setting as it is


class HostsError(RuntimeError):
  """A namespace, link or process of the emulated hosts could not be made or changed."""


def _tool(name: str) -> str | None:
  """The path of an administration tool: PATH, then the sbin directories (a test
  runner's PATH, Bazel's for one, often lacks them)."""
  return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def _with_parent(argv: Sequence[str]) -> list[str]:
  """`argv` made to get SIGKILL when the process that started it dies (util-linux's
  setpriv sets PR_SET_PDEATHSIG, kept across exec; no preexec_fn, which is unsafe in a
  threaded process such as one running JAX)."""
  setpriv = _tool("setpriv")
  return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else list(argv)


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30) -> str:
  cmd = [_tool(cmd[0]) or cmd[0], *cmd[1:]]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise HostsError(f"{' '.join(cmd)}: {e}") from e
  if check and r.returncode:
    raise HostsError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
  return r.stdout


def _bits_per_s(rate: str) -> float:
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?\s*", str(rate).lower())
  if not m:
    raise ValueError(f"EmulatedHosts: rate must be like '1gbit', '100mbit' or '5e8'; "
                     f"got {rate!r}.")
  scale = {None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
  return float(m.group(1)) * scale


def _tbf(rate: str) -> list[str]:
  """tc arguments of a token bucket at `rate`: a burst of 4 ms of the rate (at least
  64 KiB: a whole GSO frame) and up to 50 ms of queue."""
  bps = _bits_per_s(rate)
  burst = max(64 << 10, int(bps / 8 * 0.004))
  return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "50ms"]


_lock = threading.Lock()
_live: set["EmulatedHosts"] = set()
_previous_handlers: dict[int, object] = {}


def _close_all() -> None:
  for hosts in list(_live):
    hosts.close()


def _on_signal(signum, frame) -> None:
  _close_all()
  previous = _previous_handlers.get(signum, signal.SIG_DFL)
  if callable(previous):
    previous(signum, frame)
  elif previous == signal.SIG_DFL:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
  """atexit and SIGTERM/SIGINT close every live EmulatedHosts (once per process; signal
  handlers only from the main thread, where Python allows them)."""
  if _previous_handlers or threading.current_thread() is not threading.main_thread():
    return
  atexit.register(_close_all)
  for signum in (signal.SIGTERM, signal.SIGINT):
    _previous_handlers[signum] = signal.getsignal(signum)
    signal.signal(signum, _on_signal)


def _lock_path(base: str) -> str:
  return os.path.join(_LOCKS, base + ".lock")


def _take_lock(base: str) -> int | None:
  """An open descriptor holding the exclusive flock of `base`, or None where another
  process holds it (its owner is alive)."""
  os.makedirs(_LOCKS, exist_ok=True)
  fd = os.open(_lock_path(base), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None
  return fd


def _namespaces() -> list[str]:
  return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines()
          if line.strip()]


def _kill_namespace(ns: str) -> None:
  """Kills every process in namespace `ns`, then deletes it (and its links)."""
  pids = _run(["ip", "netns", "pids", ns], check=False).split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
  _run(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> list[str]:
  """Deletes the namespaces (and kills their processes) left by an EmulatedHosts whose
  owner process is gone; returns their names."""
  swept = []
  owners: dict[str, int | None] = {}
  for ns in _namespaces():
    m = _NAME.match(ns)
    if not m:
      continue
    base = m.group(1)
    if base not in owners:
      owners[base] = _take_lock(base)
    if owners[base] is not None:  # nobody holds its lock: the owner is gone
      _kill_namespace(ns)
      swept.append(ns)
  for base, fd in owners.items():
    if fd is not None:
      os.unlink(_lock_path(base))
      os.close(fd)
  return swept


_unavailable: list[str | None] = []


class EmulatedHosts:
  """N hosts, each a network namespace with address 10.77.0.<i+1> on one switch; see
  the module docstring for the whole API.

  Args:
    n: how many hosts (1-200).
    rate: the speed of each direction of every link ("1gbit", "100mbit"), or None for
      unshaped links.
    delay_ms: delay added to each direction of every host's link (wire links).
    loss: probability that a frame is dropped, each direction of every link (wire links).
    wire: links through a wire process even with no delay or loss (so that set_link can
      add them later); default: only where delay_ms or loss is given.
  """

  def __init__(self, n: int, rate: str | None = "1gbit", delay_ms: float = 0.0,
               loss: float = 0.0, wire: bool | None = None):
    if not 1 <= n <= 200:
      raise ValueError(f"EmulatedHosts: n must be in [1, 200]; got {n}.")
    if not 0.0 <= loss <= 1.0 or delay_ms < 0:
      raise ValueError(f"EmulatedHosts: loss must be in [0, 1] and delay_ms >= 0; got "
                       f"loss={loss}, delay_ms={delay_ms}.")
    if rate is not None:
      _bits_per_s(rate)
    self.n = n
    self.rate = rate
    self.wire = bool(delay_ms or loss) if wire is None else wire
    self._settings = [{"delay_ms": delay_ms, "loss": loss} for _ in range(n)]
    self._base = f"{PREFIX}{secrets.token_hex(4)}"
    self._lock_fd: int | None = None
    self._procs: list[subprocess.Popen] = []
    self._wires: list[subprocess.Popen] = []
    self._made: list[str] = []
    self._blocked: set[tuple[int, int]] = set()
    self._closed = False

  # -- availability --------------------------------------------------------------------

  @staticmethod
  def unavailable(wire: bool = False) -> str | None:
    """None where hosts can be made here; else why not (a test's skip reason).
    `wire`: also wire links (TAP devices)."""
    if not _unavailable:
      _unavailable.append(_probe())
    if _unavailable[0] is None and wire and not os.path.exists("/dev/net/tun"):
      return "EmulatedHosts: wire links need /dev/net/tun (TAP devices); there is none."
    return _unavailable[0]

  # -- lifecycle -----------------------------------------------------------------------

  def __enter__(self) -> "EmulatedHosts":
    self.start()
    return self

  def __exit__(self, *exc) -> bool:
    self.close()
    return False

  def start(self) -> "EmulatedHosts":
    """Makes the switch, the hosts and their links (undone on any failure)."""
    reason = self.unavailable(wire=self.wire)
    if reason is not None:
      raise HostsError(reason)
    sweep_stale()
    _install_handlers()
    with _lock:
      _live.add(self)
    try:
      self._lock_fd = _take_lock(self._base)
      sw = self.switch
      self._add_namespace(sw)
      _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
      _run(["ip", "-n", sw, "link", "set", "br0", "up"])
      for i in range(self.n):
        self._add_host(i)
    except BaseException:
      self.close()
      raise
    return self

  def close(self) -> None:
    """Kills every process started here and deletes every namespace (idempotent)."""
    if self._closed:
      return
    self._closed = True
    for p in self._procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          p.kill()
    for p in self._procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    for ns in reversed(self._made):
      _kill_namespace(ns)
    for w in self._wires:
      if w.stdin:
        try:
          w.stdin.close()
        except OSError:
          pass
      w.kill()
      w.wait()
    if self._lock_fd is not None:
      os.unlink(_lock_path(self._base))
      os.close(self._lock_fd)
      self._lock_fd = None
    with _lock:
      _live.discard(self)

  # -- names and addresses -------------------------------------------------------------

  @property
  def switch(self) -> str:
    """The switch's namespace."""
    return f"{self._base}sw"

  def namespace(self, i: int) -> str:
    """Host i's namespace."""
    self._check(i)
    return f"{self._base}h{i}"

  def address(self, i: int) -> str:
    """Host i's IPv4 address (its eth0)."""
    self._check(i)
    return f"{SUBNET}.{i + 1}"

  def _check(self, i: int) -> None:
    if not 0 <= i < self.n:
      raise IndexError(f"EmulatedHosts: host must be in [0, {self.n}); got {i}.")

  # -- processes -----------------------------------------------------------------------

  def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts `argv` in host i (subprocess.Popen's keyword arguments apply); it runs in a
    session of its own and is killed by close() or when this process dies."""
    self._check(i)
    kwargs.setdefault("start_new_session", True)
    p = subprocess.Popen(
        _with_parent([_tool("ip") or "ip", "netns", "exec", self.namespace(i), *argv]),
        **kwargs)
    self._procs.append(p)
    return p

  def run(self, i: int, argv: Sequence[str], timeout: float = 60, **kwargs
          ) -> subprocess.CompletedProcess:
    """Runs `argv` in host i to completion (killed after `timeout` s: TimeoutExpired)."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    p = self.popen(i, argv, **kwargs)
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
      raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)

  # -- links ---------------------------------------------------------------------------

  def set_link(self, i: int, up: bool | None = None, rate=_KEEP, delay_ms=None,
               loss=None) -> None:
    """Changes host i's link: `up` (False: frames to and from it vanish, as with a cut
    cable; True: back), `rate` (a speed, or None: unshaped), `delay_ms` and `loss`
    (wire links only)."""
    self._check(i)
    port = f"h{i}"
    if up is not None:
      _run(["ip", "-n", self.switch, "link", "set", port, "up" if up else "down"])
    if rate is not _KEEP:
      self._shape(i, rate)
    if delay_ms is not None or loss is not None:
      if not self.wire:
        raise HostsError("EmulatedHosts.set_link: delay_ms and loss need wire links; "
                         "got veth links. Hint: EmulatedHosts(..., wire=True).")
      s = self._settings[i]
      if delay_ms is not None:
        s["delay_ms"] = float(delay_ms)
      if loss is not None:
        s["loss"] = float(loss)
      w = self._wires[i]
      w.stdin.write(f"delay_ms={s['delay_ms']} loss={s['loss']}\n")
      w.stdin.flush()

  def partition(self, i: int, j: int) -> None:
    """Hosts i and j can no longer reach each other (both still reach the others):
    each gets a blackhole route to the other's address."""
    for a, b in ((i, j), (j, i)):
      _run(["ip", "-n", self.namespace(a), "route", "add", "blackhole",
            f"{self.address(b)}/32"])
      self._blocked.add((a, b))

  def heal(self, i: int, j: int) -> None:
    """Undoes partition(i, j)."""
    for a, b in ((i, j), (j, i)):
      if (a, b) in self._blocked:
        _run(["ip", "-n", self.namespace(a), "route", "del", "blackhole",
              f"{self.address(b)}/32"])
        self._blocked.discard((a, b))

  # -- making --------------------------------------------------------------------------

  def _add_namespace(self, ns: str) -> None:
    _run(["ip", "netns", "add", ns])
    self._made.append(ns)
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])

  def _add_host(self, i: int) -> None:
    ns, sw, port = self.namespace(i), self.switch, f"h{i}"
    self._add_namespace(ns)
    if self.wire:
      self._add_wire(i)
    else:
      _run(["ip", "-n", sw, "link", "add", "name", port, "type", "veth", "peer", "name",
            "eth0", "netns", ns])
    _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
    _run(["ip", "-n", sw, "link", "set", port, "up"])
    _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
    _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    if self.rate is not None:
      self._shape(i, self.rate)

  def _add_wire(self, i: int) -> None:
    s = self._settings[i]
    w = subprocess.Popen(_with_parent(
        [sys.executable, _WIRE, f"/run/netns/{self.namespace(i)}", "eth0",
         f"/run/netns/{self.switch}", f"h{i}", str(s["delay_ms"]), str(s["loss"])]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    self._wires.append(w)
    line = w.stdout.readline()  # the wire prints "ready" or dies with its error
    if line.strip() != "ready":
      w.kill()
      raise HostsError(f"EmulatedHosts: the wire of host {i} did not start: "
                       f"{w.stderr.read()[-2000:]}")

  def _shape(self, i: int, rate: str | None) -> None:
    for ns, dev in ((self.namespace(i), "eth0"), (self.switch, f"h{i}")):
      if rate is None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
      else:
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *_tbf(rate)])


def _probe() -> str | None:
  """Why emulated hosts cannot be made here, or None: root, iproute2, and one namespace
  with a veth pair and a tbf made and removed."""
  if not sys.platform.startswith("linux"):
    return f"EmulatedHosts: needs Linux network namespaces; got {sys.platform}."
  if os.geteuid() != 0:
    return (f"EmulatedHosts: needs root (network namespaces); running as uid "
            f"{os.geteuid()}.")
  missing = [t for t in ("ip", "tc") if _tool(t) is None]
  if missing:
    return (f"EmulatedHosts: needs iproute2 ({', '.join(missing)} not found). Hint: "
            "scripts/setup.sh installs it (apt-get install iproute2).")
  base = f"{PREFIX}{secrets.token_hex(4)}"
  ns = base + "sw"  # swept like any other should this process die meanwhile
  lock = None
  try:
    lock = _take_lock(base)
    _run(["ip", "netns", "add", ns])
    try:
      _run(["ip", "-n", ns, "link", "add", "name", "probe0", "type", "veth", "peer",
            "name", "probe1"])
      _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root", *_tbf("1gbit")])
    finally:
      _run(["ip", "netns", "del", ns], check=False)
  except (HostsError, OSError) as e:
    return f"EmulatedHosts: cannot make a network namespace here: {e}"
  finally:
    if lock is not None:
      os.unlink(_lock_path(base))
      os.close(lock)
  return None
