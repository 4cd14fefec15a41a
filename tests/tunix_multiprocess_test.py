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

import pytest

import launcher

WORKER = os.path.join(launcher.ROOT, "tests", "tunix_multiprocess_worker.py")

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("jax_m2n._src.processes") is None,
        reason="this jax_m2n has no cross-process CPU reshard (jax_m2n._src.processes)"),
    pytest.mark.skipif(importlib.util.find_spec("tunix") is None,
                       reason="needs google-tunix (the jax_m2n[tunix] extra)")]


@pytest.mark.parametrize("layout", ["fsdp2xtp2"])
def test_reshard_pytree_across_two_processes(layout):
  port = launcher.free_port()
  workers = launcher.run([[WORKER, str(i), str(port), layout] for i in range(2)],
                         name=f"tunix_{layout}_{port}", timeout_s=240)
  outs = [w.output for w in workers]
  for i, (w, out) in enumerate(zip(workers, outs)):
    assert w.returncode == 0, f"process {i}:\n{out[-3000:]}"
    assert f"DONE process={i} ok=True reshard_calls=3" in out, out[-3000:]
  results = [line for line in outs[1].splitlines() if line.startswith("RESULT")]
  assert len(results) == 3 and all("bitwise=True" in r for r in results), results
  # The rollout's shards are all on process 1: 35 leaves x 4 devices.
  assert all("local_out_shards=140" in r for r in results), results
  assert all("local_out_shards=0" in r for r in outs[0].splitlines()
             if r.startswith("RESULT"))
