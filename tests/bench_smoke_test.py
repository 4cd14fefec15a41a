"""The benchmark harness (jax_m2n/bench): the smoke suite end to end, and its pure parts.

Runs `python -m jax_m2n.bench --suite smoke` in a subprocess on 8 CPU devices and
checks that every case validated bitwise and that results.json (schema 1) and results.md
were written. Never asserts anything about timing: benchmarks do not fail on a slow machine.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax_m2n
from jax_m2n.bench import data as bench_data
from jax_m2n.bench import report
from jax_m2n.bench import suites


def _env() -> dict:
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(jax_m2n.__file__)))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in sys.path if p])
  env["JAX_PLATFORMS"] = "cpu"  # the bench sets 8 host devices itself
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  return env


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench_smoke")
  proc = subprocess.run(
      [sys.executable, "-m", "jax_m2n.bench", "--suite", "smoke", "--out_dir", str(out)],
      capture_output=True, text=True, env=_env(), timeout=600, check=False)
  return proc, out


def test_smoke_validates_and_writes_json_and_markdown(smoke_run):
  proc, out = smoke_run
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
  with open(out / "results.json") as f:
    doc = json.load(f)
  assert doc["schema"] == 1
  env = doc["environment"]
  assert env["device_count"] == 8 and env["platform"] == "cpu"
  assert env["versions"]["jax"] and env["command"].endswith(f"--out_dir {out}")
  moves = [r for r in doc["results"] if r["kind"] == "move"]
  cases = {r["case"] for r in moves}
  assert {"2to2_replicate", "1to3_replicate", "pytree_mixed", "4dev_dim0_to_dim1"} <= cases
  engines = {r["engine"] for r in moves if r["status"] == "ok"}
  assert {"m2n_hierarchical", "m2n_flat", "m2n_gather_bcast", "m2n_jit_hierarchical",
          "jit_identity", "device_put", "numpy_copy"} <= engines
  for r in moves:
    assert r["status"] in ("ok", "skipped"), (r["case"], r["engine"], r["reason"])
    if r["status"] == "ok":
      assert r["validated"] is True
      assert len(r["times_s"]) >= 10 and len(r["warmup_s"]) >= 3
      assert r["bound_ms"] > 0 and r["mean_ms"] > 0
  skipped = {r["engine"] for r in moves if r["status"] == "skipped"}
  assert skipped <= {"torch_gather_bcast"}
  plans = [r for r in doc["results"] if r["kind"] == "planner"]
  assert {r["engine"] for r in plans} >= {"plan_cold", "plan_cached"}
  md = (out / "results.md").read_text()
  assert "## smoke" in md and "| 2to2_replicate | m2n_hierarchical |" in md


def test_smoke_plots(smoke_run):
  pytest.importorskip("matplotlib")
  _, out = smoke_run
  assert (out / "smoke.png").stat().st_size > 10_000


def _bench(args, tmp_path):
  return subprocess.run([sys.executable, "-m", "jax_m2n.bench", *args, "--out_dir",
                         str(tmp_path)], capture_output=True, text=True, env=_env(),
                        timeout=300, check=False)


@pytest.mark.parametrize("args, word", [
    (["--suite", "nope"], "--suite must be a comma list"),
    (["--bogus"], "Unknown command line flag 'bogus'"),
    (["--iters", "0"], "--iters=0"),
    (["--warmup", "-1"], "--warmup=-1"),
    (["extra"], "unexpected arguments: extra"),
])
def test_bad_flags_one_line_exit_2(args, word, tmp_path):
  proc = _bench(args, tmp_path)
  assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and word in proc.stderr, proc.stderr


def test_help_exits_0(tmp_path):
  proc = _bench(["--help"], tmp_path)
  assert proc.returncode == 0 and "--iters" in proc.stdout and "Usage:" in proc.stdout


def test_quick_look_iters_1_warmup_0(tmp_path):
  proc = _bench(["--suite", "planner", "--iters", "1", "--warmup", "0",
                 "--planner_cold_reps", "1", "--noplanner_scale", "--noplots"], tmp_path)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["settings"]["iters"] == 1 and doc["settings"]["warmup"] == 0
  assert doc["environment"]["device_count"] == 8  # jax_num_cpu_devices, no XLA_FLAGS


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "int8"])
def test_data_is_deterministic_finite_and_normal(dtype):
  a = bench_data.make_array((64, 33), dtype, 7)
  b = bench_data.make_array((64, 33), dtype, 7)
  assert bench_data.same_bits(a, b)
  assert not bench_data.same_bits(a, bench_data.make_array((64, 33), dtype, 8))
  if a.dtype.kind == "f" or dtype == "bfloat16":
    import ml_dtypes
    f = a.astype(np.float64)
    tiny = float(ml_dtypes.finfo(a.dtype).tiny)
    assert np.isfinite(f).all() and (np.abs(f) >= tiny).all()
  c = a.copy()
  c[3, 5] = c[3, 4]
  assert "1 of 2112 elements differ; first at (3, 5)" in bench_data.describe_mismatch(c, a)


def test_cases_tile_and_fit_their_devices():
  from jax_m2n._src.layout import parse_layout
  cases = suites.build_cases(["smoke", "refit", "colocated", "model", "emulated"],
                             8 << 20, 64 << 20, "bfloat16", 8)
  assert len({c.key for c in cases}) == len(cases)
  for c in cases:
    assert c.devices_needed <= 8, c.key
    for t in c.tensors:
      for text in (t.src, t.dst):
        parse_layout(text, t.shape).validate()
  llama = next(c for c in cases if c.name.startswith("llama"))
  assert len(llama.tensors) == 291
  assert 0.8 < llama.payload_bytes / (64 << 20) < 1.25


def test_planner_model_shapes():
  stages = suites.PlannerModel().descriptors()
  assert len(stages) == 8 and sum(len(s) for s in stages) == 61 * 17 + 3
  names = [n for s in stages for n, *_ in s]
  assert "layers.60.mlp.experts.down_proj" in names and names[0] == "embed_tokens"


def test_cpu_requirement_ratios():
  def row(engine, ms):
    return {"suite": "refit", "kind": "move", "case": "c", "engine": engine,
            "status": "ok", "mean_ms": ms, "payload_bytes": 1 << 20, "layout_change": True}
  req = report.cpu_requirement([row("m2n_hierarchical", 3.0), row("m2n_flat", 2.0),
                                row("numpy_copy", 2.0), row("device_put", 4.0)])
  assert len(req) == 1
  r = req[0]
  assert r["vs_numpy"] == 1.5 and r["meets_numpy"] and r["meets_device_put"]
  assert r["best_route"] == "flat"


def test_fig4_smoke(tmp_path):
  """`--suite fig4` in its CI form: tiny payload, every case and route validated, the
  table, JSON and plot written. No timing assertions."""
  proc = subprocess.run(
      [sys.executable, "-m", "jax_m2n.bench", "--suite", "fig4", "--size_mib", "0.25",
       "--out_dir", str(tmp_path)], capture_output=True, text=True, env=_env(),
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
  with open(tmp_path / "fig4.json") as f:
    doc = json.load(f)
  assert doc["schema"] == 1 and doc["suite"] == "fig4"
  rows = doc["results"]
  assert {(r["case"], r["route"]) for r in rows} == {
      (c, r) for c in ("rd1", "rd2", "rd3", "rd4_colocated")
      for r in ("hierarchical", "flat", "gather_bcast")}
  for r in rows:
    assert r["status"] == "ok", r
    assert r["estimate_ms"] > 0 and r["median_ms"] > 0 and len(r["times_s"]) >= 10
    assert "measured_over_hier" in r and "estimate_over_hier" in r
  assert "| rd3 | 3 | flat |" in (tmp_path / "fig4.md").read_text()
  if (tmp_path / "fig4.png").exists():
    assert (tmp_path / "fig4.png").stat().st_size > 10_000
