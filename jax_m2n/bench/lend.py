"""Lend against snapshot on one GPU, two programs: time and memory of local pulls.

Owns the measurement of the trainer's memory (XLA's bytes in use, plus the device's
used memory outside both programs' pools, after the last pull) and of the local pull
(min / median of `iters` after `warmup`, each after a new version was published: the
same dtype, and bfloat16 on the way; the first pull of a new Subscriber; the publish)
beside the in-process device copy of the same bytes, for `Publisher.publish(...,
lend=True)` and the default snapshot (keep 2 and 1), per trainer memory setting (XLA's
pool preallocated at 0.35 of the GPU, XLA's default preallocation, none). The trainer
is jax_m2n/bench/lend_trainer.py; this program subscribes (run it without
preallocation: XLA_PYTHON_CLIENT_PREALLOCATE=false).

Where a pull's time goes: per row the medians of its phases (`PullRecord`: wait, plan,
move, compose) and of the local path's steps (`PullRecord.steps`: slot, map,
addresses, dispatch, ready, check, confirm, trim), the pull again once its version is
surely committed (`pull_settled`: 20 ms after the publish: a snapshot's copy is done),
and, once per size in this process, the copy alone (`copies`: XLA's device copy and
local_copy from a buffer of this process, each one call then a wait, and ten calls
then one wait: the kernels' own time). JAX is warmed up first (one jitted op), so the
first pull is the Subscriber's, not the process's first compile.

  python -m jax_m2n.bench.lend --out_dir OUT [--sizes_mib 256 1024] [--iters 10]
writes OUT/lend.json and OUT/lend.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from jax_m2n._src.jobs.records import LOCAL_STEPS

MIB = 1 << 20
SETTINGS = {"fraction_0.35": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                              "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.35"},
            "default_prealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
            "no_prealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}
MODES = (("lend", 2), ("snapshot", 2), ("snapshot", 1))


class _Trainer:
  def __init__(self, keep: int, env: dict[str, str]):
    full = dict(os.environ)
    full.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    full.update(env)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "jax_m2n.bench.lend_trainer", "--keep", str(keep)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full)
    self.address = json.loads(self.proc.stdout.readline())["address"]

  def __call__(self, **cmd: Any) -> dict[str, Any]:
    self.proc.stdin.write(json.dumps(cmd) + "\n")
    self.proc.stdin.flush()
    got = json.loads(self.proc.stdout.readline())
    if "error" in got:
      raise RuntimeError(got.get("trace", got["error"]))
    return got

  def close(self) -> None:
    try:
      self(op="exit")
    except Exception:  # noqa: BLE001
      pass
    self.proc.wait(timeout=60)


def _ms(ts: list[float]) -> dict[str, float]:
  return {"min_ms": min(ts) * 1e3, "median_ms": statistics.median(ts) * 1e3}


def _medians_ms(records: list[dict[str, float]]) -> dict[str, float]:
  """Per key of any record, the median over the records (a missing key counts 0)."""
  keys = list(dict.fromkeys(k for r in records for k in r))
  return {k: statistics.median(r.get(k, 0.0) for r in records) * 1e3 for k in keys}


def _phases(r: Any) -> dict[str, float]:
  return {"wait": r.wait_s, "plan": r.plan_s, "move": r.move_s, "compose": r.compose_s}


def copies(jax: Any, mib: int, warmup: int, iters: int) -> dict[str, Any]:
  """The copy alone in this process, `mib` MiB of float32 on device 0: XLA's device
  copy and local_copy from a buffer of this process (its prepared copier, the pull's
  kernel), each timed as one call then a wait, and as ten calls then one wait (/10:
  the kernel's own time, dispatch hidden)."""
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax_m2n._src import local_copy  # noqa: PLC0415
  device = jax.devices()[0]
  n = mib * MIB // 4
  x = jax.device_put(jnp.arange(n, dtype=jnp.float32), device)
  x.block_until_ready()
  box = local_copy.Box(0, 0, (n,), np.dtype(np.float32), (0,), (0,), (n,))
  copier = local_copy.copier(device, [box], [local_copy.Out((n,), np.dtype(np.float32))],
                             1)
  pointer = [x.unsafe_buffer_pointer()]
  ways = {"device_copy": lambda: jax.device_put(x, device, may_alias=False),
          "local_copy": lambda: copier(pointer)[0]}
  out: dict[str, Any] = {"mib": mib}
  for name, run in ways.items():
    one, ten = [], []
    for i in range(warmup + iters):
      start = time.perf_counter()
      run().block_until_ready()
      one.append(time.perf_counter() - start)
      start = time.perf_counter()
      jax.block_until_ready([run() for _ in range(10)])
      ten.append((time.perf_counter() - start) / 10)
    out[name] = _ms(one[warmup:])
    out[name + "_x10"] = _ms(ten[warmup:])
  got = copier(pointer)[0]
  out["bitwise"] = bool((got == x).all())
  return out


def one(jax: Any, setting: str, mode: str, keep: int, mib: int, warmup: int,
        iters: int) -> dict[str, Any]:
  """One row: a fresh trainer, `mib` MiB of float32 in one leaf."""
  import jax.numpy as jnp  # noqa: PLC0415
  import jax_m2n  # noqa: PLC0415
  from jax.sharding import SingleDeviceSharding  # noqa: PLC0415
  from jax_m2n.bench.lend_trainer import TOKEN, memory  # noqa: PLC0415
  dst = {"w": SingleDeviceSharding(jax.devices()[0])}
  t = _Trainer(keep, SETTINGS[setting])
  row: dict[str, Any] = {"setting": setting, "mode": mode, "keep": keep, "mib": mib}
  try:
    t(op="make", leaves=[["w", [mib * MIB // 4], "float32"]], seed=0)
    before_t, before_s = t(op="memory"), memory(jax)
    lend = mode == "lend"
    sub = jax_m2n.Subscriber(t.address, token=TOKEN)
    t(op="publish", lend=lend)
    start = time.perf_counter()
    jax.block_until_ready(sub.pull(dst, path="local"))
    row["first_pull_ms"] = (time.perf_counter() - start) * 1e3
    first = sub.last_pull
    row["first_pull_phases_ms"] = {k: v * 1e3 for k, v in _phases(first).items()}
    row["first_pull_steps_ms"] = {k: v * 1e3 for k, v in first.steps.items()}
    for name, dtype, settle_s in (("pull", None, 0.0), ("pull_bf16", jnp.bfloat16, 0.0),
                                  ("pull_settled", None, 0.02)):
      ts, pub_ts, phases, steps, calls = [], [], [], [], []
      for i in range(warmup + iters):
        pub_ts.append(t(op="publish", lend=lend)["publish_s"])
        if settle_s:
          time.sleep(settle_s)
        start = time.perf_counter()
        out = sub.pull(dst, dtype=dtype, path="local")
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - start)
        out = None
        r = sub.last_pull
        if i >= warmup:
          phases.append(_phases(r))
          steps.append(r.steps)
          calls.append(r.control_calls)
      row[name] = _ms(ts[warmup:])
      row[name]["phases_ms"] = _medians_ms(phases)
      row[name]["steps_ms"] = _medians_ms(steps)
      row[name]["control_calls"] = statistics.median(calls)
      row.setdefault("publish", _ms(pub_ts[warmup:]))
    row["retries"] = list(sub.last_pull.retries)
    after_t, after_s = t(op="memory"), memory(jax)
    xla = after_t["bytes_in_use"] - before_t["bytes_in_use"]
    outside = ((after_t["device_used"] - before_t["device_used"])
               - (after_t["pool_bytes"] - before_t["pool_bytes"])
               - (after_s["pool_bytes"] - before_s["pool_bytes"]))
    stats = t(op="stats")
    row.update(trainer_xla_mib=xla / MIB, trainer_outside_mib=max(0, outside) / MIB,
               trainer_extra_mib=(xla + max(0, outside)) / MIB,
               device_bytes=stats["device_bytes"],
               lent_allocation_mib=stats["lent_allocation_bytes"] / MIB,
               held_as=[v["held_as"] for v in stats["versions"]])
    sub.close()
    x = jax.device_put(jnp.zeros(mib * MIB // 4, jnp.float32), dst["w"])
    ts = []
    for i in range(warmup + iters):
      start = time.perf_counter()
      jax.block_until_ready(jax.device_put(x, dst["w"], may_alias=False))
      ts.append(time.perf_counter() - start)
    row["device_copy"] = _ms(ts[warmup:])
    row["pull_over_copy"] = row["pull"]["median_ms"] / row["device_copy"]["median_ms"]
    row["bf16_over_pull"] = row["pull_bf16"]["median_ms"] / row["pull"]["median_ms"]
  finally:
    t.close()
  return row


def markdown(rows: list[dict[str, Any]]) -> str:
  out = ["| trainer memory | mode | keep | MiB | trainer extra MiB (XLA + outside) | "
         "pull min / median ms | bf16 pull median ms | device copy median ms | "
         "pull / copy | bf16 / pull | first pull ms | publish median ms | "
         "settled pull median ms |",
         "| --- " * 13 + "|"]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['setting']} | {r['mode']} | {r['keep']} | {r['mib']} | error: "
                 f"{r['error'][:80]} |")
      continue
    out.append(
        f"| {r['setting']} | {r['mode']} | {r['keep']} | {r['mib']} | "
        f"{r['trainer_extra_mib']:.0f} ({r['trainer_xla_mib']:.0f} + "
        f"{r['trainer_outside_mib']:.0f}) | {r['pull']['min_ms']:.3f} / "
        f"{r['pull']['median_ms']:.3f} | {r['pull_bf16']['median_ms']:.3f} | "
        f"{r['device_copy']['median_ms']:.3f} | {r['pull_over_copy']:.2f} | "
        f"{r['bf16_over_pull']:.2f} | {r['first_pull_ms']:.1f} | "
        f"{r['publish']['median_ms']:.3f} | {r['pull_settled']['median_ms']:.3f} |")
  out += ["", "Where the pull's time goes (medians, ms; the steps are inside move; the "
          "last column: the first pull's):", "",
          "| trainer memory | mode | keep | MiB | pull | wait | plan | move | compose | "
          "slot | map | addresses | dispatch | ready | check | confirm | trim | "
          "control calls | first: map / dispatch / ready |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
          "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    if "error" in r:
      continue
    p, f = r["pull"], r["first_pull_steps_ms"]
    cells = [f"{p['phases_ms'].get(k, 0.0):.3f}" for k in ("wait", "plan", "move",
                                                            "compose")]
    cells += [f"{p['steps_ms'].get(k, 0.0):.3f}" for k in LOCAL_STEPS]
    out.append(f"| {r['setting']} | {r['mode']} | {r['keep']} | {r['mib']} | "
               f"{p['median_ms']:.3f} | " + " | ".join(cells) +
               f" | {p['control_calls']:g} | {f.get('map', 0):.1f} / "
               f"{f.get('dispatch', 0):.1f} / {f.get('ready', 0):.1f} |")
  return "\n".join(out)


def copies_markdown(rows: list[dict[str, Any]]) -> str:
  out = ["The copy alone, in this process (medians, ms; x10: ten calls then one wait, "
         "per call):", "",
         "| MiB | device copy | device copy x10 | local_copy | local_copy x10 | "
         "bitwise |",
         "| --- | --- | --- | --- | --- | --- |"]
  for c in rows:
    out.append(f"| {c['mib']} | {c['device_copy']['median_ms']:.3f} | "
               f"{c['device_copy_x10']['median_ms']:.3f} | "
               f"{c['local_copy']['median_ms']:.3f} | "
               f"{c['local_copy_x10']['median_ms']:.3f} | {c['bitwise']} |")
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out_dir", required=True)
  ap.add_argument("--sizes_mib", type=int, nargs="+", default=[256, 1024])
  ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  args = ap.parse_args(argv)
  import jax  # noqa: PLC0415
  os.makedirs(args.out_dir, exist_ok=True)
  jax.jit(lambda v: v + 1)(jax.numpy.zeros(8)).block_until_ready()  # JAX's own start
  copy_rows = []
  for mib in args.sizes_mib:
    try:
      copy_rows.append(copies(jax, mib, args.warmup, args.iters))
    except Exception as e:  # noqa: BLE001 - the pulls still run
      copy_rows.append({"mib": mib, "error": f"{type(e).__name__}: {e}"})
    print(json.dumps(copy_rows[-1]), flush=True)
  rows = []
  for setting in args.settings:
    for mode, keep in MODES:
      for mib in args.sizes_mib:
        try:
          rows.append(one(jax, setting, mode, keep, mib, args.warmup, args.iters))
        except Exception as e:  # noqa: BLE001 - the other rows still run
          rows.append({"setting": setting, "mode": mode, "keep": keep, "mib": mib,
                       "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
  doc = {"device": str(jax.devices()[0].device_kind), "rows": rows,
         "copies": copy_rows, "jax": jax.__version__}
  with open(os.path.join(args.out_dir, "lend.json"), "w") as f:
    json.dump(doc, f, indent=1)
  text = markdown(rows) + "\n\n" + copies_markdown(
      [c for c in copy_rows if "error" not in c])
  with open(os.path.join(args.out_dir, "lend.md"), "w") as f:
    f.write(f"{doc['device']}, jax {doc['jax']}\n\n{text}\n")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
