"""The `delta` suite: delta sync (`Subscriber.pull(delta=True)`) against full pulls on
the RL example's real training.

Owns one measurement (issue 33): a trainer program (8 CPU devices) runs
examples/rl_refit.py's RL loop (its policy, task, verifier, Adam step and layouts:
the refit to its own generator half, the rollout, the train step) and publishes the
float32 params after every step; a generator program (the example's generator layout
on 4 of its 8 devices) pulls every version twice, in bfloat16 (the wire carries
bfloat16): once with delta=True (donating the last delta result) and once in full
(another Subscriber), checks that both are bitwise equal, and counts the bytes each
pulled. Both run on 127.0.0.1, or on two emulated hosts (jax_m2n.testing.hosts) joined
by shaped links (--rates 1gbit). The trainer waits for both pulls before it trains on
(lockstep: neither side's work is timed against the other's). Per step: the fraction
of bfloat16 elements that changed (computed by the trainer from its own params), wire
bytes full and delta, pull times, the publisher's compare + encode seconds. Steady
state: the steps after the first half.

Usage:
  python -m jax_m2n.bench --suite delta [--out_dir DIR]
  python -m jax_m2n.bench.delta [--steps 60] [--lrs 3e-3,3e-2] [--d_model 64] \
      [--layers 2] [--rates loopback,1gbit] [--out_dir DIR]
  (JAX_M2N_DELTA_BATCH=64: the example's --batch_size, for larger models on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from jax_m2n.bench import report
from jax_m2n.testing import workers

TOKEN = "delta-bench-token-0123"
DEFAULT_STEPS = 60
# The example's default learning rate and 10x it (the two), plus RL-typical
# smaller ones with --lrs.
DEFAULT_LRS = (3e-3, 3e-2)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_file(path: str, timeout: float) -> str:
  return workers.wait_file(path, timeout, poll_s=0.005)


def _config(lr: float, d_model: int, layers: int):
  sys.path.insert(0, ROOT)
  from examples import rl_refit
  batch = int(os.environ.get("JAX_M2N_DELTA_BATCH", 0)) or rl_refit.RefitConfig.batch_size
  return rl_refit, rl_refit.RefitConfig(learning_rate=lr, d_model=d_model, layers=layers,
                                        batch_size=batch, progress=False)


def trainer_main(directory: str, lr: float, steps: int, d_model: int, layers: int,
                 host: str) -> None:
  """The trainer program: rl_refit's RL step (refit to its generator half, rollout,
  verifier, Adam) `steps` times, publishing the params after each and waiting for the
  generator's pulls; writes one JSON line per version to DIR/trainer.jsonl."""
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jax_m2n
  from jax_m2n._src.jobs import codec, delta
  rl_refit, cfg = _config(lr, d_model, layers)
  trainer, generator = rl_refit.make_sides(cfg, jax.devices())
  key = jax.random.key(cfg.seed)
  init = functools.partial(rl_refit.init_params, cfg=cfg)
  shapes = jax.eval_shape(init, key)
  train_shardings = rl_refit.param_shardings(shapes, trainer)
  gen_shardings = rl_refit.param_shardings(shapes, generator)
  params = jax.jit(init, out_shardings=train_shardings)(jax.random.fold_in(key, 0))
  zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=train_shardings)
  opt_state = (zeros(params), zeros(params),
               jax.device_put(jnp.zeros((), jnp.int32), trainer.sharding(())))
  train_fn = jax.jit(
      rl_refit.train_step, static_argnames=("heads", "learning_rate"),
      donate_argnums=(0, 1),
      out_shardings=(train_shardings, jax.tree.map(lambda x: x.sharding, opt_state),
                     trainer.sharding(())))
  gen_batch = generator.sharding(("batch", None))
  train_batch = trainer.sharding(("batch", None))
  sample_fn = jax.jit(rl_refit.sample, static_argnames=("heads",), out_shardings=gen_batch)
  to_bf16 = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
  changed_fn = jax.jit(lambda a, b: sum(
      (jax.lax.bitcast_convert_type(x, jnp.uint16) != jax.lax.bitcast_convert_type(
          y, jnp.uint16)).sum() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
  elements = sum(x.size for x in jax.tree.leaves(params))
  rng = np.random.default_rng(cfg.seed)
  pub = jax_m2n.Publisher(f"{host}:0", token=TOKEN, keep=2)
  workers.write_file(os.path.join(directory, "address"), pub.address)
  log = open(os.path.join(directory, "trainer.jsonl"), "w")
  prev = None
  rewards = []
  for step in range(steps):
    now = to_bf16(params)
    changed = int(changed_fn(now, prev)) if prev is not None else elements
    prev = now
    before = dict(delta.stats)
    t0 = time.perf_counter()
    version = pub.publish(params)
    jax.block_until_ready(params)
    publish_ms = (time.perf_counter() - t0) * 1e3
    workers.write_file(os.path.join(directory, f"published_{version}"), "")
    _wait_file(os.path.join(directory, f"ack_{version}"), 600)
    got = {k: delta.stats[k] - before.get(k, 0) for k in delta.stats}
    log.write(json.dumps({
        "version": version, "changed": changed, "elements": elements,
        "publish_ms": publish_ms, "reward": rewards[-1] if rewards else None,
        "encode_ms": 1e3 * got.get("publisher_encode_s", 0.0),
        "convert_ms": 1e3 * got.get("publisher_convert_s", 0.0),
        "encoded_bytes": got.get("publisher_encoded_bytes", 0),
        "compared": got.get("publisher_elements", 0),
        "chunks": {m: got.get(f"publisher_chunks_{m}", 0) for m in codec.MODES}}) + "\n")
    log.flush()
    # The example's RL step: refit to the generator half, rollout, verifier, train.
    gen_params = jax_m2n.reshard(params, gen_shardings, dtype=jnp.bfloat16)
    prompts = np.repeat(rng.integers(0, rl_refit.NUM_DIGITS, (
        cfg.batch_size // cfg.group_size, cfg.digits)), cfg.group_size, axis=0).astype(
            np.int32)
    tokens = np.asarray(sample_fn(gen_params, jax.device_put(prompts, gen_batch),
                                  jax.random.fold_in(key, step + 1), heads=cfg.heads))
    correct, advantages = rl_refit.rewards_and_advantages(prompts, tokens, cfg.group_size)
    rewards.append(float(correct.mean()))
    params, opt_state, _ = train_fn(
        params, opt_state, jax.device_put(tokens, train_batch),
        jax.device_put(advantages, train_batch), heads=cfg.heads,
        learning_rate=cfg.learning_rate)
  log.close()
  _wait_file(os.path.join(directory, "done"), 600)
  pub.close()


def generator_main(directory: str, lr: float, steps: int, d_model: int,
                   layers: int) -> None:
  """The generator program: pulls every version twice in bfloat16 (delta=True, and
  in full by another Subscriber; each goes first every other version), checks them
  bitwise equal, acknowledges; one JSON line per version to DIR/generator.jsonl."""
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jax_m2n
  from jax_m2n._src.jobs import delta, engine
  address = _wait_file(os.path.join(directory, "address"), 600)
  rl_refit, cfg = _config(lr, d_model, layers)
  _, generator = rl_refit.make_sides(cfg, jax.devices())
  shapes = jax.eval_shape(functools.partial(rl_refit.init_params, cfg=cfg),
                          jax.random.key(0))
  dst = rl_refit.param_shardings(shapes, generator)
  sub = jax_m2n.Subscriber(address, token=TOKEN)
  ref = jax_m2n.Subscriber(address, token=TOKEN)
  log = open(os.path.join(directory, "generator.jsonl"), "w")
  prev = prev_full = None
  for v in range(1, steps + 1):
    # Timed from when the version is out (not while the trainer still trains on).
    _wait_file(os.path.join(directory, f"published_{v}"), 600)
    times, nbytes, got, apply_ms = {}, {}, {}, 0.0
    for which in (("delta", "full") if v % 2 else ("full", "delta")):
      before = dict(delta.stats), engine.stats["pulled_bytes"]
      t0 = time.perf_counter()
      if which == "delta":
        out = jax.block_until_ready(sub.pull(dst, dtype=jnp.bfloat16, version=v,
                                             delta=True, donate=prev, timeout_s=600,
                                             path="network"))
      else:
        full = jax.block_until_ready(ref.pull(dst, dtype=jnp.bfloat16, version=v,
                                              donate=prev_full, timeout_s=600,
                                              path="network"))
      times[which] = (time.perf_counter() - t0) * 1e3
      got = {k: delta.stats[k] - before[0].get(k, 0) for k in delta.stats}
      # A delta pull's bytes: its arrays and its JSON header (a delta=True pull that
      # went full, the first, counts in the engine's bytes like a full one).
      apply_ms += 1e3 * got.get("subscriber_apply_s", 0.0)
      nbytes[which] = (got.get("subscriber_pulled_bytes", 0)
                       + got.get("subscriber_reply_bytes", 0)
                       + engine.stats["pulled_bytes"] - before[1])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(full)):
      if not np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)):
        raise AssertionError(f"delta bench: version {v}: the delta pull must equal the "
                             "full pull bitwise; it does not")
    prev, prev_full = out, full
    log.write(json.dumps({"version": v, "delta_bytes": nbytes["delta"],
                          "full_bytes": nbytes["full"], "delta_ms": times["delta"],
                          "full_ms": times["full"], "delta_first": bool(v % 2),
                          "apply_ms": apply_ms}) + "\n")
    log.flush()
    workers.write_file(os.path.join(directory, f"ack_{v}"), "")
  sub.close()
  ref.close()
  log.close()
  workers.write_file(os.path.join(directory, "done"), "")


def run_one(lr: float, steps: int, d_model: int, layers: int, rate: str | None,
            print_fn: Callable[[str], object] = print) -> dict:
  """One training run at `lr`, the trainer and the generator as separate programs on
  127.0.0.1, or (rate, e.g. "1gbit") on two emulated hosts joined by links of that
  rate (jax_m2n.testing.hosts; needs root)."""
  directory = tempfile.mkdtemp(prefix="m2n_delta_bench_")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  args = [repr(lr), str(steps), str(d_model), str(layers)]
  code = ("import sys; from jax_m2n.bench import delta; delta.{}(sys.argv[1], "
          "float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]){})")
  trainer_argv = [sys.executable, "-c", code.format("trainer_main", ", sys.argv[6]"),
                  directory, *args]
  generator_argv = [sys.executable, "-c", code.format("generator_main", ""), directory,
                    *args]
  hosts = None
  procs = []
  try:
    if rate is None:
      procs.append(subprocess.Popen(trainer_argv + ["127.0.0.1"], env=env))
      procs.append(subprocess.Popen(generator_argv, env=env))
    else:
      from jax_m2n.testing.hosts import EmulatedHosts
      hosts = EmulatedHosts(2, rate=rate).start()
      procs.append(hosts.popen(0, trainer_argv + [hosts.address(0)], env=env))
      procs.append(hosts.popen(1, generator_argv, env=env))
    deadline = time.monotonic() + 60 * 30
    while any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
        raise RuntimeError(f"delta bench: a program failed or hung (rc="
                           f"{[p.poll() for p in procs]}); logs in {directory}")
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    if hosts is not None:
      hosts.close()
  rows = []
  with open(os.path.join(directory, "generator.jsonl")) as g, open(
      os.path.join(directory, "trainer.jsonl")) as t:
    for a, b in zip(g, t):
      rows.append({**json.loads(b), **json.loads(a)})
  summary = _summary(rows)
  print_fn(f"  delta/lr={lr:g}{'/' + rate if rate else ''}: changed "
           f"{100 * summary['changed_fraction']:.2f}%, wire "
           f"{summary['full_bytes'] / 1024:.1f} KiB full vs "
           f"{summary['delta_bytes'] / 1024:.1f} KiB delta ({summary['wire_ratio']:.2f}x), "
           f"pull {summary['full_ms']:.1f} vs {summary['delta_ms']:.1f} ms, encode "
           f"{summary['encode_ms']:.2f} ms")
  return {"lr": lr, "rate": rate or "loopback", "rows": rows, "summary": summary}


def _summary(rows: list[dict]) -> dict:
  """Medians over the steady state (the second half of the versions)."""
  steady = rows[len(rows) // 2:] or rows
  med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
  first = rows[1:11]
  return {
      "versions": len(rows), "steady_from": steady[0]["version"],
      "changed_fraction": statistics.median(r["changed"] / r["elements"] for r in steady),
      "changed_fraction_first10": statistics.median(
          r["changed"] / r["elements"] for r in first) if first else None,
      "full_bytes": med("full_bytes"), "delta_bytes": med("delta_bytes"),
      "wire_ratio": med("full_bytes") / max(1, med("delta_bytes")),
      # The first pull of a version pays the publisher's conversion of it to the wire
      # dtype (once per version): each kind goes first every other version, and its
      # time is reported both ways.
      "full_ms": statistics.median(r["full_ms"] for r in steady if r["delta_first"]),
      "delta_ms": statistics.median(
          r["delta_ms"] for r in steady if not r["delta_first"]),
      "full_ms_first": statistics.median(
          r["full_ms"] for r in steady if not r["delta_first"]),
      "delta_ms_first": statistics.median(
          r["delta_ms"] for r in steady if r["delta_first"]),
      "encode_ms": med("encode_ms"), "publish_ms": med("publish_ms"),
      "apply_ms": med("apply_ms"),
      "elements": rows[0]["elements"],
      "reward_last": rows[-1].get("reward")}


def run(lrs, steps: int, d_model: int, layers: int, rates,
        print_fn: Callable[[str], object] = print) -> dict:
  runs = [run_one(lr, steps, d_model, layers, rate, print_fn)
          for rate in rates for lr in lrs]
  return {"schema": 1, "suite": "delta", "steps": steps, "d_model": d_model,
          "layers": layers, "platform": "cpu", "runs": runs}


def markdown(doc: dict) -> str:
  lines = ["| link | learning rate | changed / step (steady; first 10) | wire KiB full | "
           "wire KiB delta | full / delta | pull ms full | pull ms delta | "
           "first pull ms full / delta | publisher compare+encode ms |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in doc["runs"]:
    s = r["summary"]
    first = (f"{100 * s['changed_fraction_first10']:.1f}%"
             if s["changed_fraction_first10"] is not None else "-")
    lines.append(f"| {r['rate']} | {r['lr']:g} | {100 * s['changed_fraction']:.2f}%; {first} | "
                 f"{s['full_bytes'] / 1024:.1f} | {s['delta_bytes'] / 1024:.1f} | "
                 f"{s['wire_ratio']:.2f}x | {s['full_ms']:.1f} | {s['delta_ms']:.1f} | "
                 f"{s['full_ms_first']:.0f} / {s['delta_ms_first']:.0f} | "
                 f"{s['encode_ms']:.2f} |")
  r0 = doc["runs"][0]["summary"]
  lines.append("")
  lines.append(f"- examples/rl_refit.py's policy (d_model {doc['d_model']}, {doc['layers']} "
               f"layers, {r0['elements']:,} parameters, Adam), its RL steps, fsdp2xtp2 -> "
               f"tp2xdp2; float32 published, bfloat16 on the wire; {doc['steps']} versions, "
               f"medians over versions {r0['steady_from']}-{doc['steps']} (steady state). "
               "Wire bytes: what the generator pulled from the trainer (delta: the "
               "encoded arrays plus the JSON header). Pull ms: a version's second pull; "
               "its first (every other version each kind) also waits for the publisher's "
               "one conversion of the version to bfloat16. The publisher's extra memory "
               "for delta: the base version held (keep=2), "
               f"{r0['elements'] * 4 / 1024:.0f} KiB in float32 plus its bfloat16 wire "
               f"copy, {r0['elements'] * 2 / 1024:.0f} KiB. Separate programs: link "
               "loopback on 127.0.0.1; a rate (1gbit) on two emulated hosts "
               "(jax_m2n.testing.hosts) joined by tc-shaped links of that rate.")
  return "\n".join(lines) + "\n"


def main(out_dir: str, print_fn: Callable[[str], object] = print, lrs=DEFAULT_LRS,
         steps: int = DEFAULT_STEPS, d_model: int = 64, layers: int = 2,
         rates=(None,)) -> int:
  doc = run(lrs, steps, d_model, layers, rates, print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "delta", print_fn)
  return 0


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
  parser.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS))
  parser.add_argument("--d_model", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--rates", default="loopback",
                      help="comma-separated: loopback and/or tc rates such as 1gbit "
                      "(two emulated hosts; needs root and iproute2)")
  parser.add_argument("--out_dir", default="/tmp/jax_m2n_bench")
  flags = parser.parse_args()
  sys.exit(main(flags.out_dir, lrs=[float(x) for x in flags.lrs.split(",")],
                steps=flags.steps, d_model=flags.d_model, layers=flags.layers,
                rates=[None if r == "loopback" else r for r in flags.rates.split(",")]))
