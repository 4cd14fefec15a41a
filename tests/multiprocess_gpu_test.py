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

import pytest

import gpus
import launcher

WORKER = os.path.join(launcher.ROOT, "tests", "multiprocess_gpu_worker.py")

# 4 processes (2 + 2 refit) where 4 GPUs exist, else 2 (1 + 1).
N = 4 if gpus.count_without_jax() >= 4 else 2
pytestmark = pytest.mark.skipif(gpus.count_without_jax() < 2,
                                reason="needs 2 GPUs (4 for 2 + 2)")


def _run(scenario: str, timeout_s: float = 150.0, extra_env=None) -> list[str]:
  """Runs the N workers of `scenario`; returns each one's RESULT line.

  Fails (killing the others) as soon as one worker exits non-zero, or when the deadline
  passes. Worker output goes to files in $JAX_M2N_MP_LOGDIR (default: a temp dir).
  """
  port = launcher.free_port()
  env = launcher.worker_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                             **(extra_env or {})})
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  workers = launcher.run(
      [[WORKER, "--process-id", str(i), "--num-processes", str(N), "--port", str(port),
        "--scenario", scenario] for i in range(N)],
      name=scenario, timeout_s=timeout_s, env=env, fail_fast=True,
      logdir=os.environ.get("JAX_M2N_MP_LOGDIR"))
  for i, w in enumerate(workers):
    if w.returncode != 0 or f"RESULT {scenario} process={i} ok" not in w.output:
      pytest.fail(f"{scenario}: process {i} exited {w.returncode} without its RESULT "
                  f"line\n{launcher.tails(workers)}")
  return [next(line for line in w.output.splitlines() if line.startswith("RESULT"))
          for w in workers]


def test_refit():
  for line in _run("refit"):
    print(line)


def test_peer_never_arrives_times_out():
  lines = _run("timeout")
  receiver = lines[1]
  assert "error=True" in receiver or "raised_after_s" in receiver, receiver
  assert "next_call_raised" in receiver, receiver


# NCCL's network transport (sockets over loopback) instead of NVLink P2P and shared memory:
# the path multi-node users run, on one host (docs/cuda_transport.md, "Tests and benchmark").
NET_SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
                  "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def test_nccl_socket_transport_each_process_a_domain():
  for line in _run("netsocket", timeout_s=240.0, extra_env=NET_SOCKET_ENV):
    print(line)
