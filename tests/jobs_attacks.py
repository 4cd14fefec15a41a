"""What a stranger can send to a jobs control port, for tests and the flood bench: raw
ZMTP 3 bytes (greetings, CURVE HELLOs with keys nobody holds, frames announcing 64 MiB),
a paced flood of them from one source address, a hypothesis strategy of such cases,
and readers of a process's peak RSS and of its threads' CPU time. Knows nothing of
jax_m2n beyond the wire (ZMTP 3.0, RFC 23; CurveZMQ, RFC 26); never holds a token.

  python tests/jobs_attacks.py --port 7000 --kind hello --rate 200 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import time

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
KINDS = ("garbage", "hello", "halfopen", "bigframe")


def greeting(mechanism: bytes = b"CURVE", as_server: bool = False,
             version: tuple[int, int] = (3, 0)) -> bytes:
  """A ZMTP 3 greeting (64 bytes)."""
  return (SIGNATURE + bytes(version) + mechanism.ljust(20, b"\x00")[:20]
          + bytes([as_server]) + b"\x00" * 31)


def frame(body: bytes, command: bool = False, more: bool = False,
          size: int | None = None) -> bytes:
  """One ZMTP 3 frame; `size` overrides the announced length (a lie about it)."""
  n = len(body) if size is None else size
  flags = (0x01 if more else 0) | (0x04 if command else 0)
  if n > 255:
    return bytes([flags | 0x02]) + n.to_bytes(8, "big") + body
  return bytes([flags, n]) + body


def hello(key: bytes | None = None) -> bytes:
  """A CURVE HELLO command (RFC 26) from a short-term key nobody knows, its box random:
  the server must run its Curve25519 to find it does not open."""
  body = (b"\x05HELLO" + b"\x01\x00" + b"\x00" * 72 + (key or secrets.token_bytes(32))
          + secrets.token_bytes(8) + secrets.token_bytes(80))
  return frame(body, command=True)


def connect(port: int, source: str = "127.0.0.1", host: str = "127.0.0.1",
            timeout_s: float = 1.0) -> socket.socket:
  """A TCP connection to host:port from `source` (any 127.0.0.0/8 address is local)."""
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  s.settimeout(timeout_s)
  s.bind((source, 0))
  try:
    s.connect((host, port))
  except OSError:
    s.close()
    raise
  return s


def send_and_close(port: int, data: bytes, source: str = "127.0.0.1",
                   read_s: float = 0.0) -> bytes:
  """Connects, sends `data` (as much as the peer takes), reads for up to `read_s` (what
  the server answered, until it closes), closes. Never raises for the peer's doing."""
  got = b""
  try:
    with connect(port, source) as s:
      try:
        s.sendall(data)
      except OSError:
        return got
      until = time.monotonic() + read_s
      while (left := until - time.monotonic()) > 0:
        s.settimeout(left)
        try:
          data = s.recv(4096)
        except (socket.timeout, OSError):
          break
        if not data:
          break
        got += data
  except OSError:
    pass
  return got


def payload(kind: str) -> bytes:
  if kind == "garbage":
    return secrets.token_bytes(1 + secrets.randbelow(200))
  if kind == "hello":
    return greeting() + hello()
  if kind == "bigframe":  # announces 64 MiB, sends 1 MiB of it
    return greeting() + frame(b"\x00" * (1 << 20), size=64 << 20)
  return b""


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
  out = bytearray(data)
  for pos, byte in edits:
    if out:
      out[pos % len(out)] = byte
  return bytes(out)


def pre_auth():
  """A hypothesis strategy of what a stranger sends: ("pre", kind, bytes, source
  address), kind one of bytes, greeting (mutated, any mechanism), hello (mutated CURVE
  HELLO), bigframe (a frame announcing 64 KiB to 2^63 bytes), frames, halfopen."""
  from hypothesis import strategies as st
  edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4)

  @st.composite
  def case(draw):
    kind = draw(st.sampled_from(["bytes", "greeting", "hello", "bigframe", "frames",
                                 "halfopen"]))
    tail = draw(st.binary(max_size=64))
    if kind == "bytes":
      data = draw(st.binary(max_size=300))
    elif kind == "greeting":
      mech = draw(st.sampled_from([b"CURVE", b"NULL", b"PLAIN", b"GSSAPI", b"\xff" * 20]))
      data = _mutate(greeting(mech, draw(st.booleans())), draw(edits)) + tail
    elif kind == "hello":
      data = greeting() + _mutate(hello(), draw(edits)) + tail
    elif kind == "bigframe":
      data = greeting() + frame(tail, command=draw(st.booleans()),
                                size=draw(st.integers(1 << 16, (1 << 63) - 1)))
    elif kind == "frames":
      data = greeting() + b"".join(
          frame(draw(st.binary(max_size=40)), command=draw(st.booleans()),
                more=draw(st.booleans())) for _ in range(draw(st.integers(1, 4))))
    else:
      data = b""
    # Many source addresses: the cases test the parser, not one address's budget.
    return "pre", kind, data, f"127.0.0.{draw(st.integers(10, 250))}"
  return case()


def send_case(port: int, kind: str, data: bytes, source: str) -> None:
  """Sends one `pre_auth` case to 127.0.0.1:port."""
  if kind == "halfopen":
    try:
      connect(port, source).close()
    except OSError:
      pass
  else:
    send_and_close(port, data, source)


def flood(port: int, kind: str, rate: float, seconds: float,
          source: str = "127.0.0.1") -> dict[str, int]:
  """`rate` connections per second for `seconds`, each sending one `kind` payload
  ("halfopen": sends nothing and holds every connection to the end). Returns counts:
  attempts, refused (connect failed), closed_early (the server closed before its
  greeting was read whole)."""
  counts = {"attempts": 0, "refused": 0, "closed_early": 0}
  held = []
  start = time.monotonic()
  try:
    while (now := time.monotonic()) - start < seconds:
      due = start + counts["attempts"] / rate
      if now < due:
        time.sleep(due - now)
      counts["attempts"] += 1
      if kind == "halfopen":
        try:
          held.append(connect(port, source))
        except OSError:
          counts["refused"] += 1
        continue
      got = send_and_close(port, payload(kind), source, read_s=0.02)
      if len(got) < len(SIGNATURE):
        counts["closed_early"] += 1
  finally:
    for s in held:
      s.close()
  return counts


def peak_rss_mib(pid: int | str = "self") -> float:
  """VmHWM of a process: its peak resident set since start or `reset_peak`."""
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError("no VmHWM")


def reset_peak(pid: int | str = "self") -> None:
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")


def thread_cpu_s(tids: list[int]) -> dict[int, float]:
  """CPU seconds (user + system) each thread of this process has used."""
  tick = os.sysconf("SC_CLK_TCK")
  out = {}
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      out[tid] = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
      out[tid] = 0.0
  return out


def thread_ids(name_prefix: str) -> set[int]:
  """Native ids of this process's threads whose OS name starts with `name_prefix`
  (zmq names its I/O threads "ZMQbg/IO/<n>")."""
  out = set()
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        if f.read().startswith(name_prefix):
          out.add(int(tid))
    except OSError:
      pass
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--kind", choices=KINDS, default="hello")
  parser.add_argument("--rate", type=float, default=200.0)
  parser.add_argument("--seconds", type=float, default=10.0)
  parser.add_argument("--source", default="127.0.0.2")
  args = parser.parse_args()
  print(json.dumps(flood(args.port, args.kind, args.rate, args.seconds, args.source)),
        flush=True)


if __name__ == "__main__":
  main()
