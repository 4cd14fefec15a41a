"""Full-weight GRPO through tunix's public API with jax_m2n as its weight-sync backend
(examples/tunix_grpo.py's run_grpo): the trainer and the rollout on disjoint meshes
(fsdp2 x tp2 on devices 0-3 -> tp4 on 4-7, and fsdp4 -> tp4), every nnx.Param synced
under tunix's transfer guard; after every sync the rollout's weights equal the
trainer's bit for bit, on the rollout's mesh. tunix's own device_put fallback fails at
the first sync in the same setting (the guard refuses its host round trip)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
pytest.importorskip("tunix", reason="needs google-tunix (the jax_m2n[tunix] extra)")
pytest.importorskip("grain", reason="needs grain (google-tunix's data loader)")
from flax import nnx  # noqa: E402

from examples import tunix_grpo  # noqa: E402
from jax_m2n.integrations import tunix as m2n_tunix  # noqa: E402

STEPS = 2


@pytest.fixture(autouse=True)
def _uninstalled_after():
  yield
  m2n_tunix.uninstall()


@pytest.mark.parametrize("layout", tunix_grpo.TRAINER_LAYOUTS)
def test_full_weight_grpo_across_disjoint_meshes(layout):
  trainer, rollout = tunix_grpo.meshes(layout)
  assert not set(trainer.devices.flat) & set(rollout.devices.flat)
  run, cluster = tunix_grpo.run_grpo(trainer, rollout, STEPS, use_jax_m2n=True,
                                     max_tokens=4)
  assert run.error is None
  assert len(run.syncs) == STEPS
  assert all(s.bitwise_equal and s.on_rollout_mesh for s in run.syncs), run.syncs
  # Model loading onto the rollout mesh and each sync went through jax_m2n.
  assert run.reshard_calls >= STEPS + 1
  params = jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param))
  assert len(params) == len(jax.tree.leaves(nnx.state(cluster.actor_trainer.model)))
  assert all(p.sharding.mesh == trainer for p in params)


def test_tunixs_device_put_fallback_fails_at_the_first_sync():
  """The guard the syncs above ran under is live: without the adapter, tunix's
  jax.device_put fallback is refused its host -> device copy."""
  trainer, rollout = tunix_grpo.meshes("fsdp2xtp2")
  run, _ = tunix_grpo.run_grpo(trainer, rollout, STEPS, use_jax_m2n=False,
                               max_tokens=4)
  assert run.syncs == [] and run.reshard_calls == 0
  assert "Disallowed host-to-device transfer" in run.error
