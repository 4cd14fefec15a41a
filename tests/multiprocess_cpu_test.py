"""Reshards across CPU processes under jax.distributed (127.0.0.1): randomized layout
pairs bitwise on every process, a trainer -> generator pytree refit with dtype= and
donation, bytes across processes vs the plan, mismatched arguments, and failures
(a process that raises before the call, dies mid-transfer, never arrives; Ctrl-C)
with their time to fail. Workers: tests/multiprocess_cpu_worker.py; every launch is
bounded and its children killed on timeout."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_cpu_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(num_processes, devices, scenario, *extra, timeout=240, interrupt=None):
  """Runs the worker in every process; returns their outputs (stdout + stderr).
  `interrupt`: a process id sent SIGINT once every process has printed WAITING."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_PLATFORMS", None)
  port = _free_port()
  logs = [open(os.devnull, "w")] * 0
  procs, files = [], []
  for i in range(num_processes):
    f = open(os.path.join(_tmp(), f"{scenario}_{port}_{i}.log"), "w+")
    files.append(f)
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, "--process-id", str(i), "--num-processes",
         str(num_processes), "--devices", str(devices), "--port", str(port),
         "--scenario", scenario, *extra], env=env, stdout=f, stderr=subprocess.STDOUT,
        text=True))
  deadline = time.monotonic() + timeout
  try:
    if interrupt is not None:
      while time.monotonic() < deadline:
        waiting = sum("WAITING" in _read(f) for k, f in enumerate(files)
                      if k != num_processes - 1)
        if waiting == num_processes - 1:
          break
        time.sleep(0.1)
      time.sleep(0.5)
      procs[interrupt].send_signal(signal.SIGINT)
    for k, p in enumerate(procs):
      left = deadline - time.monotonic()
      if scenario in ("absent", "interrupt") and k == num_processes - 1:
        continue  # the absent process sleeps: killed below
      try:
        p.wait(timeout=max(1.0, left))
      except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: process {k} hung:\n" + _read(files[k])[-3000:])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
  return [_read(f) for f in files]


_TMP = []


def _tmp():
  if not _TMP:
    import tempfile
    _TMP.append(tempfile.mkdtemp(prefix="m2n_mp_"))
  return _TMP[0]


def _read(f) -> str:
  f.flush()
  f.seek(0)
  return f.read()


def results(outs, what):
  """The RESULT lines for `what`, as (process, fields dict, line)."""
  found = []
  for out in outs:
    for line in out.splitlines():
      m = re.match(rf"RESULT {what} process=(\d+) (.*)", line)
      if m:
        fields = dict(re.findall(r"(\w+)=(\S+)", m.group(2)))
        found.append((int(m.group(1)), fields, line))
  return found


def _no_fail(outs, n_ok_processes):
  text = "\n".join(outs)
  assert " FAIL" not in text, text[-6000:]
  assert text.count("DONE process=") >= n_ok_processes, text[-6000:]
