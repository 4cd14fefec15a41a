"""The worker processes of a multi-process test, bounded: started with this repository
on PYTHONPATH, each writing to its own log file, waited for until one deadline, and all
killed (whatever happened) before the test goes on. Shared by multiprocess_cpu_test,
multiprocess_gpu_test and tunix_multiprocess_test (a helper module: tests/BUILD)."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Sequence

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
  """A TCP port on 127.0.0.1 free right now (the coordinator's)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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


def tails(workers: Sequence[Worker], chars: int = 3000) -> str:
  """The end of every worker's log, for a failure message."""
  return "\n".join(f"--- process {i} ({w.log}):\n{w.output[-chars:]}"
                   for i, w in enumerate(workers))
