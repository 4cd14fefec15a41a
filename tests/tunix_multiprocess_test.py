"""tunix's weight sync across two CPU processes under jax.distributed (127.0.0.1): the
trainer's weights on process 0's devices, the rollout's on process 1's, through
tunix.rl.reshard.reshard_pytree with jax_m2n's adapter, under tunix's transfer guard,
bitwise on process 1 (tests/tunix_multiprocess_worker.py). tunix's GRPO itself does not
run across processes (its sampler fetches the rollout's output on every process:
docs/tunix.md), so the sync is tested through reshard_pytree. Needs jax_m2n's
cross-process CPU path (jax_m2n._src.processes); skipped where it is absent. Every
launch is bounded and its children killed on timeout."""

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "tunix_multiprocess_worker.py")

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("jax_m2n._src.processes") is None,
        reason="this jax_m2n has no cross-process CPU reshard (jax_m2n._src.processes)"),
    pytest.mark.skipif(importlib.util.find_spec("tunix") is None,
                       reason="needs google-tunix (the jax_m2n[tunix] extra)")]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("layout", ["fsdp2xtp2"])
def test_reshard_pytree_across_two_processes(layout):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_PLATFORMS", None)
  port = _free_port()
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), layout], env=env,
                            stdout=logs[i], stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    for i, p in enumerate(procs):
      try:
        p.wait(timeout=240)
      except subprocess.TimeoutExpired:
        pytest.fail(f"process {i} hung")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
  outs = []
  for f in logs:
    f.seek(0)
    outs.append(f.read())
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"
    assert f"DONE process={i} ok=True reshard_calls=3" in out, out[-3000:]
  results = [line for line in outs[1].splitlines() if line.startswith("RESULT")]
  assert len(results) == 3 and all("bitwise=True" in r for r in results), results
  # The rollout's shards are all on process 1: 35 leaves x 4 devices.
  assert all("local_out_shards=140" in r for r in results), results
  assert all("local_out_shards=0" in r for r in outs[0].splitlines()
             if r.startswith("RESULT"))
