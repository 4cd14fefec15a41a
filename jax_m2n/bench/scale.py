"""The scale suite: the host cost of one eager reshard of a DeepSeek-V3-shaped pytree at
8 to 256 devices, against jax.device_put in the same process.

Owns the model (`tree_specs`), its layouts per device count (`layouts`), the per-count
worker process (CPU devices: `jax_num_cpu_devices` is fixed per process, so every count
runs in a fresh one) and the report (scale.json, scale.md). It times host work (first
and repeated calls, compiles, peak RSS); the bytes are small by design.

The model: 61 layers x 14 leaves + embed_tokens + lm_head = 856 leaves, bfloat16, the
shapes of suites.PlannerModel.descriptors() without the shared expert's three
projections and the final norm, every dimension divided by `div` (64) and rounded up to
a multiple of 16 (so every mesh axis below divides it): 29 MiB in all. Fewer leaves
(`--leaves 16,58,72,114`) means fewer layers (leaves = 14 * layers + 2).

Device placement (colocated, as a refit on the trainer's own GPUs): N devices, N/8 per
pipeline stage. The trainer holds stage s's layers on devices [s*N/8, (s+1)*N/8) as a
mesh (ep, tp) (ep * tp = N/8, ep >= tp: 8 devices (1, 1), 32 (2, 2), 64 (4, 2), 256
(8, 4)): 2-D weights P(ep, tp), 3-D expert stacks P(ep, tp, None), 1-D norms and biases
P(ep) (replicated over tp). The generator is one mesh (dp, tp) over all N devices (8:
(2, 4), 32: (4, 8), 64: (8, 8), 256: (16, 16)) with the descriptors' generator specs (tp on
one dimension, replicated over dp; small 1-D leaves replicated on every device). The
topology is four equal NVLink domains (domain_size N/4).

Measured per count, in one process: reshard's first call (plans, builds, compiles) and
its repeat (median of --iters), jax.device_put's first call and repeat (same tree, same
destinations), compiles per call (jax.monitoring's backend-compile events), peak RSS
(getrusage) after the reshard calls and at the end, jax_m2n.plan() of the tree cached
(median), and a bitwise comparison of reshard's outputs with device_put's. Process CPU
time is reported beside wall time (a shared machine's wall time is noisy).

Case `one_device_bf16` (for one GPU): the float32 tree (`--scale_div`, default 16 for it:
about 880 MiB) on one device, reshard(tree, same device, dtype=bfloat16) against one
jitted astype over the tree, first call and repeat.

Usage:
  python -m jax_m2n.bench --suite scale [--devices 8,64,256] [--leaves 16,58,856]
      [--leaves_devices 32] [--case model|one_device_bf16] [--out_dir DIR]
  python -m jax_m2n.bench.scale --worker --devices 32 --leaves 856   # one count, JSON out
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

SCHEMA = "jax_m2n.bench.scale/1"
DEFAULT_DEVICES = (8, 64, 256)
SWEEP_LEAVES = (16, 58, 72, 114, 856)
SWEEP_DEVICES = 32
LAYERS = 61
PER_LAYER = 14
STAGES = 8

# (name, shape in the full model, generator spec) per layer: PlannerModel's rows less
# the shared expert (its three projections).
_HIDDEN, _EXPERTS, _FFN, _VOCAB = 7168, 256, 2048, 129280
_LAYER_ROWS = (
    ("input_layernorm", (_HIDDEN,), (None,)),
    ("self_attn.q_a_proj", (1536, _HIDDEN), (None, None)),
    ("self_attn.q_a_layernorm", (1536,), (None,)),
    ("self_attn.q_b_proj", (128 * 192, 1536), ("tp", None)),
    ("self_attn.kv_a_proj_with_mqa", (576, _HIDDEN), (None, None)),
    ("self_attn.kv_a_layernorm", (512,), (None,)),
    ("self_attn.kv_b_proj", (128 * 256, 512), ("tp", None)),
    ("self_attn.o_proj", (_HIDDEN, 128 * 128), (None, "tp")),
    ("post_attention_layernorm", (_HIDDEN,), (None,)),
    ("mlp.gate.weight", (_EXPERTS, _HIDDEN), (None, None)),
    ("mlp.gate.e_score_correction_bias", (_EXPERTS,), (None,)),
    ("mlp.experts.gate_proj", (_EXPERTS, _FFN, _HIDDEN), (None, "tp", None)),
    ("mlp.experts.up_proj", (_EXPERTS, _FFN, _HIDDEN), (None, "tp", None)),
    ("mlp.experts.down_proj", (_EXPERTS, _HIDDEN, _FFN), (None, None, "tp")),
)
assert len(_LAYER_ROWS) == PER_LAYER


def _scaled(d: int, div: int) -> int:
  return max(16, -(-(-(-d // div)) // 16) * 16)


def layers_for(leaves: int) -> int:
  """The layers of a tree of `leaves` leaves (14 per layer + embed + head)."""
  layers, rest = divmod(leaves - 2, PER_LAYER)
  if leaves < 2 + PER_LAYER or rest:
    raise ValueError(f"scale: leaves must be 14 * layers + 2 (16, 30, ..., 856); got "
                     f"{leaves}.")
  return layers


def tree_specs(layers: int = LAYERS, div: int = 64
               ) -> list[tuple[str, int, tuple[int, ...], tuple]]:
  """(name, pipeline stage, shape, generator spec) per leaf, in tree order."""
  per_stage = -(-layers // STAGES)
  rows = [("embed_tokens", 0, (_scaled(_VOCAB, div), _scaled(_HIDDEN, div)), ("tp", None))]
  for layer in range(layers):
    for name, shape, gen in _LAYER_ROWS:
      rows.append((f"layers.{layer}.{name}", layer // per_stage,
                   tuple(_scaled(d, div) for d in shape), gen))
  rows.append(("lm_head", STAGES - 1, (_scaled(_VOCAB, div), _scaled(_HIDDEN, div)),
               ("tp", None)))
  return rows


def mesh_shapes(n: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """((ep, tp) of a trainer stage, (dp, tp) of the generator) for n devices."""
  if n % STAGES or n < STAGES:
    raise ValueError(f"scale: devices must be a multiple of {STAGES}; got {n}.")
  per = n // STAGES
  ttp = 2 ** (int(math.log2(per)) // 2) if per & (per - 1) == 0 else 1
  gtp = 2 ** ((int(math.log2(n)) + 1) // 2) if n & (n - 1) == 0 else 1
  return (per // ttp, ttp), (n // gtp, gtp)


def _trainer_spec(rank: int) -> tuple:
  return ("ep",) if rank == 1 else ("ep", "tp") + (None,) * (rank - 2)


def layouts(jax, n: int, layers: int = LAYERS, div: int = 64, dtype: str = "bfloat16"):
  """(names, ShapeDtypeStructs with the trainer shardings, generator shardings,
  topology) of the model on the first n of jax.devices()."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_m2n
  devices = np.array(jax.devices()[:n])
  (ep, ttp), (dp, gtp) = mesh_shapes(n)
  per = n // STAGES
  stages = [Mesh(devices[s * per:(s + 1) * per].reshape(ep, ttp), ("ep", "tp"))
            for s in range(STAGES)]
  generator = Mesh(devices.reshape(dp, gtp), ("dp", "tp"))
  names, srcs, dsts = [], [], []
  for name, stage, shape, gen in tree_specs(layers, div):
    names.append(name)
    srcs.append(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
        stages[stage], P(*_trainer_spec(len(shape))))))
    dsts.append(NamedSharding(generator, P(*gen)))
  topology = jax_m2n.Topology(domain_size=max(1, n // 4))
  return names, srcs, dsts, topology


class CompileCounter:
  """Counts jax.monitoring's compile events (backend compiles, traces, lowerings) and
  their seconds, between `reset()` and `snapshot()`."""

  EVENTS = {"/jax/core/compile/backend_compile_duration": "compiles",
            "/jax/core/compile/jaxpr_trace_duration": "traces",
            "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings"}

  def __init__(self):
    import jax.monitoring
    self.counts: dict[str, float] = {}
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **_: Any) -> None:
    name = self.EVENTS.get(event)
    if name is not None:
      self.counts[name] = self.counts.get(name, 0) + 1
      self.counts[name + "_s"] = self.counts.get(name + "_s", 0.0) + duration

  def reset(self) -> None:
    self.counts = {}

  def snapshot(self) -> dict[str, float]:
    out = {k: self.counts.get(k, 0) for k in self.EVENTS.values()}
    out.update({k + "_s": round(self.counts.get(k + "_s", 0.0), 4)
                for k in self.EVENTS.values()})
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
  """(result, wall seconds, process CPU seconds) of fn() with its outputs ready."""
  import jax
  w, c = time.perf_counter(), time.process_time()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - w, time.process_time() - c


def _rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _same_bits(a, b) -> bool:
  import numpy as np
  if a.sharding != b.sharding or a.dtype != b.dtype or a.shape != b.shape:
    return False
  for sa, sb in zip(sorted(a.addressable_shards, key=lambda s: s.device.id),
                    sorted(b.addressable_shards, key=lambda s: s.device.id)):
    x, y = np.asarray(sa.data), np.asarray(sb.data)
    if sa.device != sb.device or x.tobytes() != y.tobytes():
      return False
  return True


def run_model(n: int, leaves: int, iters: int, div: int) -> dict:
  """One count's measurements (in a process with at least n devices)."""
  import jax
  import numpy as np

  import jax_m2n
  counter = CompileCounter()
  layers = layers_for(leaves)
  names, specs, dsts, topology = layouts(jax, n, layers, div)
  rng = np.random.default_rng(0)
  jax.block_until_ready(jax.jit(lambda v: v + 1)(np.float32(1)))  # JAX's own start-up
  src = {}
  for name, s in zip(names, specs):
    host = rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype)
    src[name] = jax.device_put(host, s.sharding)
  dst_tree = dict(zip(names, dsts))
  jax.block_until_ready(src)
  row: dict[str, Any] = {"case": "model", "devices": n, "leaves": len(names),
                         "layers": layers, "div": div,
                         "bytes": sum(v.nbytes for v in src.values()),
                         "rss_before_gib": round(_rss_gib(), 3)}
  reshard = lambda: jax_m2n.reshard(src, dst_tree, topology=topology)  # noqa: E731
  counter.reset()
  out, w, c = _timed(reshard)
  row["reshard_first_s"], row["reshard_first_cpu_s"] = round(w, 4), round(c, 4)
  row["reshard_first_events"] = counter.snapshot()
  reps, cpus = [], []
  counter.reset()
  for _ in range(iters):
    del out
    out, w, c = _timed(reshard)
    reps.append(w)
    cpus.append(c)
  row["reshard_repeat_s"] = round(statistics.median(reps), 5)
  row["reshard_repeat_cpu_s"] = round(statistics.median(cpus), 5)
  row["reshard_repeat_all_s"] = [round(v, 5) for v in reps]
  row["reshard_repeat_events"] = counter.snapshot()
  row["rss_after_reshard_gib"] = round(_rss_gib(), 3)

  put = lambda: jax.device_put(src, dst_tree)  # noqa: E731
  counter.reset()
  ref, w, c = _timed(put)
  row["device_put_first_s"], row["device_put_first_cpu_s"] = round(w, 4), round(c, 4)
  row["device_put_first_events"] = counter.snapshot()
  reps, cpus = [], []
  for _ in range(iters):
    del ref
    ref, w, c = _timed(put)
    reps.append(w)
    cpus.append(c)
  row["device_put_repeat_s"] = round(statistics.median(reps), 5)
  row["device_put_repeat_cpu_s"] = round(statistics.median(cpus), 5)
  row["bitwise_equal"] = all(_same_bits(out[k], ref[k]) for k in names)
  del out, ref

  jax_m2n.plan(specs, dsts, topology=topology)
  reps = []
  for _ in range(max(iters, 5)):
    _, w, _ = _timed(lambda: jax_m2n.plan(specs, dsts, topology=topology))
    reps.append(w)
  row["plan_cached_s"] = round(statistics.median(reps), 5)
  row["rss_peak_gib"] = round(_rss_gib(), 3)
  return row


def run_one_device_bf16(iters: int, div: int) -> dict:
  """The float32 -> bfloat16 refit on one device: reshard(dtype=bfloat16) against one
  jitted astype over the tree."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_m2n
  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  rng = np.random.default_rng(0)
  src = {name: jax.device_put(rng.standard_normal(shape, dtype=np.float32), sharding)
         for name, _, shape, _ in tree_specs(LAYERS, div)}
  jax.block_until_ready(src)
  counter = CompileCounter()
  row: dict[str, Any] = {"case": "one_device_bf16", "devices": 1, "leaves": len(src),
                         "div": div, "bytes": sum(v.nbytes for v in src.values()),
                         "device_kind": device.device_kind}
  cast = jax.jit(lambda t: jax.tree.map(lambda v: v.astype(jnp.bfloat16), t))
  for label, fn in (("reshard", lambda: jax_m2n.reshard(src, sharding, dtype=jnp.bfloat16)),
                    ("astype", lambda: cast(src))):
    counter.reset()
    out, w, c = _timed(fn)
    row[f"{label}_first_s"], row[f"{label}_first_cpu_s"] = round(w, 4), round(c, 4)
    row[f"{label}_first_events"] = counter.snapshot()
    reps = []
    counter.reset()
    for _ in range(iters):
      del out
      out, w, _ = _timed(fn)
      reps.append(w)
    row[f"{label}_repeat_s"] = round(statistics.median(reps), 6)
    row[f"{label}_repeat_events"] = counter.snapshot()
    row[f"{label}_out"] = out
  a, b = row.pop("reshard_out"), row.pop("astype_out")
  row["bitwise_equal"] = all(
      np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in src)
  row["rss_peak_gib"] = round(_rss_gib(), 3)
  return row


# ---------------------------------------------------------------------------------------
# The driver: one fresh process per (case, device count, leaves)
# ---------------------------------------------------------------------------------------

def _worker_command(case: str, n: int, leaves: int, iters: int, div: int) -> list[str]:
  return [sys.executable, "-m", "jax_m2n.bench.scale", "--worker", "--case", case,
          "--devices", str(n), "--leaves", str(leaves), "--iters", str(iters),
          "--scale_div", str(div)]


def run_worker(case: str, n: int, leaves: int, iters: int, div: int,
               timeout_s: float) -> dict:
  """Runs one measurement in a fresh process; its row (or a failed row)."""
  env = dict(os.environ)
  if case == "model":
    env["JAX_PLATFORMS"] = "cpu"
  cmd = _worker_command(case, n, leaves, iters, div)
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
  except subprocess.TimeoutExpired:
    return {"case": case, "devices": n, "leaves": leaves, "status": "timeout",
            "reason": f"over {timeout_s:.0f} s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    return {"case": case, "devices": n, "leaves": leaves, "status": "failed",
            "reason": (proc.stderr or proc.stdout)[-2000:]}
  row = json.loads(lines[-1])
  row["status"] = "ok" if row.get("bitwise_equal") else "invalid"
  row["process_s"] = round(time.perf_counter() - t0, 2)
  row["loadavg_end"] = list(os.getloadavg())
  return row


def _ms(v: float | None) -> str:
  if v is None:
    return "-"
  return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def markdown(doc: dict) -> str:
  env = doc["environment"]
  lines = [f"Scale suite ({doc['schema']}), commit {env.get('git_commit', '?')[:10]}"
           f"{' (dirty)' if env.get('git_dirty') else ''}, {env.get('date_utc')}, "
           f"{env.get('cpu_count')} cores, load {env.get('loadavg_start')}", ""]
  model = [r for r in doc["rows"] if r.get("case") == "model"]
  if model:
    lines += ["| devices | leaves | reshard first (CPU) | reshard repeat (CPU) | "
              "device_put first / repeat | compiles first / repeat | plan() cached | "
              "peak RSS | bitwise |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in model:
      if r.get("status") not in ("ok", "invalid"):
        lines.append(f"| {r['devices']} | {r['leaves']} | {r['status']}: "
                     f"{r.get('reason', '')[:80]} | | | | | | |")
        continue
      lines.append(
          f"| {r['devices']} | {r['leaves']} | {_ms(r['reshard_first_s'])} "
          f"({_ms(r['reshard_first_cpu_s'])}) | {_ms(r['reshard_repeat_s'])} "
          f"({_ms(r['reshard_repeat_cpu_s'])}) | {_ms(r['device_put_first_s'])} / "
          f"{_ms(r['device_put_repeat_s'])} | {r['reshard_first_events']['compiles']} / "
          f"{r['reshard_repeat_events']['compiles']} | {_ms(r['plan_cached_s'])} | "
          f"{r['rss_after_reshard_gib']:.2f} GiB | {r['bitwise_equal']} |")
  one = [r for r in doc["rows"] if r.get("case") == "one_device_bf16"]
  if one:
    lines += ["", "| device | leaves | MiB | reshard(dtype=bf16) first / repeat | "
              "jitted astype first / repeat | bitwise |", "| --- | --- | --- | --- | --- | --- |"]
    for r in one:
      if r.get("status") not in ("ok", "invalid"):
        lines.append(f"| - | - | - | {r['status']}: {r.get('reason', '')[:80]} | | |")
        continue
      lines.append(f"| {r['device_kind']} | {r['leaves']} | {r['bytes'] / 2**20:.0f} | "
                   f"{_ms(r['reshard_first_s'])} / {_ms(r['reshard_repeat_s'])} | "
                   f"{_ms(r['astype_first_s'])} / {_ms(r['astype_repeat_s'])} | "
                   f"{r['bitwise_equal']} |")
  return "\n".join(lines) + "\n"


def run_suite(out_dir: str, devices: Sequence[int] = DEFAULT_DEVICES,
              leaves: Sequence[int] = SWEEP_LEAVES, leaves_devices: int = SWEEP_DEVICES,
              cases: Sequence[str] = ("model",), iters: int = 5, div: int | None = None,
              timeout_s: float = 1800.0, echo: Callable[[str], None] = print) -> int:
  """Runs the suite into out_dir/scale.json and scale.md; 0 when every row ran and was
  bitwise equal, else 1."""
  from jax_m2n.bench import runner
  os.makedirs(out_dir, exist_ok=True)
  doc = {"schema": SCHEMA, "environment": runner.environment(None), "rows": []}
  plan = []
  if "model" in cases:
    plan += [("model", n, 2 + PER_LAYER * LAYERS) for n in devices]
    plan += [("model", leaves_devices, k) for k in leaves
             if not (leaves_devices in devices and k == 2 + PER_LAYER * LAYERS)]
  if "one_device_bf16" in cases:
    plan.append(("one_device_bf16", 1, 2 + PER_LAYER * LAYERS))
  for case, n, k in plan:
    d = div or (16 if case == "one_device_bf16" else 64)
    echo(f"scale/{case}: {n} devices, {k} leaves ...")
    row = run_worker(case, n, k, iters, d, timeout_s)
    doc["rows"].append(row)
    echo("  " + json.dumps({k2: v for k2, v in row.items() if not k2.endswith("_all_s")}))
    with open(os.path.join(out_dir, "scale.json"), "w") as f:
      json.dump(doc, f, indent=1)
    with open(os.path.join(out_dir, "scale.md"), "w") as f:
      f.write(markdown(doc))
  echo(markdown(doc))
  return 0 if all(r.get("status") == "ok" for r in doc["rows"]) else 1


def _main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_m2n.bench.scale")
  parser.add_argument("--worker", action="store_true", help="measure one count here")
  parser.add_argument("--case", default="model", choices=("model", "one_device_bf16"))
  parser.add_argument("--devices", default=",".join(map(str, DEFAULT_DEVICES)))
  parser.add_argument("--leaves", default=",".join(map(str, SWEEP_LEAVES)))
  parser.add_argument("--leaves_devices", type=int, default=SWEEP_DEVICES)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--scale_div", type=int, default=None)
  parser.add_argument("--out_dir", default="bench_out")
  args = parser.parse_args(argv)
  devices = [int(v) for v in args.devices.split(",") if v]
  leaves = [int(v) for v in args.leaves.split(",") if v]
  if not args.worker:
    return run_suite(args.out_dir, devices, leaves, args.leaves_devices,
                     args.case.split(","), args.iters, args.scale_div)
  div = args.scale_div or (16 if args.case == "one_device_bf16" else 64)
  if args.case == "model":
    import jax
    jax.config.update("jax_num_cpu_devices", devices[0])
    row = run_model(devices[0], leaves[0], args.iters, div)
  else:
    row = run_one_device_bf16(args.iters, div)
  print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
