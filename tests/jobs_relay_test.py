"""Relays among subscriber jobs (separate programs on 127.0.0.1): subscribers of one
group (same dst layouts and dtype) form a relay per version, a bfloat16 subscriber
relays in its own group; over several versions one joins late, one leaves cleanly,
one dies mid-version while others pull from it, one is killed at a random point.
Every surviving subscriber gets every version from its first bitwise, the trainer
sends the group one copy per version while nobody fails, and the publisher keeps
publishing. Workers: tests/jobs_relay_worker.py; every launch is bounded and every
process killed at the end."""

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "jobs_relay_worker.py")
VERSIONS = 6
MIB = 4


class Procs:
  """Started workers sharing one directory; each with its log file."""

  def __init__(self):
    self.dir = tempfile.mkdtemp(prefix="m2n_relay_")
    self.procs = {}  # name -> (Popen, log)

  def start(self, role, name, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    log = open(os.path.join(self.dir, f"{name}.log"), "w+")
    p = subprocess.Popen([sys.executable, WORKER, "--role", role, "--name", name,
                          "--dir", self.dir, "--versions", str(VERSIONS),
                          "--mib", str(MIB), *map(str, extra)],
                         env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    self.procs[name] = (p, log)
    return p

  def wait(self, names, timeout):
    deadline = time.monotonic() + timeout
    for name in names:
      try:
        self.procs[name][0].wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        text = self.logs()
        self.kill()
        pytest.fail(f"{name} hung:\n{text}")

  def kill(self):
    for p, _ in self.procs.values():
      if p.poll() is None:
        p.kill()
    for p, _ in self.procs.values():
      p.wait()

  def logs(self, tail=4000):
    out = []
    for name, (_, log) in self.procs.items():
      log.flush()
      log.seek(0)
      out.append(f"--- {name}\n" + log.read()[-tail:])
    return "\n".join(out)

  def results(self, what):
    found = []
    for name, (_, log) in self.procs.items():
      log.flush()
      log.seek(0)
      for line in log.read().splitlines():
        if line.startswith(f"RESULT {what} "):
          found.append((name, dict(re.findall(r"(\w+)=(\S+)", line)), line))
    return found


@pytest.fixture
def procs():
  p = Procs()
  yield p
  p.kill()


def _published(procs, version, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if any(int(f["version"]) >= version for _, f, _ in procs.results("published")):
      return
    if procs.procs["trainer"][0].poll() is not None:
      break
    time.sleep(0.05)
  pytest.fail(f"version {version} was not published in time:\n" + procs.logs())


def test_joins_leaves_and_deaths_over_versions(procs):
  rng = random.Random(int(os.environ.get("JAX_M2N_RELAY_SEED", "34")))
  leave, die, join = rng.randint(1, 3), rng.randint(2, 3), rng.randint(1, 3)
  chunks = rng.randint(1, 6)
  print(f"b leaves after version {leave}; c dies from version {die} once it forwarded "
        f"{chunks} chunk(s); f joins after version {join}")
  procs.start("trainer", "trainer", "--wait-for", 5, "--period", 2.0)
  # a: stays; b: leaves cleanly; c: dies mid-version (once it has forwarded some
  # chunks to a child); d: killed at a random point; e: its own group (bfloat16);
  # f: joins later.
  procs.start("subscriber", "a", "--chunk-kib", 256)
  procs.start("subscriber", "b", "--chunk-kib", 256, "--leave-after", leave)
  procs.start("subscriber", "c", "--chunk-kib", 256, "--die-version", die,
              "--die-chunks", chunks)
  procs.start("subscriber", "d", "--chunk-kib", 256)
  procs.start("subscriber", "e", "--chunk-kib", 256, "--dtype", "bfloat16")
  _published(procs, join)
  procs.start("subscriber", "f", "--chunk-kib", 256)
  _published(procs, 3)
  time.sleep(rng.uniform(0.0, 2.0 * 2))  # a random point within versions 3-4
  procs.procs["d"][0].send_signal(signal.SIGKILL)
  procs.wait(["d"], 30)
  procs.wait(["a", "b", "c", "e", "f"], 240)
  open(os.path.join(procs.dir, "done"), "w").close()
  procs.wait(["trainer"], 60)
  text = procs.logs()

  pulled = {}
  for name, f, line in procs.results("pulled"):
    assert f["ok"] == "1", line
    pulled.setdefault(name, []).append(int(f["version"]))
  # Every survivor got every version from its first, in order, bitwise (checked by
  # the worker), and exited cleanly.
  for name in ("a", "e"):
    assert pulled.get(name) == list(range(1, VERSIONS + 1)), (name, text)
  assert pulled["f"] == list(range(pulled["f"][0], VERSIONS + 1)) and (
      pulled["f"][0] >= join), text
  for name in ("a", "b", "e", "f", "trainer"):
    assert procs.procs[name][0].returncode == 0, (name, text)
  # A clean leave.
  assert pulled["b"] == list(range(1, leave + 1)) and procs.results("left"), text
  # c died mid-version (rc 9) and d was killed; the publisher published every version.
  assert procs.procs["c"][0].returncode == 9 and procs.results("dying"), text
  assert procs.procs["d"][0].returncode == -signal.SIGKILL, text
  assert len(procs.results("published")) == VERSIONS, text

  # The trainer sent the float32 group one copy of version 1 (everyone was present),
  # and each other member got it from another member.
  payload = 2 * int(re.search(r"trainer=(\d+)", next(
      line for n, f, line in procs.results("pulled") if n == "e")).group(1))
  v1 = [f for n, f, _ in procs.results("pulled") if f["version"] == "1" and n != "e"]
  assert len(v1) == 4 and sum(int(f["trainer"]) for f in v1) == payload, text
  assert sum(int(f["peers"]) for f in v1) == 3 * payload, text
  # Where c died while forwarding, the member after it re-routed and still got that
  # version bitwise (above).
  dying = procs.results("dying")[0][1]
  if "forwarding" in dying:
    v = dying["version"]
    rerouted = [f for _, f, _ in procs.results("pulled")
                if f["version"] == v and int(f["reroutes"]) > 0]
    assert rerouted, text
    # How long after the death the re-routed member had the version (a measurement,
    # printed; the bench reports it over shaped links).
    recovered = max(float(f["at"]) for f in rerouted) - float(dying["at"])
    print(f"c died forwarding version {v}; the member after it had it "
          f"{recovered:.3f} s later")
  print("\n".join(line for _, _, line in procs.results("pulled") + procs.results("dying")
                  + procs.results("left")))
