"""The `jobs` suite's trainer program and the command line the generator drives it by.

Owns the trainer's side of every measurement: its Publishers (one per transport spec:
"net", "net+curve", "transfer_server"), the tree it publishes (jobs_trees.py), the raw
offers of the same bytes (no control plane), its own peak memory, a zmq echo for the
link's round trip, all on command from the generator over one TCP connection (JSON
lines, each side waiting a bounded time). Times nothing the generator sees; pulls
nothing.

  python -c 'from jax_m2n.bench import jobs_trainer; jobs_trainer.main("127.0.0.1")'
prints the address it listens on, serves one generator, exits when it disconnects.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from jax_m2n.bench import jobs_trees

TOKEN = "jobs-bench-token-0123456789abcdef"
SPECS = ("net", "net+curve", "transfer_server")
# How long either side waits for the other's next line (a 20,000-leaf publish, a
# 256 MiB conversion on a loaded machine) before it gives up.
LINE_TIMEOUT_S = 600.0


class Channel:
  """One JSON object per line over a connected TCP socket; every read bounded."""

  def __init__(self, sock: socket.socket, timeout_s: float = LINE_TIMEOUT_S):
    sock.settimeout(timeout_s)
    self._sock = sock
    self._file = sock.makefile("rw", encoding="utf-8", newline="\n")

  def send(self, obj: dict[str, Any]) -> None:
    self._file.write(json.dumps(obj) + "\n")
    self._file.flush()

  def receive(self) -> dict[str, Any] | None:
    """The next object, or None where the peer closed."""
    line = self._file.readline()
    return json.loads(line) if line else None

  def call(self, op: str, **args: Any) -> dict[str, Any]:
    """Sends a command; returns the trainer's answer (its failure raises here)."""
    self.send({"op": op, **args})
    reply = self.receive()
    if reply is None:
      raise RuntimeError(f"jobs bench: the trainer closed the connection during {op!r}")
    if "error" in reply:
      raise RuntimeError(f"jobs bench: the trainer failed {op!r}: {reply['error']}")
    return reply

  def close(self) -> None:
    try:
      self._file.close()
    finally:
      self._sock.close()


def start(host: str, env: dict[str, str], popen: Any = None,
          timeout_s: float = 300.0) -> tuple[Any, str]:
  """Starts the trainer program (`popen(argv, **kwargs)`, default subprocess.Popen)
  listening on `host`; returns (process, "host:port") once it said where."""
  code = f"from jax_m2n.bench import jobs_trainer; jobs_trainer.main({host!r})"
  proc = (popen or subprocess.Popen)([sys.executable, "-c", code],
                                     stdout=subprocess.PIPE, text=True, env=env)
  deadline = time.monotonic() + timeout_s
  while True:
    ready, _, _ = select.select([proc.stdout], [], [], 0.5)
    if ready:
      line = proc.stdout.readline().strip()
      if line:
        return proc, line
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      raise RuntimeError(f"jobs bench: the trainer program exited or hung before it "
                         f"listened (rc={proc.poll()})")


def connect(address: str, timeout_s: float = 60.0) -> Channel:
  host, port = address.rsplit(":", 1)
  return Channel(socket.create_connection((host, int(port)), timeout=timeout_s))


def stop(channel: Channel | None, proc: Any) -> None:
  """Ends the trainer (its answer to "exit", else a kill after 60 s)."""
  try:
    if channel is not None:
      channel.send({"op": "exit"})
      channel.close()
  except OSError:
    pass
  try:
    proc.wait(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait(timeout=10)


def _devices(jax: Any) -> list[Any]:
  devs = jax.devices()
  return devs[:jobs_trees.DEVICES] if devs[0].platform == "cpu" else devs[:1]


class Trainer:
  """What the trainer program holds between commands."""

  def __init__(self, host: str):
    import jax
    self.jax, self.host = jax, host
    self.devices = _devices(jax)
    self.publishers: dict[str, Any] = {}
    self.tree: list[Any] = []
    self.raw: dict[str, Any] = {}
    self.echo: Any = None

  # -- commands ------------------------------------------------------------------------

  def publishers_(self, keep: int = 2) -> dict[str, Any]:
    """Fresh publishers (the old ones closed): per spec its control and transport
    address."""
    import jax_m2n
    self._close_publishers()
    for spec in SPECS:
      self.publishers[spec] = jax_m2n.Publisher(
          f"{self.host}:0", token=TOKEN, keep=keep, encrypt=spec == "net+curve",
          transport="transfer_server" if spec == "transfer_server" else "net")
    return {"publishers": {s: {"address": p.address, "transport": p._transport.address}  # noqa: SLF001
                           for s, p in self.publishers.items()}}

  def tree_(self, name: str, seed: int) -> dict[str, Any]:
    """Builds the case `name` on this program's devices (the previous one dropped)."""
    self.tree = []
    host, shardings = jobs_trees.build(self.jax, name, self.devices, "trainer", seed)
    self.tree = [self.jax.device_put(h, s) for h, s in zip(host, shardings)]
    self.jax.block_until_ready(self.tree)
    return {"nbytes": sum(h.nbytes for h in host), "leaves": len(host)}

  def publish_(self, spec: str) -> dict[str, Any]:
    """Publishes the tree through `spec`'s publisher: the call's time (what a training
    step pays), then the time until its snapshot is complete (asynchronous copies on
    GPUs; on CPU publish returns with it)."""
    pub = self.publishers[spec]
    t0 = time.perf_counter()
    number = pub.publish(self.tree)
    t1 = time.perf_counter()
    _settle(pub, number)
    t2 = time.perf_counter()
    return {"version": number, "publish_ms": (t1 - t0) * 1e3,
            "settled_ms": (t2 - t0) * 1e3}

  def offer_raw_(self, kind: str, dtype: str | None, count: int) -> dict[str, Any]:
    """Offers the tree's shards as they lie (in `dtype` where given: the wire's) on
    this program's transport of `kind`, `count` times; returns the tickets, the
    transport's address and per array its (shape, dtype, device index), in shard
    order."""
    import numpy as np
    from jax_m2n._src.jobs import transports
    t = self.raw.get(kind)
    if t is None:
      t = self.raw[kind] = transports.acquire(self.host, kind)
    shards = [s for leaf in self.tree for s in leaf.addressable_shards]
    arrays = [s.data if not dtype else s.data.astype(dtype) for s in shards]
    self.jax.block_until_ready(arrays)
    tickets = [t.offer(arrays, 3600.0) for _ in range(count)]
    return {"address": t.address, "tickets": [str(x) for x in tickets],
            "arrays": [[list(a.shape), np.dtype(a.dtype).name,
                        self.devices.index(s.device)] for a, s in zip(arrays, shards)]}

  def rss_(self, reset: bool = False) -> dict[str, Any]:
    """This process's peak and current resident memory (MiB); `reset` first restarts
    the peak from the current size (/proc/self/clear_refs)."""
    if reset:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = {}
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(("VmHWM:", "VmRSS:")):
          out[line.split(":")[0]] = int(line.split()[1]) / 1024
    alive = {s: p._server._thread.is_alive() for s, p in self.publishers.items()}  # noqa: SLF001
    return {"peak_mib": out["VmHWM"], "rss_mib": out["VmRSS"], "alive": alive}

  def echo_(self) -> dict[str, Any]:
    """A zmq REP socket echoing every message (the link's round trip), on a thread."""
    if self.echo is None:
      self.echo = _Echo(self.host)
    return {"address": self.echo.address}

  def close(self) -> None:
    self._close_publishers()
    from jax_m2n._src.jobs import transports
    for t in self.raw.values():
      transports.release(t)
    self.raw = {}
    if self.echo is not None:
      self.echo.close()

  def _close_publishers(self) -> None:
    for p in self.publishers.values():
      p.close()
    self.publishers = {}


def _settle(pub: Any, number: int) -> None:
  """Waits (bounded) until version `number`'s snapshot is complete: its XLA copies
  done and, where local subscribers read an export, its slot committed."""
  version = pub._versions.get(number)  # noqa: SLF001 - the bench's view of a snapshot
  if version is None:
    return
  import jax
  jax.block_until_ready([a for _, a in version.shards.values() if a is not None])
  deadline = time.monotonic() + 30.0
  while (version.export is not None and version.export.header is not None
         and version.export.slot_of(number) is None and time.monotonic() < deadline):
    time.sleep(1e-4)


class _Echo:
  """A zmq REP socket on `host` answering each message with itself, until closed."""

  def __init__(self, host: str):
    import zmq
    self._ctx = zmq.Context()
    self._sock = self._ctx.socket(zmq.REP)
    self._sock.setsockopt(zmq.LINGER, 0)
    port = self._sock.bind_to_random_port(f"tcp://{host}")
    self.address = f"{host}:{port}"
    self._stop = False
    self._thread = threading.Thread(target=self._run, daemon=True, name="bench-echo")
    self._thread.start()

  def _run(self) -> None:
    while not self._stop:
      if self._sock.poll(100):
        self._sock.send(self._sock.recv())

  def close(self) -> None:
    self._stop = True
    self._thread.join(5.0)
    self._sock.close(0)
    self._ctx.term()


def main(host: str) -> None:
  """The trainer program: listens on `host`, prints its address, serves one
  generator's commands until "exit" or the connection closes."""
  srv = socket.create_server((host, 0))
  srv.settimeout(LINE_TIMEOUT_S)
  print(f"{host}:{srv.getsockname()[1]}", flush=True)
  sock, _ = srv.accept()
  srv.close()
  channel = Channel(sock, timeout_s=3600.0)
  trainer = Trainer(host)
  commands = {"publishers": trainer.publishers_, "tree": trainer.tree_,
              "publish": trainer.publish_, "offer_raw": trainer.offer_raw_,
              "rss": trainer.rss_, "echo": trainer.echo_}
  try:
    while (msg := channel.receive()) is not None and msg.get("op") != "exit":
      op = msg.pop("op")
      try:
        channel.send(commands[op](**msg))
      except Exception as e:  # noqa: BLE001 - said to the generator, which raises it
        channel.send({"error": f"{type(e).__name__}: {e}"})
  finally:
    trainer.close()
    channel.close()
