"""The `delta` suite: delta sync (`Subscriber.pull(delta=True)`) and `delta="auto"`
against full pulls.

Owns three measurements:
- rl (issue 33): a trainer program (8 CPU devices) runs examples/rl_refit.py's RL loop
  (its policy, task, verifier, Adam step and layouts) and publishes the float32 params
  after every step; a generator program (the example's generator layout on 4 of its 8
  devices) pulls every version three ways in bfloat16 (the wire carries bfloat16):
  delta=True, delta="auto" and in full, each by its own Subscriber donating its last
  result, checks that all three are bitwise equal, and counts the bytes each pulled.
- synthetic (issue 42): the same two programs with a float32 pytree of --bytes in
  --leaves leaves (4 devices each side, rows sharded), each version changing a fraction
  --fraction of every leaf's elements (a strided pattern at a random offset), pulled
  the same three ways in float32.
- encode: the publisher's compare + encode of --bytes float32 with each fraction changed,
  in one program on this platform's first device: the compiled programs
  (delta_device.py: alone, and with the host's copy of their padded outputs; each way
  of compacting the values) and numpy (codec.py, with the copy of the shards to the
  host on accelerators), min of --repeats after a warm-up, each checked bitwise.
Both programs run on 127.0.0.1, or on two emulated hosts (jax_m2n.testing.hosts)
joined by shaped links (--rates 1gbit). The trainer waits for the three pulls before it
goes on (lockstep). Each kind of pull goes first every third version (the first pull
of a version also waits for the publisher's one conversion of it to the wire dtype).
Per version: the changed fraction (computed by the trainer), wire bytes and pull times
of each kind, what auto chose, the publisher's compare + encode seconds. Steady state:
the versions after the first half.

Usage:
  python -m jax_m2n.bench --suite delta [--out_dir DIR]
  python -m jax_m2n.bench.delta [--workloads rl,synthetic,encode] [--steps 60] \
      [--lrs 3e-3,3e-2] [--d_model 64] [--layers 2] [--bytes 1GiB] [--leaves 8] \
      [--fractions 0.02,0.8] [--synthetic_steps 10] [--repeats 5] \
      [--rates loopback,1gbit] [--out_dir DIR]
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
# Issue 42's synthetic pytree: 1 GiB of float32 with 2% and 80% of its elements changed.
DEFAULT_BYTES = 1 << 30
DEFAULT_FRACTIONS = (0.02, 0.8)
DEFAULT_SYNTHETIC_STEPS = 10
KINDS = ("delta", "auto", "full")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_file(path: str, timeout: float) -> str:
  return workers.wait_file(path, timeout, poll_s=0.005)


def _config(lr: float, d_model: int, layers: int):
  sys.path.insert(0, ROOT)
  from examples import rl_refit
  batch = int(os.environ.get("JAX_M2N_DELTA_BATCH", 0)) or rl_refit.RefitConfig.batch_size
  return rl_refit, rl_refit.RefitConfig(learning_rate=lr, d_model=d_model, layers=layers,
                                        batch_size=batch, progress=False)


# ---------------------------------------------------------------------------------------
# The workloads: what the trainer publishes, version after version
# ---------------------------------------------------------------------------------------

class _RL:
  """rl_refit's params after each RL step (float32 published, bfloat16 pulled)."""

  def __init__(self, spec: dict):
    import functools
    import jax
    import jax.numpy as jnp
    import numpy as np
    self.jax, self.np = jax, np
    self.rl, self.cfg = _config(spec["lr"], spec["d_model"], spec["layers"])
    trainer, generator = self.rl.make_sides(self.cfg, jax.devices())
    self.key = jax.random.key(self.cfg.seed)
    init = functools.partial(self.rl.init_params, cfg=self.cfg)
    shapes = jax.eval_shape(init, self.key)
    train_shardings = self.rl.param_shardings(shapes, trainer)
    self.gen_shardings = self.rl.param_shardings(shapes, generator)
    self.params = jax.jit(init, out_shardings=train_shardings)(
        jax.random.fold_in(self.key, 0))
    zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p),
                    out_shardings=train_shardings)
    self.opt_state = (zeros(self.params), zeros(self.params),
                      jax.device_put(jnp.zeros((), jnp.int32), trainer.sharding(())))
    self.train_fn = jax.jit(
        self.rl.train_step, static_argnames=("heads", "learning_rate"),
        donate_argnums=(0, 1),
        out_shardings=(train_shardings, jax.tree.map(lambda x: x.sharding, self.opt_state),
                       trainer.sharding(())))
    self.gen_batch = generator.sharding(("batch", None))
    self.train_batch = trainer.sharding(("batch", None))
    self.sample_fn = jax.jit(self.rl.sample, static_argnames=("heads",),
                             out_shardings=self.gen_batch)
    self.to_bf16 = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    self.changed_fn = jax.jit(lambda a, b: sum(
        (jax.lax.bitcast_convert_type(x, jnp.uint16) != jax.lax.bitcast_convert_type(
            y, jnp.uint16)).sum() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
    self.elements = sum(x.size for x in jax.tree.leaves(self.params))
    self.rng = np.random.default_rng(self.cfg.seed)
    self.prev = None
    self.rewards: list[float] = []

  def version(self) -> tuple[object, int]:
    """The params to publish and how many of their bfloat16 elements changed."""
    now = self.to_bf16(self.params)
    changed = (int(self.changed_fn(now, self.prev)) if self.prev is not None
               else self.elements)
    self.prev = now
    return self.params, changed

  def advance(self, step: int) -> None:
    """The example's RL step: refit to the generator half, rollout, verifier, train."""
    import jax_m2n
    jax, np, rl, cfg = self.jax, self.np, self.rl, self.cfg
    gen_params = jax_m2n.reshard(self.params, self.gen_shardings, dtype=jax.numpy.bfloat16)
    prompts = np.repeat(self.rng.integers(0, rl.NUM_DIGITS, (
        cfg.batch_size // cfg.group_size, cfg.digits)), cfg.group_size, axis=0).astype(
            np.int32)
    tokens = np.asarray(self.sample_fn(gen_params, jax.device_put(prompts, self.gen_batch),
                                       jax.random.fold_in(self.key, step + 1),
                                       heads=cfg.heads))
    correct, advantages = rl.rewards_and_advantages(prompts, tokens, cfg.group_size)
    self.rewards.append(float(correct.mean()))
    self.params, self.opt_state, _ = self.train_fn(
        self.params, self.opt_state, jax.device_put(tokens, self.train_batch),
        jax.device_put(advantages, self.train_batch), heads=cfg.heads,
        learning_rate=cfg.learning_rate)


def _synthetic_shapes(spec: dict) -> list[tuple[int, int]]:
  """The synthetic pytree's leaves: --leaves float32 matrices of 4096 columns (rows a
  multiple of 4: sharded over 4 devices) summing to about --bytes."""
  rows = max(4, spec["bytes"] // (4 * 4096 * spec["leaves"]) // 4 * 4)
  return [(rows, 4096)] * spec["leaves"]


def _synthetic_sharding(jax, devices):
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  return NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))


class _Synthetic:
  """A float32 pytree whose every leaf changes `fraction` of its elements per version:
  every k-th element at a random offset (fraction <= 1/2: k = 1/fraction), or every
  element but every k-th (k = 1/(1 - fraction))."""

  def __init__(self, spec: dict):
    import jax
    import numpy as np
    self.jax, self.np = jax, np
    self.fraction = spec["fraction"]
    self.sharding = _synthetic_sharding(jax, jax.devices()[:4])
    rng = np.random.default_rng(0)
    self.hosts = [rng.standard_normal(s, dtype=np.float32) for s in _synthetic_shapes(spec)]
    self.elements = sum(h.size for h in self.hosts)
    self.rng = rng
    self.first = True

  def version(self) -> tuple[object, int]:
    np = self.np
    changed = self.elements
    if not self.first:
      changed = 0
      for h in self.hosts:
        flat = h.reshape(-1)
        if self.fraction <= 0.5:
          k = max(1, round(1 / self.fraction))
          at = slice(int(self.rng.integers(k)), None, k)
          flat[at] += 1
          changed += flat[at].size
        else:
          k = max(2, round(1 / (1 - self.fraction)))
          at = slice(int(self.rng.integers(k)), None, k)
          kept = flat[at].copy()
          flat += 1
          flat[at] = kept
          changed += flat.size - kept.size
    self.first = False
    tree = [self.jax.make_array_from_callback(h.shape, self.sharding,
                                              lambda i, h=h: h[i], dtype=np.float32)
            for h in self.hosts]
    return tree, changed

  def advance(self, step: int) -> None:
    del step


def trainer_main(directory: str, spec_json: str, host: str) -> None:
  """The trainer program: publishes the workload's versions, waiting for the
  generator's pulls after each; writes one JSON line per version to
  DIR/trainer.jsonl."""
  import jax
  import jax_m2n
  from jax_m2n._src.jobs import codec, delta
  spec = json.loads(spec_json)
  work = _RL(spec) if spec["kind"] == "rl" else _Synthetic(spec)
  pub = jax_m2n.Publisher(f"{host}:0", token=TOKEN, keep=2)
  workers.write_file(os.path.join(directory, "address"), pub.address)
  log = open(os.path.join(directory, "trainer.jsonl"), "w")
  for step in range(spec["steps"]):
    tree, changed = work.version()
    before = delta.snapshot()
    t0 = time.perf_counter()
    version = pub.publish(tree)
    jax.block_until_ready(tree)
    publish_ms = (time.perf_counter() - t0) * 1e3
    del tree
    workers.write_file(os.path.join(directory, f"published_{version}"), "")
    _wait_file(os.path.join(directory, f"ack_{version}"), 1800)
    after = delta.snapshot()
    got = {k: after[k] - before.get(k, 0) for k in after}
    log.write(json.dumps({
        "version": version, "changed": changed, "elements": work.elements,
        "publish_ms": publish_ms,
        "reward": work.rewards[-1] if getattr(work, "rewards", None) else None,
        "encode_ms": 1e3 * got.get("publisher_encode_s", 0.0),
        "convert_ms": 1e3 * got.get("publisher_convert_s", 0.0),
        "encoded_bytes": got.get("publisher_encoded_bytes", 0),
        "compared": got.get("publisher_elements", 0),
        "measures": got.get("publisher_measures", 0),
        "chunks": {m: got.get(f"publisher_chunks_{m}", 0) for m in codec.MODES}}) + "\n")
    log.flush()
    work.advance(step)
  log.close()
  _wait_file(os.path.join(directory, "done"), 1800)
  pub.close()


def _destinations(jax, spec: dict):
  """The generator's dst and the dtype it pulls."""
  import functools
  import jax.numpy as jnp
  if spec["kind"] == "rl":
    rl, cfg = _config(spec["lr"], spec["d_model"], spec["layers"])
    _, generator = rl.make_sides(cfg, jax.devices())
    shapes = jax.eval_shape(functools.partial(rl.init_params, cfg=cfg), jax.random.key(0))
    return rl.param_shardings(shapes, generator), jnp.bfloat16
  sharding = _synthetic_sharding(jax, jax.devices()[4:8])
  return [sharding] * len(_synthetic_shapes(spec)), None


def generator_main(directory: str, spec_json: str) -> None:
  """The generator program: pulls every version three ways (delta=True, "auto", full:
  each its own Subscriber, each first every third version), checks them bitwise
  equal, acknowledges; one JSON line per version to DIR/generator.jsonl."""
  import jax
  import numpy as np
  import jax_m2n
  from jax_m2n._src.jobs import delta, engine
  spec = json.loads(spec_json)
  address = _wait_file(os.path.join(directory, "address"), 600)
  dst, dtype = _destinations(jax, spec)
  subs = {k: jax_m2n.Subscriber(address, token=TOKEN) for k in KINDS}
  modes = {"delta": True, "auto": "auto", "full": False}
  log = open(os.path.join(directory, "generator.jsonl"), "w")
  prev = dict.fromkeys(KINDS)
  for v in range(1, spec["steps"] + 1):
    # Timed from when the version is out (not while the trainer still trains on).
    _wait_file(os.path.join(directory, f"published_{v}"), 1800)
    times, nbytes, chose, apply_ms = {}, {}, "", 0.0
    order = KINDS[v % 3:] + KINDS[:v % 3]
    for which in order:
      before = delta.snapshot(), engine.stats["pulled_bytes"]
      donate, prev[which] = prev[which], None
      t0 = time.perf_counter()
      out = jax.block_until_ready(subs[which].pull(
          dst, dtype=dtype, version=v, delta=modes[which], donate=donate, timeout_s=1800,
          path="network"))
      times[which] = (time.perf_counter() - t0) * 1e3
      del donate
      after = delta.snapshot()
      got = {k: after[k] - before[0].get(k, 0) for k in after}
      if which == "auto":
        chose = "delta" if got.get("subscriber_auto_delta") else "full"
      if which == "delta":
        apply_ms += 1e3 * got.get("subscriber_apply_s", 0.0)
      # A pull's bytes: a delta's arrays and its JSON header, or the full pull's.
      nbytes[which] = (got.get("subscriber_pulled_bytes", 0)
                       + got.get("subscriber_reply_bytes", 0)
                       + engine.stats["pulled_bytes"] - before[1])
      prev[which] = out
    for which in ("delta", "auto"):
      for a, b in zip(jax.tree.leaves(prev[which]), jax.tree.leaves(prev["full"])):
        if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
          raise AssertionError(f"delta bench: version {v}: the {which} pull must equal "
                               "the full pull bitwise; it does not")
    log.write(json.dumps({"version": v, **{f"{k}_bytes": nbytes[k] for k in KINDS},
                          **{f"{k}_ms": times[k] for k in KINDS},
                          **{f"{k}_first": order[0] == k for k in KINDS},
                          "auto_chose": chose, "apply_ms": apply_ms}) + "\n")
    log.flush()
    workers.write_file(os.path.join(directory, f"ack_{v}"), "")
  for sub in subs.values():
    sub.close()
  log.close()
  workers.write_file(os.path.join(directory, "done"), "")


def run_one(spec: dict, rate: str | None,
            print_fn: Callable[[str], object] = print) -> dict:
  """One run of a workload (`spec`), the trainer and the generator as separate
  programs on 127.0.0.1, or (rate, e.g. "1gbit") on two emulated hosts joined by links
  of that rate (jax_m2n.testing.hosts; needs root)."""
  directory = tempfile.mkdtemp(prefix="m2n_delta_bench_")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  code = ("import sys; from jax_m2n.bench import delta; "
          "delta.{}(sys.argv[1], sys.argv[2]{})")
  trainer_argv = [sys.executable, "-c", code.format("trainer_main", ", sys.argv[3]"),
                  directory, json.dumps(spec)]
  generator_argv = [sys.executable, "-c", code.format("generator_main", ""), directory,
                    json.dumps(spec)]
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
    deadline = time.monotonic() + 60 * 60
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
  what = (f"lr={spec['lr']:g}" if spec["kind"] == "rl" else
          f"{spec['bytes'] / 2**20:.0f}MiB/{100 * spec['fraction']:g}%")
  print_fn(f"  delta/{what}{'/' + rate if rate else ''}: changed "
           f"{100 * summary['changed_fraction']:.2f}%, wire "
           f"{summary['full_bytes'] / 1024:.1f} KiB full vs "
           f"{summary['delta_bytes'] / 1024:.1f} KiB delta ({summary['wire_ratio']:.2f}x), "
           f"pull {summary['full_ms']:.1f} full / {summary['delta_ms']:.1f} delta / "
           f"{summary['auto_ms']:.1f} auto ms (auto chose delta "
           f"{summary['auto_delta']}/{summary['steady']}), encode "
           f"{summary['encode_ms']:.2f} ms")
  return {**spec, "rate": rate or "loopback", "rows": rows, "summary": summary}


def _summary(rows: list[dict]) -> dict:
  """Medians over the steady state (the second half of the versions)."""
  steady = rows[len(rows) // 2:] or rows
  med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
  first = rows[1:11]
  out = {
      "versions": len(rows), "steady_from": steady[0]["version"], "steady": len(steady),
      "changed_fraction": statistics.median(r["changed"] / r["elements"] for r in steady),
      "changed_fraction_first10": statistics.median(
          r["changed"] / r["elements"] for r in first) if first else None,
      "wire_ratio": med("full_bytes") / max(1, med("delta_bytes")),
      "auto_delta": sum(r["auto_chose"] == "delta" for r in steady),
      "encode_ms": med("encode_ms"), "publish_ms": med("publish_ms"),
      "apply_ms": med("apply_ms"), "elements": rows[0]["elements"],
      "reward_last": rows[-1].get("reward")}
  for k in KINDS:
    out[f"{k}_bytes"] = med(f"{k}_bytes")
    # The first pull of a version pays the publisher's conversion of it to the wire
    # dtype (once per version): each kind goes first every third version; its time
    # is reported both ways (not first: the pull's own cost).
    later = [r[f"{k}_ms"] for r in steady if not r[f"{k}_first"]]
    firsts = [r[f"{k}_ms"] for r in steady if r[f"{k}_first"]]
    out[f"{k}_ms"] = statistics.median(later) if later else None
    out[f"{k}_ms_first"] = statistics.median(firsts) if firsts else None
  return out


# ---------------------------------------------------------------------------------------
# The encode alone
# ---------------------------------------------------------------------------------------

def encode_run(nbytes: int, fractions, repeats: int,
               print_fn: Callable[[str], object] = print) -> dict:
  """The publisher's compare + encode of `nbytes` of float32 against a base with each
  fraction of its elements changed (at random), on this platform's first device: the
  compiled programs (both ways of compacting the values) and numpy; min and median of
  `repeats` after one warm-up, every result checked bitwise against numpy's."""
  import jax
  import numpy as np
  from jax_m2n._src.jobs import codec, delta_device
  device = jax.devices()[0]
  n = nbytes // 4
  rng = np.random.default_rng(0)
  old = rng.standard_normal(n, dtype=np.float32)
  dold = jax.device_put(old, device)
  runs = []
  for fraction in fractions:
    new = old.copy()
    new[rng.integers(0, n, int(n * fraction))] += 1
    changed = int((new != old).sum())
    dnew = jax.device_put(new, device)
    piece = [delta_device.Piece(dnew, dold, (0,), (n,), delta_device.COMPARE)]

    def numpy_encode():
      host_new, host_old = np.asarray(dnew), np.asarray(dold)  # the D2H on accelerators
      return codec.encode_changes(host_new, codec.changed(host_new, host_old))

    want = numpy_encode()

    def programs():  # the device's part: the host's copy of the outputs left out
      jax.block_until_ready(delta_device.run(piece, device)[0])

    times = {"device_programs": {}}
    for name, fn, search in (("device", delta_device.encode, None),
                             ("device_search", delta_device.encode, 2.0),
                             ("device_scatter", delta_device.encode, -1.0),
                             ("numpy", None, None)):
      if name == "device_search" and fraction > 1 / 8:
        continue  # never taken there (SEARCH_BELOW); its temporaries grow with slots
      saved = delta_device.SEARCH_BELOW
      if search is not None:
        delta_device.SEARCH_BELOW = search
      try:
        call = numpy_encode if fn is None else (lambda: fn(piece, device).encoded)
        got = call()
        for f in ("modes", "bitmaps", "runs", "values"):
          if getattr(got, f).tobytes() != getattr(want, f).tobytes():
            raise AssertionError(f"delta bench: the {name} encode must equal numpy's "
                                 f"bitwise; its {f} do not")
        ts = []
        for _ in range(repeats):
          t0 = time.perf_counter()
          call()
          ts.append(time.perf_counter() - t0)
        times[name] = {"min_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts)}
        if name == "device":
          programs()
          ts = []
          for _ in range(repeats):
            t0 = time.perf_counter()
            programs()
            ts.append(time.perf_counter() - t0)
          times["device_programs"] = {"min_ms": 1e3 * min(ts),
                                      "median_ms": 1e3 * statistics.median(ts)}
      finally:
        delta_device.SEARCH_BELOW = saved
    runs.append({"fraction": fraction, "changed": changed, "elements": n,
                 "encoded_bytes": want.nbytes, "times": times})
    print_fn(f"  delta/encode {nbytes / 2**20:.0f} MiB, {100 * fraction:g}% changed on "
             f"{device.platform}: " + ", ".join(
                 f"{k} {v['min_ms']:.1f} ms" for k, v in times.items()))
    dnew = new = piece = None  # freed before the next fraction's copies
  return {"bytes": nbytes, "platform": device.platform,
          "device": getattr(device, "device_kind", device.platform), "repeats": repeats,
          "runs": runs}


# ---------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------

def run(workloads, lrs, steps: int, d_model: int, layers: int, nbytes: int, leaves: int,
        fractions, synthetic_steps: int, repeats: int, rates,
        print_fn: Callable[[str], object] = print) -> dict:
  doc = {"schema": 2, "suite": "delta", "steps": steps, "d_model": d_model,
         "layers": layers, "platform": "cpu", "runs": [], "synthetic": [],
         "encode": None}
  if "encode" in workloads:
    doc["encode"] = encode_run(nbytes, fractions, repeats, print_fn)
  for rate in rates:
    if "rl" in workloads:
      doc["runs"] += [run_one({"kind": "rl", "lr": lr, "steps": steps,
                               "d_model": d_model, "layers": layers}, rate, print_fn)
                      for lr in lrs]
    if "synthetic" in workloads:
      doc["synthetic"] += [run_one({"kind": "synthetic", "bytes": nbytes,
                                    "leaves": leaves, "fraction": f,
                                    "steps": synthetic_steps}, rate, print_fn)
                           for f in fractions]
  return doc


ENCODERS = ("device_programs", "device", "device_search", "device_scatter", "numpy")
HEAD = ("| link | {what} | changed / step (steady; first 10) | wire KiB full | "
        "wire KiB delta | full / delta | pull ms full | pull ms delta | pull ms auto "
        "(chose delta) | first pull ms full / delta / auto | publisher compare+encode "
        "ms |")


def _rows(runs: list[dict], what: Callable[[dict], str]) -> list[str]:
  lines = []
  for r in runs:
    s = r["summary"]
    first = (f"{100 * s['changed_fraction_first10']:.1f}%"
             if s["changed_fraction_first10"] is not None else "-")
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines.append(
        f"| {r['rate']} | {what(r)} | {100 * s['changed_fraction']:.2f}%; {first} | "
        f"{s['full_bytes'] / 1024:.1f} | {s['delta_bytes'] / 1024:.1f} | "
        f"{s['wire_ratio']:.2f}x | {ms(s['full_ms'])} | {ms(s['delta_ms'])} | "
        f"{ms(s['auto_ms'])} ({s['auto_delta']}/{s['steady']}) | "
        f"{ms(s['full_ms_first'])} / {ms(s['delta_ms_first'])} / "
        f"{ms(s['auto_ms_first'])} | {s['encode_ms']:.2f} |")
  return lines


def markdown(doc: dict) -> str:
  lines = []
  if doc.get("encode"):
    e = doc["encode"]
    lines += [f"Encode alone ({e['bytes'] / 2**20:.0f} MiB float32, {e['device']}, min of "
              f"{e['repeats']} after a warm-up, ms):", "",
              "| changed | encoded MiB | " + " | ".join(ENCODERS) + " |",
              "| ---: | ---: |" + " ---: |" * len(ENCODERS)]
    for r in e["runs"]:
      lines.append(f"| {100 * r['fraction']:g}% | {r['encoded_bytes'] / 2**20:.1f} | "
                   + " | ".join(f"{r['times'][k]['min_ms']:.1f}" if k in r["times"]
                                else "-" for k in ENCODERS) + " |")
    lines.append("")
  columns = "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  if doc["synthetic"]:
    r0 = doc["synthetic"][0]
    lines += [HEAD.format(what="pytree, changed"), columns]
    lines += _rows(doc["synthetic"], lambda r: f"{r['bytes'] / 2**20:.0f} MiB, "
                   f"{100 * r['fraction']:g}%")
    lines += ["", f"- A float32 pytree of {r0['leaves']} leaves (4 devices each side, "
              f"rows sharded), {r0['steps']} versions, each changing the fraction shown "
              "of every leaf (strided at a random offset); pulled in float32. Medians "
              f"over versions {r0['summary']['steady_from']}-{r0['steps']}.", ""]
  if doc["runs"]:
    r0 = doc["runs"][0]["summary"]
    lines += [HEAD.format(what="learning rate"), columns]
    lines += _rows(doc["runs"], lambda r: f"{r['lr']:g}")
    lines += ["", f"- examples/rl_refit.py's policy (d_model {doc['d_model']}, "
              f"{doc['layers']} layers, {r0['elements']:,} parameters, Adam), its RL "
              "steps, fsdp2xtp2 -> tp2xdp2; float32 published, bfloat16 on the wire; "
              f"{doc['steps']} versions, medians over versions {r0['steady_from']}-"
              f"{doc['steps']} (steady state)."]
  if doc["runs"] or doc["synthetic"]:
    lines.append(
        "- Wire bytes: what the generator pulled from the trainer (delta: the encoded "
        "arrays plus the JSON header). Pull ms: a version's pull when another kind went "
        "first; the first pull of a version also waits for the publisher's one "
        "conversion of it to the wire dtype. auto: delta=\"auto\", with how many of the "
        "steady versions it pulled as a delta. Separate programs: link loopback on "
        "127.0.0.1; a rate (1gbit) on two emulated hosts (jax_m2n.testing.hosts) "
        "joined by tc-shaped links of that rate.")
  return "\n".join(lines) + "\n"


def _size(text: str) -> int:
  units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
  for unit, scale in units.items():
    if text.lower().endswith(unit):
      return int(float(text[:-3]) * scale)
  return int(text)


def main(out_dir: str, print_fn: Callable[[str], object] = print,
         workloads=("rl", "synthetic", "encode"), lrs=DEFAULT_LRS,
         steps: int = DEFAULT_STEPS, d_model: int = 64, layers: int = 2,
         nbytes: int = DEFAULT_BYTES, leaves: int = 8, fractions=DEFAULT_FRACTIONS,
         synthetic_steps: int = DEFAULT_SYNTHETIC_STEPS, repeats: int = 5,
         rates=(None,)) -> int:
  doc = run(workloads, lrs, steps, d_model, layers, nbytes, leaves, fractions,
            synthetic_steps, repeats, rates, print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "delta", print_fn)
  return 0


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default="rl,synthetic,encode")
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
  parser.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS))
  parser.add_argument("--d_model", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--bytes", default="1GiB", help="the synthetic pytree's and the "
                      "encode's float32 bytes (e.g. 256MiB, 1GiB)")
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument("--fractions", default=",".join(f"{x:g}" for x in DEFAULT_FRACTIONS))
  parser.add_argument("--synthetic_steps", type=int, default=DEFAULT_SYNTHETIC_STEPS)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rates", default="loopback",
                      help="comma-separated: loopback and/or tc rates such as 1gbit "
                      "(two emulated hosts; needs root and iproute2)")
  parser.add_argument("--out_dir", default="/tmp/jax_m2n_bench")
  flags = parser.parse_args()
  sys.exit(main(flags.out_dir, workloads=flags.workloads.split(","),
                lrs=[float(x) for x in flags.lrs.split(",")], steps=flags.steps,
                d_model=flags.d_model, layers=flags.layers, nbytes=_size(flags.bytes),
                leaves=flags.leaves,
                fractions=[float(x) for x in flags.fractions.split(",")],
                synthetic_steps=flags.synthetic_steps, repeats=flags.repeats,
                rates=[None if r == "loopback" else r for r in flags.rates.split(",")]))
