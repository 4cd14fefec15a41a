"""The worker processes of a multi-process test, bounded: started with this repository
on PYTHONPATH, each writing to its own log file, waited for until one deadline, and all
killed (whatever happened) before the test goes on. `run` starts a job's processes
together (multiprocess_cpu_test, multiprocess_gpu_test, tunix_multiprocess_test);
`Procs` starts separate programs one at a time (jobs_test, jobs_relay_test). A helper
module: tests/BUILD."""

import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How often the launcher looks at its workers while it waits.
_POLL_S = 0.05


class Worker(NamedTuple):
  """One finished (or killed) worker: its exit status, its output, its log file."""

  returncode: int
  output: str
  log: str


def free_port() -> int:
  """A TCP port on 127.0.0.1 free right now (the coordinator's), below the kernel's
  ephemeral range (net.ipv4.ip_local_port_range, 32768 and up by default): a port
  the kernel handed out here could be handed to another process's socket before the
  coordinator binds it ("Failed to add port to server", seen with tests running
  alongside)."""
  rng = random.Random()
  for _ in range(200):
    port = rng.randrange(20000, 32768)
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return port
  raise RuntimeError("free_port: no free port in 20000-32767 after 200 tries")


def worker_env(extra: dict | None = None) -> dict:
  """The test's environment for a worker: this repository importable, output
  unbuffered, and no XLA_FLAGS / JAX_PLATFORMS of the test process (each worker sets
  its own devices); `extra` on top."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_PLATFORMS", None)
  env.update(extra or {})
  return env


def run_python(code: str, env: dict | None = None,
               timeout_s: float = 300) -> subprocess.CompletedProcess:
  """`python -c code` in a process of its own (`worker_env(env)`), bounded; its output
  captured, its exit status for the caller to check."""
  return subprocess.run([sys.executable, "-c", code], env=worker_env(env),
                        capture_output=True, text=True, timeout=timeout_s, check=False)


def read(path: str) -> str:
  with open(path) as f:
    return f.read()


def run(argvs: Sequence[Sequence[str]], *, name: str, timeout_s: float,
        env: dict | None = None, logdir: str | None = None,
        wait_for: Sequence[int] | None = None, fail_fast: bool = False,
        started: Callable[[list, list[str], float], None] | None = None) -> list[Worker]:
  """Runs `python argv` for each argv at once; returns every worker's outcome.

  Args:
    argvs: per worker, the arguments after the Python interpreter.
    name: names the log files (`{name}_{i}.log` in `logdir`, default a new temp dir)
      and the failure message.
    timeout_s: one deadline for every worker: a worker still running then fails the
      test (pytest.fail, with the log tails), after every worker was killed.
    env: the workers' environment (default `worker_env()`).
    wait_for: the workers to wait for (default all); the others are killed once those
      have finished (e.g. a process that is meant never to arrive).
    fail_fast: stop waiting as soon as any worker exits non-zero.
    started: called once every worker has started, with (processes, log paths,
      deadline), e.g. to signal one of them.
  """
  logdir = logdir or tempfile.mkdtemp(prefix="jax_m2n_mp_")
  os.makedirs(logdir, exist_ok=True)
  paths = [os.path.join(logdir, f"{name}_{i}.log") for i in range(len(argvs))]
  procs: list[subprocess.Popen] = []
  hung = None
  try:
    for argv, path in zip(argvs, paths):
      with open(path, "w") as log:  # the child holds its own descriptor
        procs.append(subprocess.Popen([sys.executable, *argv], env=env or worker_env(),
                                      stdout=log, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    if started is not None:
      started(procs, paths, deadline)
    waited = range(len(procs)) if wait_for is None else wait_for
    while True:
      pending = [i for i in waited if procs[i].poll() is None]
      if not pending or (fail_fast and any(p.poll() not in (None, 0) for p in procs)):
        break
      if time.monotonic() > deadline:
        hung = pending[0]
        break
      time.sleep(_POLL_S)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
  workers = [Worker(p.returncode, read(path), path) for p, path in zip(procs, paths)]
  if hung is not None:
    pytest.fail(f"{name}: process {hung} hung past {timeout_s:g} s:\n" + tails(workers))
  return workers


class Procs:
  """Separate programs started one at a time, sharing one directory (their hand-over
  files), each with its log file there; `kill()` ends those still running (a fixture's
  teardown)."""

  def __init__(self, prefix: str):
    self.dir = tempfile.mkdtemp(prefix=prefix)
    self.procs: dict[str, tuple[subprocess.Popen, Any]] = {}  # name -> (Popen, log)

  def start(self, name: str, argv: Sequence[str], env: dict | None = None,
            hosts: Any = None, host: int = 0) -> subprocess.Popen:
    """Starts `python argv` as `name`; with `hosts` (EmulatedHosts) on host `host`."""
    log = open(os.path.join(self.dir, f"{name}.log"), "w+")
    argv = [sys.executable, *map(str, argv)]
    kw = dict(env=env or worker_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    p = subprocess.Popen(argv, **kw) if hosts is None else hosts.popen(host, argv, **kw)
    self.procs[name] = (p, log)
    return p

  def proc(self, name: str) -> subprocess.Popen:
    return self.procs[name][0]

  def wait(self, names: Sequence[str], timeout: float) -> None:
    """Waits until the programs `names` have exited, `timeout` s for all of them; one
    still running then fails the test (pytest.fail, with the logs) after kill()."""
    deadline = time.monotonic() + timeout
    for name in names:
      try:
        self.proc(name).wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        text = self.logs()
        self.kill()
        pytest.fail(f"{name} hung:\n{text}")

  def kill(self) -> None:
    for p, _ in self.procs.values():
      if p.poll() is None:
        p.kill()
    for p, _ in self.procs.values():
      p.wait()

  def logs(self, tail: int = 4000) -> str:
    """The end of every program's log, for a failure message."""
    return "\n".join(f"--- {name}\n" + self._read(log)[-tail:]
                     for name, (_, log) in self.procs.items())

  def results(self, what: str) -> list[tuple[str, dict, str]]:
    """Every "RESULT <what> key=value ..." line the programs printed, as (program,
    {key: value}, line)."""
    return [(name, dict(re.findall(r"(\w+)=(\S+)", line)), line)
            for name, (_, log) in self.procs.items()
            for line in self._read(log).splitlines()
            if line.startswith(f"RESULT {what} ")]

  @staticmethod
  def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def tails(workers: Sequence[Worker], chars: int = 3000) -> str:
  """The end of every worker's log, for a failure message."""
  return "\n".join(f"--- process {i} ({w.log}):\n{w.output[-chars:]}"
                   for i, w in enumerate(workers))
