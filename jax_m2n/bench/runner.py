"""The runner: makes cases concrete on devices, runs engines through the timing loop.

Owns the order of a run (torch.distributed first, in its own processes, before JAX claims
the GPUs; then each case: reference data, source arrays, the planner's bound and route
estimates, then every engine: validate bitwise, warm up, time), the result records, and
the environment record. Never formats output (report.py, plots.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform as py_platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

from jax_m2n.bench import data as bench_data
from jax_m2n.bench import engines as bench_engines
from jax_m2n.bench import suites
from jax_m2n.bench import timing

SCHEMA = 1
# Measured one-way NVLink bandwidth per H200 (PyTorch copy_, 1 GiB; docs/bench_reference.md,
# "Method").
GPU_LINK_GBPS = 391.0


@dataclasses.dataclass
class Settings:
  """What a run was asked for (from the flags)."""

  suites: tuple[str, ...]
  engines: tuple[str, ...]
  size_bytes: int
  model_bytes: int
  dtype: str
  iters: int
  warmup: int
  planner_cold_reps: int = 3
  link_gbps: float | None = None
  torch_timeout_s: float = 600.0


def _error_text(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  return text if len(text) <= limit else text[:limit] + " ..."


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(args: Sequence[str]) -> str | None:
  import jax_m2n
  for where in (os.getcwd(), os.path.dirname(os.path.abspath(jax_m2n.__file__))):
    try:
      out = subprocess.run(["git", "-C", where, *args], capture_output=True, text=True,
                           timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
      return None
    if out.returncode == 0:
      return out.stdout.strip()
  return None


def environment(jax_mod=None) -> dict:
  """The machine and software a run used (JSON-ready)."""
  env = {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": " ".join([os.path.basename(sys.executable), "-m", "jax_m2n.bench",
                           *sys.argv[1:]]),
      "argv": list(sys.argv),
      "hostname": py_platform.node(),
      "python": sys.version.split()[0],
      "cpu_count": os.cpu_count(),
      "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
      "versions": {k: _version(k) for k in ("jax", "jaxlib", "jax-cuda13-plugin",
                                            "jax-cuda12-plugin", "numpy", "ml_dtypes",
                                            "torch", "nvidia-nccl-cu13", "jax_m2n")},
      "git_commit": os.environ.get("JAX_M2N_BENCH_COMMIT") or _git(["rev-parse", "HEAD"]),
      "git_dirty": None,
      "env": {k: v for k, v in os.environ.items()
              if k.startswith(("XLA_", "JAX_", "NCCL_", "CUDA_VISIBLE", "TORCH_SYMM",
                               "NVSHMEM_"))},
  }
  status = _git(["status", "--porcelain", "--untracked-files=no"])
  env["git_dirty"] = None if status is None else bool(status)
  import jax_m2n
  env["jax_m2n_file"] = jax_m2n.__file__
  if jax_mod is not None:
    devs = jax_mod.devices()
    env["platform"] = devs[0].platform
    env["device_kind"] = devs[0].device_kind
    env["device_count"] = len(devs)
    env["process_count"] = jax_mod.process_count()
    if devs[0].platform == "gpu":
      try:
        from jax_m2n import _ffi_cuda
        v = _ffi_cuda.nccl_version()
        env["nccl_version"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
      except Exception as e:  # noqa: BLE001 - informational
        env["nccl_version"] = f"unknown ({_error_text(e, 200)})"
  return env


# ---------------------------------------------------------------------------------------
# Concrete inputs
# ---------------------------------------------------------------------------------------

class _Meshes:
  """jax Meshes of the layout descriptors (one object per (axes, first): equal meshes)."""

  def __init__(self, jax_mod):
    self.jax = jax_mod
    self.devices = jax_mod.devices()
    self.cache: dict = {}

  def sharding(self, text: str):
    from jax.sharding import Mesh, NamedSharding
    from jax_m2n._src.layout import parse_mesh_spec
    m = parse_mesh_spec(text)
    key = (m.axes, m.first)
    mesh = self.cache.get(key)
    if mesh is None:
      devs = np.array(self.devices[m.first:m.first + m.size], dtype=object)
      mesh = Mesh(devs.reshape([s for _, s in m.axes]), tuple(n for n, _ in m.axes))
      self.cache[key] = mesh
    return NamedSharding(mesh, m.jax_spec())


def make_inputs(case: suites.Case, meshes: _Meshes, platform: str) -> bench_engines.Inputs:
  jax = meshes.jax
  reference, xs, srcs, dsts = [], [], [], []
  for t in case.tensors:
    value = bench_data.make_array(t.shape, t.dtype, bench_data.seed_of(case.key, t.name))
    src, dst = meshes.sharding(t.src), meshes.sharding(t.dst)
    reference.append(value)
    srcs.append(src)
    dsts.append(dst)
    xs.append(jax.device_put(value, src))
  jax.block_until_ready(xs)
  inputs = bench_engines.Inputs(case, reference, xs, srcs, dsts, platform)
  copy = jax.jit(lambda t: [a.copy() for a in t])  # a real XLA copy: new buffers

  def refresh():
    old = inputs.x
    inputs.x = jax.block_until_ready(copy(old))
    for a in old:
      a.delete()

  inputs.refresh = refresh
  return inputs


def bound_of(inputs: bench_engines.Inputs, link_gbps: float) -> dict:
  """The data-movement bound and every route's estimate, from the real shardings."""
  from jax_m2n._src.layout import Layout, box_size, intersect
  from jax_m2n._src.planner import plan_reshard
  from jax_m2n._src.topology import Topology
  shapes = [r.shape for r in inputs.reference]
  src = [Layout.from_sharding(s, shape) for s, shape in zip(inputs.src, shapes)]
  dst = [Layout.from_sharding(s, shape) for s, shape in zip(inputs.dst, shapes)]
  # Emulated domains have no real network: every link is given the same bandwidth, so
  # the bound is the one-domain bound and the estimates show each route's extra bytes.
  topo = Topology(domain_size=inputs.case.domain_size, nvlink_gbps=link_gbps,
                  nic_gbps=link_gbps)
  plan = plan_reshard(src, dst, [r.dtype.itemsize for r in inputs.reference], topo)
  received = 0  # bytes the destination devices do not already hold
  for tp in plan.tensors:
    for box, holders in tp.dst.shards():
      for d in holders:
        held = tp.src.box_of(d)
        own = intersect(held, box) if held is not None else None
        received += (box_size(box) - (box_size(own) if own else 0)) * tp.itemsize
  return {"sol_ms": plan.sol_ms, "estimate_ms": dict(plan.estimate_ms),
          "received_bytes": received, "bytes_by_link": plan.bytes_by_link}


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------

def _base_row(case: suites.Case, engine: bench_engines.Engine) -> dict:
  return {"suite": case.suite, "kind": "move", "case": case.name, "title": case.title,
          "engine": engine.name, "engine_description": engine.description,
          "payload_bytes": case.payload_bytes, "leaves": len(case.tensors),
          "layout_change": case.layout_change, "colocated": case.colocated,
          "domain_size": case.domain_size, "status": None, "reason": None}


def _finish_row(row: dict, bound: dict | None, route: str | None) -> dict:
  if bound is not None:
    row["bound_ms"] = bound["sol_ms"]
    row["received_bytes"] = bound["received_bytes"]
    row["inputs_s"] = bound.get("inputs_s")
    row["estimate_ms"] = bound["estimate_ms"].get(route) if route else None
  if row.get("times_s"):
    st = timing.stats_ms(row["times_s"])
    row.update(st)
    mean_s = st["mean_ms"] / 1e3
    row["gbps"] = row["payload_bytes"] / mean_s / 1e9
    if row.get("bound_ms"):
      row["ratio_to_bound"] = st["mean_ms"] / row["bound_ms"]
      row["bound_gbps"] = row["payload_bytes"] / (row["bound_ms"] / 1e3) / 1e9
    if row.get("estimate_ms"):
      row["ratio_to_estimate"] = st["mean_ms"] / row["estimate_ms"]
  return row


def run_torch(cases: Sequence[suites.Case], settings: Settings, device: str = "cuda",
              world: int | None = None) -> dict:
  """The torch engine over `cases`, in a child process group (bounded by a timeout)."""
  spec = {"cases": [c.to_json() for c in cases], "warmup": settings.warmup,
          "iters": settings.iters, "device": device, "world": world,
          "timeout_s": settings.torch_timeout_s}
  import jax_m2n
  pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_m2n.__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
  with tempfile.TemporaryDirectory(prefix="jax_m2n_bench_torch_") as tmp:
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    proc = subprocess.Popen([sys.executable, "-m", "jax_m2n.bench.torch_engine", spec_path,
                             out_path], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
      output, _ = proc.communicate(timeout=settings.torch_timeout_s + 30)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks (our own group)
      output, _ = proc.communicate()
      return {"error": f"torch engine timed out after {settings.torch_timeout_s + 30} s",
              "output": (output or "")[-4000:]}
    except BaseException:  # interrupted: never leave ranks holding GPUs
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      raise
    try:
      with open(out_path) as f:
        result = json.load(f)
    except (OSError, ValueError):
      return {"error": f"torch engine exited {proc.returncode} without a result",
              "output": (output or "")[-4000:]}
    if proc.returncode != 0:
      result.setdefault("error", f"torch engine exited {proc.returncode}")
    result["output"] = (output or "")[-4000:]
    return result


def torch_rows(cases: Sequence[suites.Case], result: dict) -> dict[str, dict]:
  """Rows of the torch engine by case key, from run_torch's result."""
  engine = bench_engines.TorchGatherBcast()
  rows = {}
  for case in cases:
    row = _base_row(case, engine)
    if "skipped" in result:
      row.update(status="skipped", reason=result["skipped"])
    elif case.key in result.get("cases", {}):
      r = result["cases"][case.key]
      row.update(status=r["status"], reason=r.get("reason"))
      for k in ("first_s", "warmup_s", "times_s", "max_rank", "times_s_by_rank"):
        if k in r:
          row[k] = r[k]
      if r["status"] == "ok":
        row["validated"] = True
    elif result.get("error"):
      row.update(status="failed", reason=result["error"])
    else:  # the launch ran other cases (it saw another device count than JAX)
      row.update(status="skipped", reason="not among the cases of the torch launch")
    rows[case.key] = row
  return rows


def run_cases(jax_mod, cases: Sequence[suites.Case], engines: Sequence[bench_engines.Engine],
              settings: Settings, link_gbps: float, torch_result: dict | None,
              on_row: Callable[[dict], None],
              on_step: Callable[[str], None] = lambda s: None) -> None:
  """Runs every (case, engine); calls on_row with each finished result record."""
  devices = jax_mod.devices()
  platform = devices[0].platform
  meshes = _Meshes(jax_mod)
  torch_by_case = torch_rows(cases, torch_result) if torch_result is not None else {}
  for case in cases:
    chosen = [e for e in engines if e.applies(case)]
    if not chosen:
      continue
    need = case.devices_needed
    if need > len(devices):
      for e in chosen:
        row = _base_row(case, e)
        row.update(status="skipped", reason=f"needs {need} devices, have {len(devices)}")
        on_row(row)
      continue
    on_step(f"{case.key}: making inputs")
    try:
      t0 = time.perf_counter()
      inputs = make_inputs(case, meshes, platform)
      bound = bound_of(inputs, link_gbps)
      bound["inputs_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the case cannot run at all
      for eng in chosen:
        row = _base_row(case, eng)
        row.update(status="failed", reason=f"inputs: {_error_text(e)}")
        on_row(row)
      continue
    for eng in chosen:
      on_step(f"{case.key}: {eng.name}")
      if isinstance(eng, bench_engines.TorchGatherBcast) and case.key in torch_by_case:
        on_row(_finish_row(torch_by_case[case.key], bound, eng.route))
        continue
      row = _base_row(case, eng)
      reason = eng.skip_reason(case, platform)
      if reason is not None:
        row.update(status="skipped", reason=reason)
        on_row(_finish_row(row, bound, eng.route))
        continue
      t0 = time.perf_counter()
      row = run_engine(eng, inputs, settings, row)
      row["wall_s"] = time.perf_counter() - t0
      on_row(_finish_row(row, bound, eng.route))
    for x in inputs.x:
      x.delete()
    del inputs


def run_engine(eng: bench_engines.Engine, inputs: bench_engines.Inputs, settings: Settings,
               row: dict) -> dict:
  """Prepare, validate (first call), warm up and time one engine on one case."""
  try:
    t0 = time.perf_counter()
    prepared = eng.prepare(inputs)
    row["prepare_s"] = time.perf_counter() - t0
    row.update(prepared.info)
  except Exception as e:  # noqa: BLE001
    row.update(status="failed", reason=f"prepare: {_error_text(e)}")
    return row
  try:
    t0 = time.perf_counter()
    out = prepared.run()
    prepared.block(out)
    row["first_s"] = time.perf_counter() - t0
    problem = prepared.check(out)
    prepared.release(out)
    del out
  except Exception as e:  # noqa: BLE001
    row.update(status="failed", reason=f"first call: {_error_text(e)}")
    return row
  if problem is not None:
    row.update(status="invalid", reason=problem, validated=False)
    return row
  row["validated"] = True
  try:
    t = timing.time_calls(prepared.run, prepared.block, settings.warmup, settings.iters,
                          prepared.release,
                          inputs.refresh if prepared.fresh_inputs else None)
  except Exception as e:  # noqa: BLE001
    row.update(status="failed", reason=f"timed calls: {_error_text(e)}")
    return row
  row.update(status="ok", warmup_s=t.warmup_s, times_s=t.times_s)
  row.update(prepared.info)  # counters kept during the calls
  return row


def planner_failed_row(suite: str, name: str, e: BaseException) -> dict:
  """The record of a planner case that raised (reported like any failed case)."""
  return {"suite": suite, "kind": "planner", "case": name, "engine": "plan",
          "title": name, "engine_description": "plan", "payload_bytes": 0, "leaves": 0,
          "status": "failed", "reason": _error_text(e)}


def planner_rows(result: dict, model: suites.PlannerModel) -> list[dict]:
  """Result records of the planner suite (one per timed quantity)."""
  rows = []
  d = result["details"]
  for what, times in result["timings"].items():
    row = {"suite": "planner", "kind": "planner", "case": model.name, "engine": what,
           "title": (f"{d['tensors']} tensors, {model.pp} PP-stage plans, EP{model.ep}xPP"
                     f"{model.pp}" + (f"xDP{model.trainer_dp}" if model.trainer_dp > 1
                                      else "")
                     + f" -> TP{model.tp}xDP{model.dp}"
                     + (" (colocated)" if model.colocated else "")
                     + f", {model.devices} devices"),
           "engine_description": what, "payload_bytes": d["payload_bytes"],
           "leaves": d["tensors"], "status": "ok", "reason": None, "times_s": times,
           "validated": None}
    row.update(timing.stats_ms(times))
    target = result["targets_ms"].get(what)
    if target is not None:
      row["target_ms"] = target
      row["meets_target"] = row["mean_ms"] < target
    rows.append(row)
  return rows
