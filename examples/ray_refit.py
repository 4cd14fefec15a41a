r"""RL weight refit between Ray actors: the trainer and the generator are separate
processes with their own JAX runtimes, and the weights cross through
`jax_m2n.Publisher` / `jax_m2n.Subscriber` with bfloat16 in flight.

The RL loop of examples/rl_refit.py reduced to what it needs (the same policy, task,
verifier and training step, imported from it): each step the generator actor pulls the
newest published version into its layout (TP x DP on its 4 CPU devices, or its GPU),
samples answers, the driver scores them, and the trainer actor trains (FSDP x TP on its
own devices) and publishes the new version. In the same run, every step also syncs the
way a Ray user does today: the trainer copies its weights to host numpy (cast to
bfloat16), Ray's object store carries them, the generator `jax.device_put`s them; the
two results are compared bitwise (outside both timings) and both sync times are
reported per step; the summary gives their medians and each one's first sync.

Usage (from the repository root; `pip install jax_m2n[ray]`):
  JAX_M2N_EXAMPLE=ray_refit ./scripts/run_example.sh      # installs requirements/ray.txt
  python examples/ray_refit.py --steps=30 --address=auto  # an existing Ray cluster
  (rl_refit's flags apply: --batch_size, --d_model, --layers, --learning_rate, ...)
A local Ray cluster (2 CPUs, a 256 MiB object store) is started by default.
"""

# requirements: ray
# (The requirement sets this example needs beyond the main job's, files of
# requirements/: ./scripts/run_example.sh installs them when it runs this example.)

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dataclasses  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

# The policy, task, verifier and training step (and their flags: --steps, --batch_size,
# --d_model, --layers, --learning_rate, --seed, ...).
from examples import rl_refit as rl  # noqa: E402

_DEVICES = flags.DEFINE_integer("devices", 4, "CPU devices per actor (no GPU).")
_ADDRESS = flags.DEFINE_string("address", "", "a Ray cluster to join ('' starts a "
                               "local one; 'auto' joins the running one).")
flags.FLAGS.set_default("steps", 30)
flags.FLAGS.set_default("batch_size", 256)
LAYOUTS = "fsdp2xtp2->tp2xdp2@same"  # each actor lays its side out on its own devices


def _start_jax(devices: int):
  """This actor's JAX runtime: its GPU if it has one, else `devices` CPU devices."""
  import jax
  if not os.path.exists("/dev/nvidiactl"):
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
  return jax


def _config(fields: dict):
  return rl.RefitConfig(**fields)


class Trainer:
  """The trainer actor: float32 params in FSDP x TP, a Publisher for every version."""

  def __init__(self, config: dict, token: str, devices: int):
    jax = _start_jax(devices)
    import functools
    import jax.numpy as jnp
    import jax_m2n
    self.jax, self.jnp = jax, jnp
    self.cfg = cfg = _config(config)
    side = rl.make_sides(cfg, jax.devices())[0]
    key = jax.random.key(cfg.seed)
    init = functools.partial(rl.init_params, cfg=cfg)
    shapes = jax.eval_shape(init, key)
    shardings = rl.param_shardings(shapes, side)
    self.params = jax.jit(init, out_shardings=shardings)(jax.random.fold_in(key, 0))
    zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=shardings)
    self.opt_state = (zeros(self.params), zeros(self.params),
                      jax.device_put(jnp.zeros((), jnp.int32), side.sharding(())))
    self.batch = side.sharding(("batch", None))
    self.train_fn = jax.jit(rl.train_step, static_argnames=("heads", "learning_rate"),
                            donate_argnums=(0, 1))
    self.to_host = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    # Where subscribers reach it: this host, a free port (a Ray cluster spanning hosts
    # would bind the node's address: Publisher(f"{ray.util.get_node_ip_address()}:0")).
    self.publisher = jax_m2n.Publisher("127.0.0.1:0", token=token, keep=2)
    self.publish_ms = [self._publish()]

  def _publish(self) -> float:
    start = time.perf_counter()
    self.publisher.publish(self.params)
    return (time.perf_counter() - start) * 1e3

  def address(self) -> str:
    return self.publisher.address

  def first_publish_ms(self) -> float:
    return self.publish_ms[0]

  def nbytes(self) -> int:
    return sum(x.nbytes for x in self.jax.tree.leaves(self.params))

  def train(self, tokens, advantages) -> float:
    """One training step, then publish the new version; returns the publish ms."""
    jax = self.jax
    self.params, self.opt_state, _ = self.train_fn(
        self.params, self.opt_state, jax.device_put(tokens, self.batch),
        jax.device_put(advantages, self.batch), heads=self.cfg.heads,
        learning_rate=self.cfg.learning_rate)
    jax.block_until_ready(self.params)
    ms = self._publish()
    self.publish_ms.append(ms)
    return ms

  def host_copy(self):
    """The baseline's first half: the weights as host numpy, cast to bfloat16."""
    return self.jax.tree.map(np.asarray, self.to_host(self.params))

  def close(self) -> None:
    self.publisher.close()


class Generator:
  """The generator actor: bfloat16 params in TP x DP, pulled through a Subscriber."""

  def __init__(self, config: dict, address: str, token: str, devices: int):
    jax = _start_jax(devices)
    import functools
    import jax.numpy as jnp
    import jax_m2n
    self.jax, self.jnp = jax, jnp
    self.cfg = cfg = _config(config)
    side = rl.make_sides(cfg, jax.devices())[1]
    init = functools.partial(rl.init_params, cfg=cfg)
    self.shardings = rl.param_shardings(jax.eval_shape(init, jax.random.key(0)), side)
    self.batch = side.sharding(("batch", None))
    self.sample_fn = jax.jit(rl.sample, static_argnames=("heads",))
    self.checksum_fn = jax.jit(rl.checksums)
    self.subscriber = jax_m2n.Subscriber(address, token=token)
    # The first pull's work (manifest, plan, compiled copies on both sides) now, while
    # the actor starts, rather than in the first step's sync.
    self.subscriber.prepare(self.shardings, dtype=jnp.bfloat16, timeout_s=120)
    self.params = self.loaded = None

  def ready(self) -> bool:
    return True

  def sync(self) -> tuple[int, float]:
    """Pulls the newest version (bf16 in flight), donating the previous one."""
    start = time.perf_counter()
    self.params = self.subscriber.pull(self.shardings, dtype=self.jnp.bfloat16,
                                       donate=self.params, timeout_s=120)
    self.jax.block_until_ready(self.params)
    return self.subscriber.version, (time.perf_counter() - start) * 1e3

  def load_numpy(self, host_params) -> float:
    """The baseline's second half: jax.device_put of what Ray delivered (kept for
    `same`); returns its ms."""
    start = time.perf_counter()
    self.loaded = self.jax.device_put(host_params, self.shardings)
    self.jax.block_until_ready(self.loaded)
    return (time.perf_counter() - start) * 1e3

  def same(self) -> bool:
    """Whether the baseline's weights equal the pulled version bitwise (checksums of
    every leaf; outside both timings)."""
    loaded, self.loaded = self.loaded, None
    return bool(np.array_equal(*self.jax.device_get(
        (self.checksum_fn(loaded), self.checksum_fn(self.params)))))

  def rollout(self, prompts, seed: int):
    tokens = self.sample_fn(self.params, self.jax.device_put(prompts, self.batch),
                            self.jax.random.key(seed), heads=self.cfg.heads)
    return np.asarray(tokens)

  def close(self) -> None:
    self.subscriber.close()


def _summary(rows: list[dict], first_publish_ms: float) -> dict:
  """Per-step medians over the last two thirds of the steps (jax_m2n: the pull as the
  driver waits for it plus the publish in the train step; numpy: the trainer's host
  copy, Ray's object store and the generator's device_put, as the driver waits for
  them), and the first sync of each (jax_m2n's first pull and the trainer's first
  publish; numpy's first step)."""
  steady = rows[len(rows) // 3:] or rows
  med = lambda k: float(np.median([r[k] for r in steady]))  # noqa: E731
  out = {k: med(k) for k in ("sync_ms", "pull_ms", "publish_ms", "numpy_ms",
                             "numpy_device_put_ms")}
  out["jax_m2n_ms"] = float(np.median([r["sync_ms"] + r["publish_ms"] for r in steady]))
  out["ratio"] = out["jax_m2n_ms"] / out["numpy_ms"]
  out["first_sync_ms"] = rows[0]["sync_ms"]
  out["first_jax_m2n_ms"] = rows[0]["sync_ms"] + first_publish_ms
  out["first_numpy_ms"] = rows[0]["numpy_ms"]
  out["steps_in_medians"] = len(steady)
  return out


def main(argv):
  del argv
  import ray
  import secrets
  token = secrets.token_hex(32)  # as jax_m2n.new_token(); travels to the actors
  started = time.perf_counter()
  env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}}
  if _ADDRESS.value:
    ray.init(address=_ADDRESS.value, runtime_env=env)
  else:
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             runtime_env=env)
  print(f"ray_refit: Ray ready in {time.perf_counter() - started:.1f} s")
  cfg = dataclasses.replace(rl.RefitConfig(**{
      f.name: getattr(flags.FLAGS, f.name) for f in dataclasses.fields(rl.RefitConfig)}),
      layouts=LAYOUTS, progress=False)
  config = dataclasses.asdict(cfg)
  trainer = ray.remote(num_cpus=0)(Trainer).remote(config, token, _DEVICES.value)
  address = ray.get(trainer.address.remote())
  generator = ray.remote(num_cpus=0)(Generator).remote(config, address, token,
                                                       _DEVICES.value)
  # Both actors constructed (JAX started, the Subscriber connected) before any sync
  # is timed: the first sync then measures the sync, not the actor's start.
  nbytes, _ = ray.get([trainer.nbytes.remote(), generator.ready.remote()])
  first_publish_ms = ray.get(trainer.first_publish_ms.remote())
  print(f"ray_refit: trainer and generator actors up in "
        f"{time.perf_counter() - started:.1f} s; policy {nbytes / 2**20:.2f} MiB "
        f"float32 on the trainer, {nbytes / 2**21:.2f} MiB bfloat16 on the generator; "
        f"publisher at {address}")
  rng = np.random.default_rng(cfg.seed)
  per_prompt = cfg.batch_size // cfg.group_size
  rows, rewards = [], []
  for step in range(cfg.steps):
    start = time.perf_counter()
    version, pull_ms = ray.get(generator.sync.remote())
    sync_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()  # the same weights, the way a Ray user moves them today
    numpy_put_ms = ray.get(generator.load_numpy.remote(trainer.host_copy.remote()))
    numpy_ms = (time.perf_counter() - start) * 1e3
    if not ray.get(generator.same.remote()):
      raise RuntimeError(f"ray_refit: step {step}: the pulled weights must equal the "
                         "numpy path's bitwise; they differ.")
    prompts = np.repeat(rng.integers(0, rl.NUM_DIGITS, (per_prompt, cfg.digits)),
                        cfg.group_size, axis=0).astype(np.int32)
    tokens = ray.get(generator.rollout.remote(prompts, step + 1))
    correct, advantages = rl.rewards_and_advantages(prompts, tokens, cfg.group_size)
    publish_ms = ray.get(trainer.train.remote(tokens, advantages))
    rewards.append(float(correct.mean()))
    rows.append({"step": step, "version": version, "sync_ms": sync_ms, "pull_ms": pull_ms,
                 "publish_ms": publish_ms, "numpy_ms": numpy_ms,
                 "numpy_device_put_ms": numpy_put_ms, "reward": rewards[-1]})
    if step % 5 == 0 or step == cfg.steps - 1:
      print(f"step {step:3d}  reward {np.mean(rewards[-5:]):.3f}  sync: jax_m2n "
            f"{sync_ms:6.1f} ms (pull {pull_ms:5.1f}, publish {publish_ms:4.1f}) | "
            f"numpy via Ray {numpy_ms:6.1f} ms  (bitwise equal)")
  summary = _summary(rows, first_publish_ms)
  print(f"ray_refit: {cfg.steps} steps, reward {np.mean(rewards[:5]):.3f} -> "
        f"{np.mean(rewards[-5:]):.3f}")
  print(f"ray_refit: per-step sync (median of the last two thirds): jax_m2n "
        f"{summary['jax_m2n_ms']:.2f} ms (pull {summary['sync_ms']:.2f} ms as the driver "
        f"waits for it + publish {summary['publish_ms']:.2f} ms in the train step) vs host "
        f"numpy through Ray's object store {summary['numpy_ms']:.2f} ms: jax_m2n / numpy "
        f"{summary['ratio']:.2f}")
  print(f"ray_refit: first sync: jax_m2n {summary['first_jax_m2n_ms']:.0f} ms (pull "
        f"{summary['first_sync_ms']:.0f} ms + publish {first_publish_ms:.0f} ms) vs numpy "
        f"through Ray {summary['first_numpy_ms']:.0f} ms")
  if cfg.json_out:
    import json
    with open(cfg.json_out, "w") as f:
      json.dump({"schema": 2, "example": "ray_refit", "nbytes": nbytes,
                 "summary": summary, "steps": rows}, f, indent=1)
  ray.get([trainer.close.remote(), generator.close.remote()])
  ray.shutdown()


if __name__ == "__main__":
  app.run(main)
