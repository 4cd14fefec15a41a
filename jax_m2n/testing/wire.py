"""One emulated link with delay and loss: a process that copies Ethernet frames between
a TAP device in a host's network namespace and one in the switch's namespace.

Owns only that copy loop and its two devices (they vanish when it exits). The kernels
these tests run on lack netem (CONFIG_NET_SCH_NETEM unset), so delay and loss cannot
come from `tc`; the rate still does (tbf on the TAP devices, set by hosts.py). Started
by jax_m2n.testing.hosts as a script (no jax import); never used by jax_m2n itself.

  python wire.py HOST_NS_PATH HOST_DEV SWITCH_NS_PATH SWITCH_DEV DELAY_MS LOSS
prints "ready" once both devices exist, then reads "delay_ms=D loss=P" lines on stdin
(new settings for both directions) and exits at end of input (its owner is gone).
"""

import collections
import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_FRAME = 65536


def _open_tap(ns_path: str, name: str) -> int:
  """A new TAP device `name` in the namespace at `ns_path` (this thread returns to its
  own namespace afterwards): the device lives as long as the descriptor."""
  libc = ctypes.CDLL(None, use_errno=True)
  own = os.open("/proc/self/ns/net", os.O_RDONLY)
  target = os.open(ns_path, os.O_RDONLY)
  try:
    if libc.setns(target, _CLONE_NEWNET) != 0:
      raise OSError(ctypes.get_errno(), f"setns({ns_path})")
    fd = os.open("/dev/net/tun", os.O_RDWR)
    ifreq = struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI)
    fcntl.ioctl(fd, _TUNSETIFF, ifreq)
    os.set_blocking(fd, False)
    return fd
  finally:
    if libc.setns(own, _CLONE_NEWNET) != 0:
      raise OSError(ctypes.get_errno(), "setns(back)")
    os.close(own)
    os.close(target)


def _parse(line: str, settings: dict) -> None:
  for word in line.split():
    key, _, value = word.partition("=")
    if key in settings:
      settings[key] = float(value)


def relay(a: int, b: int, settings: dict, control) -> None:
  """Copies frames a <-> b: each dropped with probability `loss`, else sent `delay_ms`
  after it arrived, in arrival order per direction."""
  other = {a: b, b: a}
  queues = {a: collections.deque(), b: collections.deque()}  # by destination
  last_due = {a: 0.0, b: 0.0}
  poller = select.poll()
  for fd in (a, b, control.fileno()):
    poller.register(fd, select.POLLIN)
  while True:
    due = [q[0][0] for q in queues.values() if q]
    wait_ms = 1000 if not due else max(0.0, (min(due) - time.monotonic()) * 1e3)
    for fd, _ in poller.poll(wait_ms):
      if fd == control.fileno():
        line = control.readline()
        if not line:
          return
        _parse(line, settings)
        continue
      for _ in range(256):
        try:
          frame = os.read(fd, _FRAME)
        except BlockingIOError:
          break
        except OSError:  # the device is down: nothing to read
          break
        if settings["loss"] > 0 and random.random() < settings["loss"]:
          continue
        out = other[fd]
        now = time.monotonic()
        when = max(now + settings["delay_ms"] * 1e-3, last_due[out])
        last_due[out] = when
        queues[out].append((when, frame))
    now = time.monotonic()
    for out, q in queues.items():
      while q and q[0][0] <= now:
        try:
          os.write(out, q.popleft()[1])
        except OSError:  # the device is down or full: the frame is lost, as on a wire
          pass


def main(argv) -> int:
  host_ns, host_dev, switch_ns, switch_dev, delay_ms, loss = argv
  settings = {"delay_ms": float(delay_ms), "loss": float(loss)}
  a = _open_tap(host_ns, host_dev)
  b = _open_tap(switch_ns, switch_dev)
  print("ready", flush=True)
  relay(a, b, settings, sys.stdin)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
