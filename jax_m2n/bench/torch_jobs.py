"""The jobs suite's torch rows: a JAX Publisher's versions pulled by `jax_m2n.torch`.

Owns the torch generator's measurements, in this process, against a trainer program of
its own (this module with `--trainer`: JAX, 4 CPU devices or the first GPU, publishing
on command over stdin / stdout JSON lines):
- local: 256 MiB float32 [rows, 1024] P(x) -> torch bfloat16 in place (pull_into, the
  trainer's export mapped), against one torch copy-with-conversion of the same bytes
  in this process (`dst.copy_(src)`, both warm);
- network: the same pull over the network path, against the JAX Subscriber's network
  pull of the same bytes into one device of this process;
- tp: 4 torch ranks (one Subscriber each, rank r of 4) pulling their tensor-parallel
  shards of a 64-leaf model (16 layers of q/k/v fused and transposed, Shard(0), and o
  transposed, Shard(1)) as bfloat16: bitwise, the bytes each rank received;
- gpu (where torch sees CUDA): 1 GiB float32 published on the GPU, pulled into a torch
  CUDA tensor, against torch's own device copy; the first pull apart.
Every timed pull follows a fresh publish; the first and last pulls are checked bitwise.

Usage: python -m jax_m2n.bench.torch_jobs [--parts local,network,tp,gpu] [--size_mib 256]
  [--iters 10] [--warmup 2] [--out_dir DIR]; `--suite jobs` runs it after the JAX rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

MIB = 1 << 20
TOKEN = "torch-bench-token-0123456789abcdef"
PARTS = ("local", "network", "tp", "gpu")
LAYERS = 16
D = 256


def _values(np, rows: int, v: int):
  """Version v of the big leaf: exactly representable steps, different per version."""
  return (np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024) % 8191) * 0.25 + v


def _model_values(np, v: int) -> dict[str, Any]:
  rng = np.random.default_rng(0)
  out = {}
  for i in range(LAYERS):
    for k in ("wq", "wk", "wv", "wo"):
      out[f"layers.{i}.{k}"] = rng.standard_normal((D, D), dtype=np.float32) + v
  return out


# ---------------------------------------------------------------------------------------
# The trainer program
# ---------------------------------------------------------------------------------------

def trainer_main() -> None:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_m2n
  from jax_m2n.bench import jobs_trainer
  devs = jax.devices()
  mesh = Mesh(np.array(devs[:4] if devs[0].platform == "cpu" else devs[:1]), ("x",))
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  tree, v = None, 0
  print(json.dumps({"address": pub.address}), flush=True)
  for line in sys.stdin:
    cmd = json.loads(line)
    try:
      if cmd["op"] == "big":
        tree = ("big", int(cmd["rows"]))
        reply = {}
      elif cmd["op"] == "model":
        tree = ("model", 0)
        reply = {}
      elif cmd["op"] == "publish":
        v += 1
        if tree[0] == "big":
          x = {"w": jax.device_put(_values(np, tree[1], v), NamedSharding(mesh, P("x")))}
        else:
          x = {"layers": {str(i): {k: jax.device_put(a, NamedSharding(mesh, P("x")))
                                   for k, a in _model_layer(np, v, i).items()}
                          for i in range(LAYERS)}}
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        got = pub.publish(x)
        t1 = time.perf_counter()
        jobs_trainer._settle(pub, got)  # noqa: SLF001 - until its export slot committed
        reply = {"version": got, "publish_ms": (t1 - t0) * 1e3}
        assert got == v
      else:
        break
    except Exception as e:  # noqa: BLE001 - reported to the generator
      reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply), flush=True)
  pub.close()


def _model_layer(np, v: int, i: int) -> dict[str, Any]:
  vals = _model_values(np, v)
  return {k: vals[f"layers.{i}.{k}"] for k in ("wq", "wk", "wv", "wo")}


class Trainer:
  def __init__(self, gpu: bool):
    env = dict(os.environ)
    if gpu:  # (the generator's JAX may be held to the CPU: not the trainer's)
      env.pop("JAX_PLATFORMS", None)
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.3"
    else:
      env["JAX_PLATFORMS"] = "cpu"
      env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    self.proc = subprocess.Popen([sys.executable, "-m", "jax_m2n.bench.torch_jobs",
                                  "--trainer"], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    self.address = self._read()["address"]

  def _read(self) -> dict[str, Any]:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError("torch bench: the trainer program exited")
    got = json.loads(line)
    if "error" in got:
      raise RuntimeError(f"torch bench: the trainer failed: {got['error']}")
    return got

  def call(self, op: str, **args) -> dict[str, Any]:
    self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    try:
      self.call("exit") if self.proc.poll() is None else None
    except (RuntimeError, BrokenPipeError, ValueError):
      pass
    try:
      self.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.proc.kill()


# ---------------------------------------------------------------------------------------
# The generator's rows
# ---------------------------------------------------------------------------------------

def _stats(times: list[tuple[float, float]], first: float | None = None) -> dict[str, Any]:
  out = {"min_ms": min(t for t, _ in times),
         "median_ms": statistics.median(t for t, _ in times),
         "cpu_median_ms": statistics.median(c for _, c in times)}
  if first is not None:
    out["first_ms"] = first
  return out


def _clock(fn: Callable[[], Any]) -> tuple[float, float]:
  """(wall ms, this process's CPU ms) of one call."""
  c0, t0 = time.process_time(), time.perf_counter()
  fn()
  return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _interleaved(trainer: Trainer, cases: dict[str, tuple[Callable, Callable | None]],
                 warmup: int, iters: int) -> dict[str, dict[str, Any]]:
  """Each round runs every case once, in turn (a pull after a fresh publish; a copy as
  it is), so a loaded machine's drift hits all alike; the first round apart, then
  warm-up and timed rounds; pulls checked bitwise in the first and last rounds."""
  times: dict[str, list] = {k: [] for k in cases}
  for i in range(1 + warmup + iters):
    for name, (run, check) in cases.items():
      v = trainer.call("publish")["version"] if check is not None else None
      times[name].append(_clock(run))
      if check is not None and i in (0, warmup + iters):
        check(v)
  return {k: {**_stats(t[1 + warmup:], t[0][0] if cases[k][1] else None),
              **({"bitwise": True} if cases[k][1] else {})} for k, t in times.items()}


def _timed(trainer, pull, warmup, iters, check) -> dict[str, Any]:
  return _interleaved(trainer, {"pull": (pull, check)}, warmup, iters)["pull"]


def _copy_row(torch, src, dst, warmup: int, iters: int) -> dict[str, Any]:
  def run():
    dst.copy_(src)
    if dst.is_cuda:
      torch.cuda.synchronize()
  times = [_clock(run) for _ in range(warmup + iters)]
  return _stats(times[warmup:])


def big_rows(parts, size_mib: float, warmup: int, iters: int, print_fn) -> list[dict]:
  import jax
  import ml_dtypes
  import numpy as np
  import torch
  import jax_m2n
  import jax_m2n.torch as jt
  rows = int(size_mib * MIB) // (4 * 1024)
  nbytes = rows * 4096
  trainer = Trainer(gpu=False)
  subs = []
  try:
    trainer.call("big", rows=rows)
    want = lambda v: _values(np, rows, v).astype(ml_dtypes.bfloat16).view(np.int16)  # noqa: E731
    src = torch.from_numpy(_values(np, rows, 1))
    copy_dst = torch.empty(rows, 1024, dtype=torch.bfloat16)
    cases: dict[str, tuple[Callable, Callable | None]] = {
        "copy": (lambda: copy_dst.copy_(src), None)}
    what = {"copy": "torch copy float32 -> bfloat16 (this process)"}
    for path in [p for p in ("local", "network") if p in parts]:
      sub = jt.Subscriber(trainer.address, token=TOKEN)
      subs.append(sub)
      dst = torch.empty(rows, 1024, dtype=torch.bfloat16)

      def check(v, dst=dst, path=path):
        if not np.array_equal(dst.view(torch.int16).numpy(), want(v)):
          raise AssertionError(f"torch bench: {path} version {v} is not bitwise")

      cases[path] = (lambda sub=sub, dst=dst, path=path: sub.pull_into(
          {"w": dst}, path=path, timeout_s=300), check)
      what[path] = f"jax_m2n.torch pull_into ({path})"
    if "network" in parts:
      dev = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
      jsub = jax_m2n.Subscriber(trainer.address, token=TOKEN)
      subs.append(jsub)
      got: dict[str, Any] = {}

      def jcheck(v):
        if not np.array_equal(np.asarray(got["w"]).view(np.int16), want(v)):
          raise AssertionError(f"torch bench: JAX pull of version {v} is not bitwise")

      def jpull():
        got.update(jsub.pull(dev, dtype=jax.numpy.bfloat16, path="network",
                             timeout_s=300, donate=got.get("w")))
      cases["network_jax"] = (jpull, jcheck)
      what["network_jax"] = "jax_m2n.Subscriber pull (network, same bytes)"
    res = _interleaved(trainer, cases, warmup, iters)
    out = []
    for k, r in res.items():
      row = {"part": k, "what": what[k], "bytes": nbytes, **r}
      out.append(row)
      print_fn(f"torch jobs: {k} {r['median_ms']:.1f} ms")
    for sub in subs:
      if isinstance(sub, jt.Subscriber):
        next(r for r in out if r["part"] == sub.last_pull.path).update(
            received_bytes=sub.last_pull.nbytes,
            phases_ms={k: v * 1e3 for k, v in sub.last_pull.phases.items()})
  finally:
    for sub in subs:
      sub.close()
    trainer.close()
  return out


def tp_rows(warmup: int, iters: int, print_fn) -> list[dict]:
  import ml_dtypes
  import numpy as np
  import torch
  import jax_m2n.torch as jt
  world, n = 4, D // 4

  def names(path):
    _, i, k = path.split(".")
    if k == "wo":
      return jt.Into(f"layers.{i}.o_proj.weight", transpose=True)
    return jt.Into(f"layers.{i}.qkv_proj.weight", ("wq", "wk", "wv").index(k), 3, 0,
                   transpose=True)

  placements = {f"layers.{i}.{p}": jt.Shard(0 if p == "qkv_proj.weight" else 1)
                for i in range(LAYERS) for p in ("qkv_proj.weight", "o_proj.weight")}
  out = []
  trainer = Trainer(gpu=False)
  try:
    trainer.call("model")
    for path in ("local", "network"):
      per_rank = []
      for rank in range(world):
        tensors = {}
        for i in range(LAYERS):
          tensors[f"layers.{i}.qkv_proj.weight"] = torch.empty(3 * n, D, dtype=torch.bfloat16)
          tensors[f"layers.{i}.o_proj.weight"] = torch.empty(D, n, dtype=torch.bfloat16)

        def check(v, rank=rank, tensors=tensors):
          vals = _model_values(np, v)
          for i in range(LAYERS):
            qkv = np.concatenate([vals[f"layers.{i}.{k}"].T[rank * n:(rank + 1) * n]
                                  for k in ("wq", "wk", "wv")])
            o = vals[f"layers.{i}.wo"].T[:, rank * n:(rank + 1) * n]
            for name, w in ((f"layers.{i}.qkv_proj.weight", qkv),
                            (f"layers.{i}.o_proj.weight", o)):
              if not np.array_equal(tensors[name].view(torch.int16).numpy(),
                                    w.astype(ml_dtypes.bfloat16).view(np.int16)):
                raise AssertionError(f"torch bench: rank {rank} {name} is not bitwise")

        with jt.Subscriber(trainer.address, token=TOKEN, rank=rank,
                           world_size=world) as sub:
          r = _timed(trainer, lambda: sub.pull_into(
              tensors, names=names, placements=placements, path=path, timeout_s=300),
              warmup, iters, check)
          per_rank.append({"rank": rank, "received_bytes": sub.last_pull.nbytes, **r})
      total = LAYERS * 4 * D * D * 2
      out.append({"part": "tp", "what": f"4 torch ranks, 64 leaves, TP shards ({path})",
                  "path": path, "bytes": total, "ranks": per_rank,
                  "received_bytes_per_rank": [p["received_bytes"] for p in per_rank],
                  "median_ms": max(p["median_ms"] for p in per_rank),
                  "bitwise": all(p["bitwise"] for p in per_rank)})
      print_fn(f"torch jobs: tp {path} bytes per rank "
               f"{out[-1]['received_bytes_per_rank']} of {total}")
  finally:
    trainer.close()
  return out


def gpu_rows(warmup: int, iters: int, print_fn, size_mib: float = 1024) -> list[dict]:
  import numpy as np
  import torch
  import jax_m2n.torch as jt
  rows = int(size_mib * MIB) // (4 * 1024)
  out = []
  src = torch.empty(rows, 1024, device="cuda")
  copy = _copy_row(torch, src, torch.empty_like(src), 2, iters)
  del src
  out.append({"part": "gpu_copy", "what": "torch device copy (this process)",
              "bytes": rows * 4096, **copy})
  trainer = Trainer(gpu=True)
  try:
    trainer.call("big", rows=rows)
    dst = torch.empty(rows, 1024, device="cuda")

    def check(v):
      if not np.array_equal(dst.cpu().numpy(), _values(np, rows, v)):
        raise AssertionError(f"torch bench: GPU version {v} is not bitwise")

    with jt.Subscriber(trainer.address, token=TOKEN) as sub:
      def pull():
        sub.pull_into({"w": dst}, timeout_s=300)
        torch.cuda.synchronize()
      r = _timed(trainer, pull, warmup, iters, check)
      out.append({"part": "gpu", "what": f"jax_m2n.torch pull_into ({sub.last_pull.path})",
                  "bytes": rows * 4096, **r})
    print_fn(f"torch jobs: gpu {out[-1]['median_ms']:.1f} ms, first {r['first_ms']:.0f} ms")
  finally:
    trainer.close()
  return out


def run(parts=PARTS, size_mib: float = 256, warmup: int = 2, iters: int = 10,
        print_fn: Callable[[str], object] = print) -> dict[str, Any]:
  """The rows asked (gpu only where torch sees CUDA), with the goals' ratios."""
  import torch
  rows: list[dict] = []
  started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  load = os.getloadavg()[0]
  if {"local", "network"} & set(parts):
    rows += big_rows(parts, size_mib, warmup, iters, print_fn)
  if "tp" in parts:
    rows += tp_rows(warmup, iters, print_fn)
  if "gpu" in parts and torch.cuda.is_available():
    rows += gpu_rows(warmup, iters, print_fn)
  by = {r["part"]: r for r in rows}
  ratios = {}
  if "local" in by:
    ratios["local / torch copy (goal <= 1.5)"] = by["local"]["median_ms"] / by["copy"]["median_ms"]
  if "network" in by:
    ratios["network / JAX Subscriber network (goal <= 1.15)"] = (
        by["network"]["median_ms"] / by["network_jax"]["median_ms"])
  if "gpu" in by:
    ratios["gpu / torch device copy (goal <= 1.3)"] = by["gpu"]["median_ms"] / by[
        "gpu_copy"]["median_ms"]
    ratios["gpu first pull s (goal <= 0.5)"] = by["gpu"]["first_ms"] / 1e3
  return {"suite": "jobs", "part": "torch", "started_utc": started, "loadavg_start": load,
          "loadavg_end": os.getloadavg()[0], "cpu_count": os.cpu_count(),
          "torch": torch.__version__, "size_mib": size_mib, "warmup": warmup,
          "iters": iters, "rows": rows, "ratios": ratios}


def markdown(doc: dict[str, Any]) -> str:
  lines = [f"**torch generator: {doc['started_utc']}; {doc['cpu_count']} CPUs; load "
           f"{doc['loadavg_start']:.1f} -> {doc['loadavg_end']:.1f}; torch {doc['torch']}; "
           f"{doc['warmup']} warm-up, {doc['iters']} timed**\n",
           "| what | bytes | min ms | median ms | CPU median ms | first ms | bytes per rank |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
  for r in doc["rows"]:
    f = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
    lines.append(f"| {r['what']} | {r['bytes'] / MIB:.0f} MiB | {f('min_ms')} | "
                 f"{f('median_ms')} | {f('cpu_median_ms')} | {f('first_ms')} | "
                 f"{r.get('received_bytes_per_rank', '-')} |")
  lines.append("")
  lines += [f"- {k}: {v:.2f}" for k, v in doc["ratios"].items()]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--parts", default=",".join(PARTS))
  ap.add_argument("--size_mib", type=float, default=256)
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--out_dir", default=None)
  args = ap.parse_args(argv)
  if args.trainer:
    return trainer_main()
  doc = run(args.parts.split(","), args.size_mib, args.warmup, args.iters)
  text = markdown(doc)
  print(text)
  if args.out_dir:
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "jobs_torch.json"), "w") as f:
      json.dump(doc, f, indent=1)
    with open(os.path.join(args.out_dir, "jobs_torch.md"), "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
