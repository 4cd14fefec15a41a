"""Multi-process GPU tests: 4 processes x 1 GPU under jax.distributed on loopback.

Each test starts tests/multiprocess_gpu_worker.py four times at once (process i owns GPU
i via local_device_ids=[i]); the NCCL unique id travels through jax.distributed's
key-value store. Every process must finish within a timeout; a hang fails the test
(the processes are killed). Skipped without 4 GPUs (CI). This process never touches
the GPUs itself (JAX would preallocate their memory).

Run on the GPU machine:
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/multiprocess_gpu_test.py
"""

import os
import shutil
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_gpu_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4


def _gpu_count() -> int:
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


pytestmark = pytest.mark.skipif(_gpu_count() < N, reason=f"needs {N} GPUs")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(scenario: str, timeout_s: float = 300.0) -> list[str]:
  port = _free_port()
  env = dict(os.environ)
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("JAX_PLATFORMS", None)
  procs = [subprocess.Popen(
      [sys.executable, WORKER, "--process-id", str(i), "--num-processes", str(N),
       "--port", str(port), "--scenario", scenario],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
      for i in range(N)]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout_s)
      outputs.append(out)
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    tails = [(p.communicate()[0] or "")[-2000:] for p in procs]
    pytest.fail(f"{scenario}: a process hung past {timeout_s} s; output tails: {tails}")
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"RESULT {scenario} process={i} ok" in out, (
        f"{scenario}: process {i} exited {p.returncode}:\n{out[-4000:]}")
  return [next(line for line in out.splitlines() if line.startswith("RESULT"))
          for out in outputs]


def test_refit_2_plus_2():
  for line in _run("refit"):
    print(line)


def test_peer_never_arrives_times_out():
  lines = _run("timeout")
  receiver = lines[1]
  assert "error=True" in receiver or "raised_after_s" in receiver, receiver
  assert "next_call_raised" in receiver, receiver
