"""The torch.distributed engine: the RL frameworks' refit path, in its own processes.

Usage (the bench starts it; by hand only to debug):
  python -m jax_m2n.bench.torch_engine SPEC.json OUT.json
SPEC.json: {"cases": [Case.to_json(), ...], "warmup": 3, "iters": 10,
            "device": "cuda" | "cpu", "world": N (cpu only), "timeout_s": 600}

Owns one launch of torch.multiprocessing (spawn, one process per GPU, NCCL; gloo on CPU for
tests) that runs every case as: all-gather on the source group, broadcast from its first
rank to the destinations that lack the tensor, then each destination keeps its box. Each
rank validates its result bitwise against the same deterministic data as the JAX process
(data.py) before timing, and times itself (mean over iterations; the bench reports the
maximum over ranks). Never imported by the JAX process: torch and JAX never share a process
(two NCCL/CUDA stacks, and JAX's GPU memory preallocation).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

# NVLink multicast stays off in every process (docs/benchmarks.md, "Running").
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}


def _box_slices(box) -> tuple[slice, ...]:
  return tuple(slice(lo, hi) for lo, hi in box)


class _Leaf:
  """One tensor of a case, from this rank's point of view."""

  def __init__(self, case_key: str, spec: dict, rank: int, device, torch):
    from jax_m2n._src.layout import parse_layout
    from jax_m2n.bench import data as bench_data
    self.name = spec["name"]
    self.shape = tuple(spec["shape"])
    np_dtype = bench_data.np_dtype(spec["dtype"])
    self.dtype = getattr(torch, spec["dtype"])
    self.int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                      8: torch.int64}[np_dtype.itemsize]
    src = parse_layout(spec["src"], self.shape)
    dst = parse_layout(spec["dst"], self.shape)
    shards = sorted(src.shards(), key=lambda s: s[0])
    self.replicated = len(shards) == 1
    if self.replicated:
      self.gather_ranks: list[int] = []
      self.holders_full = set(shards[0][1])
      root = shards[0][1][0]
    else:
      self.gather_ranks = [holders[0] for _, holders in shards]
      self.holders_full = set(self.gather_ranks)
      root = self.gather_ranks[0]
    self.src_slices = {holders[0]: _box_slices(box) for box, holders in shards}
    # all_gather_into_tensor concatenates along dim 0: usable when the shards are
    # consecutive dim-0 slabs (FSDP/EP layouts); otherwise all_gather + assembly.
    self.gather_dim0 = not self.replicated and all(
        box[1:] == tuple((0, n) for n in self.shape[1:]) for box, _ in shards) and all(
        a[0][0][1] == b[0][0][0] for a, b in zip(shards, shards[1:]))
    need = sorted({d for box, ds in dst.shards() for d in ds} - self.holders_full)
    self.bcast_ranks = [root] + need if need else []
    box = dst.box_of(rank)
    self.dst_slices = _box_slices(box) if box is not None else None
    self.my_src = self.expected = None
    if rank in self.holders_full or rank in self.src_slices or self.dst_slices is not None:
      value = bench_data.make_array(self.shape, spec["dtype"],
                                    bench_data.seed_of(case_key, self.name))
      if rank in self.holders_full:
        mine = value if self.replicated else value[self.src_slices[rank]]
        self.my_src = self._to_torch(mine, device)
      if self.dst_slices is not None:
        self.expected = self._to_torch(value[self.dst_slices], device)
      del value

  def _to_torch(self, a, device):
    import numpy as np
    import torch
    ints = np.ascontiguousarray(a).view({1: np.uint8, 2: np.int16, 4: np.int32,
                                         8: np.int64}[a.dtype.itemsize])
    return torch.from_numpy(ints).to(device).view(self.dtype)

  def groups(self) -> list[tuple[int, ...]]:
    return [tuple(g) for g in (self.gather_ranks, self.bcast_ranks) if len(g) > 1]


def _step(leaves, groups, rank, device, torch, dist) -> list:
  """One refit of every leaf: gather on the sources, broadcast, keep the box."""
  outs = []
  for leaf in leaves:
    full = None
    if leaf.replicated:
      if rank in leaf.holders_full:
        full = leaf.my_src
    elif rank in leaf.gather_ranks:
      group = groups[tuple(leaf.gather_ranks)]
      if leaf.gather_dim0:
        full = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        dist.all_gather_into_tensor(full, leaf.my_src, group=group)
      else:
        parts = [torch.empty_like(leaf.my_src) for _ in leaf.gather_ranks]
        dist.all_gather(parts, leaf.my_src, group=group)
        full = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        for r, part in zip(leaf.gather_ranks, parts):
          full[leaf.src_slices[r]].copy_(part)
    if rank in leaf.bcast_ranks:
      if full is None:
        full = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
      dist.broadcast(full, src=leaf.bcast_ranks[0],
                     group=groups[tuple(leaf.bcast_ranks)])
    if leaf.dst_slices is not None:
      out = full[leaf.dst_slices]
      outs.append(out if out.is_contiguous() else out.contiguous())
  return outs


def _valid(leaves, outs, torch) -> str | None:
  it = iter(outs)
  for leaf in leaves:
    if leaf.dst_slices is None:
      continue
    out = next(it)
    if tuple(out.shape) != tuple(leaf.expected.shape) or not torch.equal(
        out.view(leaf.int_dtype), leaf.expected.view(leaf.int_dtype)):
      bad = int((out.view(leaf.int_dtype) != leaf.expected.view(leaf.int_dtype)).sum()) \
          if out.shape == leaf.expected.shape else -1
      return f"{leaf.name}: {bad} elements differ"
  return None


def _rank_main(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
  for k, v in _NCCL_ENV.items():
    os.environ.setdefault(k, v)
  import datetime
  import torch
  import torch.distributed as dist

  use_cuda = spec["device"] == "cuda"
  if use_cuda:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    sync = torch.cuda.synchronize
  else:
    device = torch.device("cpu")
    sync = lambda: None  # noqa: E731
  kwargs = {"device_id": device} if use_cuda else {}
  dist.init_process_group(
      "nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
      world_size=world, timeout=datetime.timedelta(seconds=spec.get("timeout_s", 600)),
      **kwargs)
  report = {"rank": rank, "torch_version": torch.__version__, "cases": {}}
  if use_cuda:
    report["device_name"] = torch.cuda.get_device_name(device)
    try:
      report["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - informational only
      pass

  def save():
    tmp = f"{out_path}.rank{rank}.tmp"
    with open(tmp, "w") as f:
      json.dump(report, f)
    os.replace(tmp, f"{out_path}.rank{rank}.json")

  cases = [c for c in spec["cases"] if _devices_needed(c) <= world]
  for c in spec["cases"]:
    if _devices_needed(c) > world:
      report["cases"][_key(c)] = {"status": "skipped",
                                  "reason": f"needs {_devices_needed(c)} GPUs, have {world}"}
  # Every rank creates every group, in the same order (torch.distributed's rule).
  needed = set()
  for c in cases:
    for t in c["tensors"]:
      needed.update(_group_ranks(t))
  groups = {g: dist.new_group(list(g)) for g in sorted(needed)}
  save()
  for c in cases:
    key = _key(c)
    try:
      leaves = [_Leaf(key, t, rank, device, torch) for t in c["tensors"]]
      sync()
      dist.barrier()
      t0 = time.perf_counter()
      outs = _step(leaves, groups, rank, device, torch, dist)
      sync()
      first = time.perf_counter() - t0
      problem = _valid(leaves, outs, torch)
      del outs
      flag = torch.tensor([0 if problem else 1], device=device)
      dist.all_reduce(flag, op=dist.ReduceOp.MIN)
      entry = {"first_s": first, "valid": problem is None, "problem": problem}
      if int(flag.item()) == 1:
        warm, timed = [], []
        for i in range(spec["warmup"] + spec["iters"]):
          dist.barrier()
          sync()
          t0 = time.perf_counter()
          outs = _step(leaves, groups, rank, device, torch, dist)
          sync()
          (warm if i < spec["warmup"] else timed).append(time.perf_counter() - t0)
          outs.clear()  # freed after the clock stops
        entry.update(status="ok", warmup_s=warm, times_s=timed)
      else:
        entry.update(status="invalid",
                     reason=problem or "another rank's result was not bitwise equal")
      report["cases"][key] = entry
      del leaves
      if use_cuda:
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - recorded; peers then time out
      report["cases"][key] = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-4000:]}
      save()
      raise
    save()
  dist.barrier()
  dist.destroy_process_group()


def _key(c: dict) -> str:
  return f"{c['suite']}/{c['name']}"


def _devices_needed(c: dict) -> int:
  from jax_m2n._src.layout import parse_mesh_spec
  n = 0
  for t in c["tensors"]:
    for text in (t["src"], t["dst"]):
      m = parse_mesh_spec(text)
      n = max(n, m.first + m.size)
  return n


def _group_ranks(t: dict) -> list[tuple[int, ...]]:
  from jax_m2n._src.layout import parse_layout
  shape = tuple(t["shape"])
  src = parse_layout(t["src"], shape)
  dst = parse_layout(t["dst"], shape)
  shards = sorted(src.shards(), key=lambda s: s[0])
  if len(shards) == 1:
    full, root, gather = set(shards[0][1]), shards[0][1][0], []
  else:
    gather = [h[0] for _, h in shards]
    full, root = set(gather), gather[0]
  need = sorted({d for _, ds in dst.shards() for d in ds} - full)
  return [tuple(g) for g in (gather, [root] + need if need else []) if len(g) > 1]


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _merge(spec: dict, out_path: str, world: int, error: str | None) -> dict:
  ranks = []
  for r in range(world):
    try:
      with open(f"{out_path}.rank{r}.json") as f:
        ranks.append(json.load(f))
    except (OSError, ValueError):
      ranks.append({"rank": r, "cases": {}})
  merged = {"world": world, "cases": {}}
  for k in ("torch_version", "device_name", "nccl_version"):
    if k in ranks[0]:
      merged[k] = ranks[0][k]
  for c in spec["cases"]:
    key = _key(c)
    per = [r["cases"].get(key) for r in ranks]
    if any(p is None for p in per):
      merged["cases"][key] = {"status": "failed", "reason": (
          f"torch workers stopped before this case ({error or 'no result'})")}
      continue
    statuses = {p["status"] for p in per}
    if statuses != {"ok"}:
      worst = next(p for p in per if p["status"] != "ok")
      merged["cases"][key] = {k: v for k, v in worst.items()
                              if k in ("status", "reason", "traceback")}
      continue
    means = [sum(p["times_s"]) / len(p["times_s"]) for p in per]
    top = max(range(world), key=lambda i: means[i])
    merged["cases"][key] = {
        "status": "ok", "first_s": max(p["first_s"] for p in per),
        "warmup_s": per[top]["warmup_s"], "times_s": per[top]["times_s"],
        "max_rank": top, "times_s_by_rank": [p["times_s"] for p in per]}
  return merged


def run(spec: dict, out_path: str) -> dict:
  """Launches the ranks, waits (bounded), merges their reports. Returns the merged dict."""
  try:
    import torch
    import torch.multiprocessing as mp
  except ImportError as e:
    return {"skipped": f"torch is not installed ({e})"}
  if spec["device"] == "cuda":
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
      return {"skipped": "torch sees no CUDA device"}
    world = torch.cuda.device_count()
  else:
    world = int(spec["world"])
  for k, v in _NCCL_ENV.items():
    os.environ.setdefault(k, v)
  port = _free_port()
  ctx = mp.start_processes(_rank_main, args=(world, port, spec, out_path), nprocs=world,
                           join=False, start_method="spawn")
  deadline = time.monotonic() + float(spec.get("timeout_s", 600))
  error = None
  try:
    while not ctx.join(timeout=1.0):
      if time.monotonic() > deadline:
        error = f"timed out after {spec.get('timeout_s', 600)} s"
        break
  except Exception as e:  # noqa: BLE001 - a rank raised: record, stop the others
    error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
  if error:
    for p in ctx.processes:
      if p.is_alive():
        p.terminate()
    for p in ctx.processes:
      p.join(10)
      if p.is_alive():
        p.kill()
  merged = _merge(spec, out_path, world, error)
  if error:
    merged["error"] = error
  return merged


def main(argv: list[str]) -> int:
  if len(argv) != 3:
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2
  with open(argv[1]) as f:
    spec = json.load(f)
  merged = run(spec, argv[2])
  with open(argv[2], "w") as f:
    json.dump(merged, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
