r"""tunix GRPO with jax_m2n as its weight-sync backend, trainer and rollout on disjoint meshes.

tunix's GRPO (full weights: every nnx.Param, no LoRA) trains its toy transformer
(tunix.tests.test_common.ToyTransformer) on the first half of the devices and samples
on the second half; after every global step `RLCluster.sync_weights` moves the weights
through `tunix.rl.reshard.reshard_pytree`, which `jax_m2n.integrations.tunix.install()`
points at `jax_m2n.reshard`. The same run then tries tunix's own fallback
(`jax.device_put`, the adapter uninstalled) and says whether it works and why not; and
times both backends on the trained weights outside GRPO (the fallback without tunix's
transfer guard, the only way it runs on CPU). Every sync is checked: the rollout's
weights equal the trainer's bit for bit, on the rollout's mesh.

Usage (from the repository root, with jax_m2n[tunix] installed; without a GPU it runs
on 8 CPU devices, $JAX_M2N_CPU_DEVICES to change):
  python examples/tunix_grpo.py                      # fsdp2 x tp2 (devices 0-3) -> tp4 (4-7)
  python examples/tunix_grpo.py --trainer=fsdp4 --steps=4 --json=out/tunix_grpo.json
"""

# requirements: tunix
# (The requirement sets this example needs beyond the main job's, files of
# requirements/: ./scripts/run_example.sh installs them when it runs this example.)

import os

from jax_m2n.testing import workers  # before JAX starts its backend

if __name__ == "__main__":
  workers.default_to_cpu_devices()

# pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib
import dataclasses
import json
import statistics
import time
import traceback
from typing import Any, Optional

from absl import app
from absl import flags
from absl import logging
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import reshard as tunix_reshard
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

from jax_m2n.integrations import tunix as m2n_tunix

TRAINER_LAYOUTS = ("fsdp2xtp2", "fsdp4")
PROMPTS = ["input string", "hello world", "My name", "hello there"]  # MockVocab's words

_TRAINER = flags.DEFINE_enum("trainer", "fsdp2xtp2", TRAINER_LAYOUTS,
                             "the trainer's mesh on the first half of the devices "
                             "(fsdp x tp); the rollout's is tp over the other half")
_STEPS = flags.DEFINE_integer("steps", 3, "GRPO global steps (one weight sync each)")
_REPS = flags.DEFINE_integer("timing_reps", 5, "weight syncs timed per backend after GRPO")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")


def meshes(trainer_layout: str) -> tuple[Mesh, Mesh]:
  """(trainer, rollout): the first half of the devices as fsdp x tp, the second as tp."""
  devices = sorted(jax.devices(), key=lambda d: d.id)
  half = len(devices) // 2
  if half < 1 or half % 2:
    raise SystemExit(f"tunix_grpo: needs an even number of devices >= 4 (or 2 for "
                     f"--trainer=fsdp4 style meshes); got {len(devices)}.")
  fsdp = {"fsdp2xtp2": 2, "fsdp4": half}[trainer_layout]
  trainer = Mesh(np.array(devices[:half]).reshape(fsdp, half // fsdp), ("fsdp", "tp"))
  rollout = Mesh(np.array(devices[half:]).reshape(1, half), ("fsdp", "tp"))
  return trainer, rollout


@dataclasses.dataclass
class Sync:
  """One RLCluster.sync_weights: its wall time, the reshard inside it, and the check."""
  seconds: float
  reshard_seconds: float
  bitwise_equal: bool
  on_rollout_mesh: bool


@dataclasses.dataclass
class GrpoRun:
  backend: str  # "jax_m2n" or "device_put"
  syncs: list[Sync]
  error: Optional[str]  # why the run stopped, None when it finished
  reshard_calls: int  # calls that reached jax_m2n.integrations.tunix


def _reward(completions, **kwargs):
  del kwargs
  return jnp.arange(len(completions))


def _dataset(steps: int):
  prompts = (PROMPTS * (steps // 2 + 1))[:2 * steps]
  return (grain.MapDataset.source(prompts).batch(2)
          .map(lambda x: {"prompts": x, "answer": x}))


def _params_equal(trainer: Any, rollout: Any, rollout_mesh: Mesh) -> tuple[bool, bool]:
  a, b = jax.tree.leaves(trainer), jax.tree.leaves(rollout)
  equal = len(a) == len(b) and all(
      x.shape == y.shape and x.dtype == y.dtype
      and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
      for x, y in zip(a, b))
  on_mesh = all(getattr(y.sharding, "mesh", None) == rollout_mesh for y in b)
  return equal, on_mesh


@contextlib.contextmanager
def _timed_reshards(times: list[float]):
  """Times each tunix.rl.reshard.reshard_pytree call to completion (the rollout's
  update_params looks it up on the module at every call)."""
  inner = tunix_reshard.reshard_pytree

  def timed(*args, **kwargs):
    start = time.perf_counter()
    out = jax.block_until_ready(inner(*args, **kwargs))
    times.append(time.perf_counter() - start)
    return out

  tunix_reshard.reshard_pytree = timed
  try:
    yield
  finally:
    tunix_reshard.reshard_pytree = inner


def run_grpo(trainer_mesh: Mesh, rollout_mesh: Mesh, steps: int, use_jax_m2n: bool,
             max_tokens: int = 10) -> tuple[GrpoRun, Any]:
  """tunix GRPO for `steps` global steps with full weights; returns the run and the
  RLCluster. Every sync_weights is timed and checked (rollout == trainer, bitwise)."""
  if use_jax_m2n:
    m2n_tunix.install()
  else:
    m2n_tunix.uninstall()
  calls = m2n_tunix.reshard_count()
  vocab = tc.MockVocab()
  config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
  actor = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
  reference = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: trainer_mesh,
                    rl_cluster_lib.Role.REFERENCE: trainer_mesh,
                    rl_cluster_lib.Role.ROLLOUT: rollout_mesh},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=100, max_steps=steps),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=max_tokens, max_prompt_length=32, kv_cache_size=64),
  )
  cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=vocab,
                                     cluster_config=cluster_config)
  learner = grpo_lib.GRPOLearner(
      rl_cluster=cluster, reward_fns=_reward,
      algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1))
  syncs: list[Sync] = []
  sync = cluster.sync_weights
  reshard_times: list[float] = []

  def checked_sync():
    start = time.perf_counter()
    with _timed_reshards(reshard_times):
      sync()
    jax.block_until_ready(nnx.state(cluster.rollout.model(), nnx.Param))
    seconds = time.perf_counter() - start
    equal, on_mesh = _params_equal(nnx.state(cluster.actor_trainer.model, nnx.Param),
                                   nnx.state(cluster.rollout.model(), nnx.Param),
                                   rollout_mesh)
    syncs.append(Sync(seconds, sum(reshard_times), equal, on_mesh))
    reshard_times.clear()

  cluster.sync_weights = checked_sync
  error = None
  try:
    learner.train(_dataset(steps), None)
  except Exception as e:  # pylint: disable=broad-exception-caught
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]} (in {_where(e)})"
  run = GrpoRun("jax_m2n" if use_jax_m2n else "device_put", syncs, error,
                m2n_tunix.reshard_count() - calls)
  return run, cluster


def _where(e: BaseException) -> str:
  """The innermost frames of e's traceback outside JAX and jax_m2n: who asked."""
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if not any(p in f.filename for p in ("/jax/", "/jaxlib/", "/jax_m2n/"))]
  return " <- ".join(f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno} {f.name}"
                     for f in reversed(frames[-3:])) or "?"


def time_backend(src: Any, dst: Any, use_jax_m2n: bool, reps: int,
                 guard: bool) -> list[float]:
  """Seconds per `reshard_pytree(src, dst)` to completion, after one warm-up call;
  `guard`: under the transfer guard sync_weights sets on CPU."""
  if use_jax_m2n:
    m2n_tunix.install()
  else:
    m2n_tunix.uninstall()
  times = []
  for i in range(reps + 1):
    with contextlib.ExitStack() as stack:
      if guard:
        stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
        stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
      start = time.perf_counter()
      jax.block_until_ready(tunix_reshard.reshard_pytree(src, dst))
      if i:
        times.append(time.perf_counter() - start)
  return times


def _ms(seconds: list[float]) -> str:
  return f"{1e3 * statistics.median(seconds):.2f} ms" if seconds else "-"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # tunix logs every reshard at INFO
  trainer, rollout = meshes(_TRAINER.value)
  platform = jax.devices()[0].platform
  print(f"tunix_grpo: {platform}, trainer {dict(trainer.shape)} on devices "
        f"{[d.id for d in trainer.devices.flat]}, rollout {dict(rollout.shape)} on "
        f"{[d.id for d in rollout.devices.flat]}, {_STEPS.value} GRPO steps, full weights")
  runs = {}
  cluster = None
  for use in (True, False):
    run, c = run_grpo(trainer, rollout, _STEPS.value, use)
    runs[run.backend] = run
    cluster = c if use else cluster
    for i, s in enumerate(run.syncs):
      print(f"  {run.backend:10s} sync {i + 1}: {1e3 * s.seconds:8.2f} ms "
            f"(reshard {1e3 * s.reshard_seconds:.2f} ms), rollout == trainer bitwise: "
            f"{s.bitwise_equal}, on the rollout mesh: {s.on_rollout_mesh}")
    print(f"  {run.backend:10s} " + ("finished" if run.error is None else
                                     f"failed at sync {len(run.syncs) + 1}: {run.error}"))
  src = nnx.state(cluster.actor_trainer.model, nnx.Param)
  dst = nnx.state(cluster.rollout.model(), nnx.Param)
  nbytes = sum(a.nbytes for a in jax.tree.leaves(src))
  m2n_times = time_backend(src, dst, True, _REPS.value, guard=platform == "cpu")
  put_times = time_backend(src, dst, False, _REPS.value, guard=False)
  guarded = " under tunix's guard" if platform == "cpu" else ""
  print(f"weight sync of {len(jax.tree.leaves(src))} arrays, {nbytes / 2**20:.2f} MiB "
        f"(reshard_pytree, median of {_REPS.value}): jax_m2n {_ms(m2n_times)}{guarded}, "
        f"tunix's device_put fallback {_ms(put_times)} (no guard)")
  m2n_tunix.uninstall()
  ok = (runs["jax_m2n"].error is None and len(runs["jax_m2n"].syncs) == _STEPS.value
        and all(s.bitwise_equal and s.on_rollout_mesh for s in runs["jax_m2n"].syncs))
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, "w") as f:
      json.dump({"version": 1, "platform": platform, "trainer": dict(trainer.shape),
                 "rollout": dict(rollout.shape), "steps": _STEPS.value, "bytes": nbytes,
                 "runs": {k: dataclasses.asdict(v) for k, v in runs.items()},
                 "timing_s": {"jax_m2n": m2n_times, "device_put": put_times}}, f,
                indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  app.run(main)
