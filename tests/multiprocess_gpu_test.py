"""Multi-process GPU tests: 4 processes x 1 GPU under jax.distributed on loopback.

Scenarios (tests/multiprocess_gpu_worker.py): a refit over NCCL; a peer that never
arrives; and the refit with NCCL forced onto its socket transport, each process its own
domain (the multi-node path on one host).

Each test starts tests/multiprocess_gpu_worker.py four times at once (2 on a 2-GPU
machine; process i owns GPU
i via local_device_ids=[i]); the NCCL unique id travels through jax.distributed's
key-value store. Every process must finish within a timeout; a hang fails the test
(the processes are killed). Skipped without 2 GPUs (CI). This process never touches
the GPUs itself (JAX would preallocate their memory).

Run on the GPU machine:
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/multiprocess_gpu_test.py
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_gpu_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_count() -> int:
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# 4 processes (2 + 2 refit) where 4 GPUs exist, else 2 (1 + 1).
N = 4 if _gpu_count() >= 4 else 2
pytestmark = pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (4 for 2 + 2)")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(scenario: str, timeout_s: float = 150.0, extra_env=None) -> list[str]:
  """Runs the N workers of `scenario`; returns each one's RESULT line.

  Fails (killing the others) as soon as one worker exits non-zero, or when the deadline
  passes. Worker output goes to files in $JAX_M2N_MP_LOGDIR (default: a temp dir).
  """
  port = _free_port()
  env = dict(os.environ)
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["PYTHONUNBUFFERED"] = "1"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("JAX_PLATFORMS", None)
  env.update(extra_env or {})
  logdir = os.environ.get("JAX_M2N_MP_LOGDIR") or tempfile.mkdtemp(prefix="jax_m2n_mp_")
  os.makedirs(logdir, exist_ok=True)
  paths = [os.path.join(logdir, f"{scenario}_{i}.log") for i in range(N)]
  files = [open(path, "w") for path in paths]
  procs = [subprocess.Popen(
      [sys.executable, WORKER, "--process-id", str(i), "--num-processes", str(N),
       "--port", str(port), "--scenario", scenario],
      stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
      for i, f in enumerate(files)]
  deadline = time.monotonic() + timeout_s
  failure = None
  while failure is None and any(p.poll() is None for p in procs):
    for i, p in enumerate(procs):
      if p.poll() not in (None, 0):
        failure = f"process {i} exited {p.returncode}"
    if time.monotonic() > deadline:
      failure = f"a process hung past {timeout_s} s"
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  for f in files:
    f.close()
  outputs = [open(path).read() for path in paths]
  if failure is None:
    for i, (p, out) in enumerate(zip(procs, outputs)):
      if p.returncode != 0 or f"RESULT {scenario} process={i} ok" not in out:
        failure = f"process {i} exited {p.returncode} without its RESULT line"
  if failure is not None:
    tails = "\n".join(f"--- process {i} ({paths[i]}):\n{out[-3000:]}"
                      for i, out in enumerate(outputs))
    pytest.fail(f"{scenario}: {failure}\n{tails}")
  return [next(line for line in out.splitlines() if line.startswith("RESULT"))
          for out in outputs]


def test_refit():
  for line in _run("refit"):
    print(line)


def test_peer_never_arrives_times_out():
  lines = _run("timeout")
  receiver = lines[1]
  assert "error=True" in receiver or "raised_after_s" in receiver, receiver
  assert "next_call_raised" in receiver, receiver


# NCCL's network transport (sockets over loopback) instead of NVLink P2P and shared memory:
# the path multi-node users run, on one host (docs/cuda_transport.md, "Across processes").
NET_SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
                  "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def test_nccl_socket_transport_each_process_a_domain():
  for line in _run("netsocket", timeout_s=240.0, extra_env=NET_SOCKET_ENV):
    print(line)
