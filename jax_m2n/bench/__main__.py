"""`python -m jax_m2n.bench`: jax_m2n's benchmarks (docs/bench_reference.md, "Method").

Usage:
  python -m jax_m2n.bench                                   # refit,colocated,planner
  python -m jax_m2n.bench --suite smoke                     # CI: tiny, < 1 minute
  python -m jax_m2n.bench --suite refit,colocated,model,planner --size_mib 1024 \
      --engines m2n_hierarchical,device_put,torch_gather_bcast --out_dir /tmp/bench
  scripts/gpu_bench.sh [OUT_DIR]                            # the multi-GPU run

Suites: smoke, refit (cross-device-set refits: 2 -> 2 replicated, 1 -> 3, dim0 -> dim1, a
64-leaf pytree), colocated (layout changes on 4 devices, inside jit too), model (Llama- and
MoE-shaped pytrees, FSDP/EP -> TP x DP on other devices), emulated (8 CPU devices in
emulated NVLink domains of 2), planner (planning a DeepSeek-V3-sized refit, no devices;
with --planner_scale, the default, also the 4,096-device one in a fresh process),
multiprocess (2-4 processes x 1 GPU under jax.distributed, spawned by the bench, beside
torch.distributed, and over NCCL's socket transport: jax_m2n/bench/multiprocess.py;
without 2 GPUs, CPU processes on loopback: bench/multiprocess_cpu.py), network (CPU
processes each on its own emulated host behind a --link_rate link, root only:
bench/network.py),
fig4 (the paper's Figure 4 in miniature on the emulated network: bench/fig4.py), memory
(RSS over distinct eager layouts against a plain-JAX control: bench/memory.py), dtype
(fp32 -> bf16 in flight against casting first: bench/dtype.py), quantize (FP8 values +
scales in flight against device_put + qwix.quantize: bench/quantize.py), jobs
(Publisher.publish + Subscriber.pull between two programs, every data path side by
side against the transports' raw fetches and one copy in one process; a latency table,
security rows, emulated hosts, relays: bench/jobs.py), delta (Subscriber.pull(delta=True) against
full pulls on examples/rl_refit.py's training: bench/delta.py), scale (the host cost of
one eager reshard of an 856-leaf DeepSeek-V3-shaped pytree at --devices CPU devices, each
count in a fresh process, against jax.device_put: bench/scale.py).
Engines: m2n_{hierarchical,flat,gather_bcast} (eager), m2n_jit_{...} (inside jit),
jit_identity (XLA), device_put, numpy_copy (CPU), torch_gather_bcast (GPUs, torch).

Every case is validated bitwise against numpy before it is timed; then --warmup warm-ups
and --iters timed calls; the table prints mean/min/median, the planner's data-movement
bound and route estimate, and mean/bound. Writes OUT_DIR/results.json ("schema": 1, every
raw time and the environment), OUT_DIR/results.md and OUT_DIR/<suite>.png.
Exit status: 0 when every case validated and ran (and for --help); 1 when a case failed
or was wrong (never because of timing); 2 for bad flags (one line on stderr).
`--iters 1 --warmup 0` gives a quick look (a benchmark worth keeping uses the defaults).

Without a GPU (no /dev/nvidiactl) and without JAX_PLATFORMS set, runs on CPU with 8 host
devices (`jax.config.update("jax_num_cpu_devices", 8)`, before JAX starts its backend;
an explicit --xla_force_host_platform_device_count in XLA_FLAGS wins).
"""

import glob
import os
import signal
import sys


CPU_DEVICES = 8


def _default_to_cpu_devices() -> None:
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  if (os.environ.get("JAX_PLATFORMS") == "cpu"
      and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
    import jax  # importing starts no backend; the first jax.devices() does
    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)


_default_to_cpu_devices()

# pylint: disable=wrong-import-position
import time  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from jax_m2n.bench import data as bench_data  # noqa: E402
from jax_m2n.bench import engines as bench_engines  # noqa: E402
from jax_m2n.bench import suites  # noqa: E402

_SUITE = flags.DEFINE_list(
    "suite", ["refit", "colocated", "planner"],
    f"Comma list of suites to run, from {', '.join(suites.SUITES)}.")
_ENGINES = flags.DEFINE_list(
    "engines", ["all"],
    f"Comma list of engines ('all', or from {', '.join(bench_engines.ENGINE_NAMES)}); "
    "engines that do not apply to a case (jit engines on cross-device-set cases) are "
    "left out of it.")
_SIZE_MIB = flags.DEFINE_float(
    "size_mib", None, "Bytes of each single-array case, MiB (default: 1024 on GPU, 64 on "
    "CPU); the refit pytree is twice this.", lower_bound=1e-3)
_MODEL_MIB = flags.DEFINE_float(
    "model_mib", None, "Bytes of each model-suite pytree, MiB (default: 4096 on GPU, 128 "
    "on CPU; a real Llama-3-8B is 15316).", lower_bound=1e-3)
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per (case, engine); fewer than 10 "
                              "only for a quick look.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Warm-up calls per (case, engine), after the "
                               "validating first call.", lower_bound=0)
_OUT_DIR = flags.DEFINE_string("out_dir", "bench_out", "Where results.json, results.md "
                               "and the PNG plots go (created).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(bench_data.DTYPES),
                           "Element type of the single-array and model cases.")
_DTYPE_TARGET = flags.DEFINE_enum(
    "dtype_target", "bfloat16", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"],
    "dtype suite: the type float32 is converted to.")
_LINK_GBPS = flags.DEFINE_float(
    "link_gbps", None, "Per-device one-way bandwidth for the bound, GB/s (default: 391 on "
    "GPU, measured numpy copy bandwidth on CPU).", lower_bound=1e-6)
_PLANNER_COLD_REPS = flags.DEFINE_integer(
    "planner_cold_reps", 3, "Cold planning repetitions (caches cleared each time).",
    lower_bound=1)
_PLANNER_SCALE = flags.DEFINE_boolean(
    "planner_scale", True, "With the planner suite, also plan the 4,096-device refit "
    "(suites.PLANNER_4096) once, cold, in a fresh process: time, CPU time and peak memory (about "
    "5 s of CPU and 1.2 GB).")
_TORCH_TIMEOUT_S = flags.DEFINE_float(
    "torch_timeout_s", 600.0, "Bound on the whole torch.distributed launch, seconds.",
    lower_bound=10.0)
_TORCH_DEVICE = flags.DEFINE_enum(
    "torch_device", "auto", ["auto", "cpu"],
    "auto: the torch engine runs on GPUs (NCCL) when there are any; cpu: on host "
    "processes with gloo (tests the torch engine without GPUs).")
_PLOTS = flags.DEFINE_boolean("plots", True, "Write PNG plots.")
_LINK_RATE = flags.DEFINE_string(
    "link_rate", "1gbit", "network and jobs suites: each emulated host's link speed, each "
    "way (tc rate: '1gbit', '100mbit'); the jobs suite also runs on 127.0.0.1.")
_MEMORY_LAYOUTS = flags.DEFINE_list(
    "memory_layouts", ["1000", "8000"], "memory suite: RSS checkpoints, in distinct "
    "layouts (the growth between the first and the last is reported).")
_SCALE_DEVICES = flags.DEFINE_list(
    "devices", ["8", "64", "256"], "scale suite: device counts (multiples of 8), one "
    "fresh process each.")
_SCALE_LEAVES = flags.DEFINE_list(
    "leaves", ["16", "58", "72", "114", "856"], "scale suite: the leaves sweep (14 * "
    "layers + 2 each) at --leaves_devices devices.")
_SCALE_LEAVES_DEVICES = flags.DEFINE_integer(
    "leaves_devices", 32, "scale suite: the device count of the leaves sweep.")
_SCALE_CASE = flags.DEFINE_list(
    "case", ["model"], "scale suite: model (CPU devices) and/or one_device_bf16 (the "
    "float32 -> bfloat16 refit on one device, e.g. one GPU).")


class _BadFlags(Exception):
  """A bad command line: one line on stderr, exit status 2."""


def _check_choices(name: str, values, choices) -> None:
  bad = [v for v in values if v not in choices]
  if bad or not values:
    raise _BadFlags(f"--{name} must be a comma list from {', '.join(choices)}; got "
                    f"{','.join(values) or '(empty)'}.")


def _guess_gpu_count() -> int:
  """GPUs this process will see, without starting CUDA (torch runs before JAX)."""
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    return 0
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def _terminate(signum, frame):
  """SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so child process groups get killed."""
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv) -> int:
  try:
    return _main(argv)
  except _BadFlags as e:
    _bad_flags(str(e))
    return 2


def _bad_flags(message: str) -> None:
  print(f"jax_m2n.bench: error: {message} (--help for every flag)", file=sys.stderr)


def _main(argv) -> int:
  signal.signal(signal.SIGTERM, _terminate)
  if len(argv) > 1:
    raise _BadFlags(f"unexpected arguments: {' '.join(argv[1:])}")
  chosen_suites = list(dict.fromkeys(s.strip() for s in _SUITE.value))
  _check_choices("suite", chosen_suites, suites.SUITES)
  chosen_engines = list(dict.fromkeys(e.strip() for e in _ENGINES.value))
  if chosen_engines != ["all"]:
    _check_choices("engines", chosen_engines, bench_engines.ENGINE_NAMES)
  engines = [e for e in bench_engines.all_engines()
             if chosen_engines == ["all"] or e.name in chosen_engines]

  from jax_m2n.bench import plots, report, runner, timing

  console, progress_display = _ui()
  out_dir = _OUT_DIR.value
  os.makedirs(out_dir, exist_ok=True)
  mp_rc = 0
  if "multiprocess" in chosen_suites:  # its own processes, before this one takes the GPUs
    from jax_m2n.bench import multiprocess
    mp_rc = multiprocess.run_suite(out_dir, _SIZE_MIB.value or 1024, _ITERS.value,
                                   _WARMUP.value, echo=console.print)
    chosen_suites.remove("multiprocess")
    if not chosen_suites:
      return mp_rc
  if "network" in chosen_suites:  # CPU processes on emulated hosts (bench/network.py)
    from jax_m2n.bench import network
    mp_rc = network.run_suite(out_dir, _SIZE_MIB.value or 64, _ITERS.value,
                              _WARMUP.value, _LINK_RATE.value, echo=console.print) or mp_rc
    chosen_suites.remove("network")
    if not chosen_suites:
      return mp_rc
  if "fig4" in chosen_suites:  # its own table, plot and fig4.json (bench/fig4.py)
    import jax
    from jax_m2n.bench import fig4
    fig4_size = int((_SIZE_MIB.value or fig4.DEFAULT_SIZE_MIB) * suites.MIB)
    rc = fig4.main(jax, out_dir, fig4_size, _ITERS.value, _WARMUP.value,
                   lambda text: console.print(text, highlight=False, markup=False),
                   _PLOTS.value)
    chosen_suites.remove("fig4")
    if not chosen_suites or rc:
      return rc or mp_rc
  if "memory" in chosen_suites:  # RSS over distinct layouts vs plain JAX (bench/memory.py)
    from jax_m2n.bench import memory
    memory.main(out_dir, [int(v) for v in _MEMORY_LAYOUTS.value],
                lambda text: console.print(text, highlight=False, markup=False))
    chosen_suites.remove("memory")
    if not chosen_suites:
      return mp_rc
  if "scale" in chosen_suites:  # host cost at 8-256 devices, a process each (bench/scale.py)
    from jax_m2n.bench import scale
    mp_rc = scale.run_suite(
        out_dir, [int(v) for v in _SCALE_DEVICES.value], [int(v) for v in _SCALE_LEAVES.value],
        _SCALE_LEAVES_DEVICES.value, _SCALE_CASE.value, max(5, _ITERS.value // 2),
        echo=lambda text: console.print(text, highlight=False, markup=False)) or mp_rc
    chosen_suites.remove("scale")
    if not chosen_suites:
      return mp_rc
  if "dtype" in chosen_suites:  # fp32 -> bf16 in flight vs cast first (bench/dtype.py)
    import jax
    from jax_m2n.bench import dtype as dtype_suite
    dtype_suite.main(jax, out_dir, int((_SIZE_MIB.value or dtype_suite.DEFAULT_SIZE_MIB)
                                       * suites.MIB), _ITERS.value, _WARMUP.value,
                     lambda text: console.print(text, highlight=False, markup=False),
                     target=_DTYPE_TARGET.value)
    chosen_suites.remove("dtype")
    if not chosen_suites:
      return mp_rc
  if "jobs" in chosen_suites:  # Publisher/Subscriber between programs vs raw transfers
    import jax
    from jax_m2n.bench import jobs as jobs_suite
    jobs_suite.main(jax, out_dir, _SIZE_MIB.value, _ITERS.value, _WARMUP.value,
                    lambda text: console.print(text, highlight=False, markup=False),
                    link_rate=_LINK_RATE.value)
    chosen_suites.remove("jobs")
    if not chosen_suites:
      return mp_rc
  if "delta" in chosen_suites:  # delta sync vs full pulls on rl_refit's training
    from jax_m2n.bench import delta as delta_suite
    delta_suite.main(out_dir, lambda text: console.print(text, highlight=False,
                                                         markup=False))
    chosen_suites.remove("delta")
    if not chosen_suites:
      return mp_rc
  if "quantize" in chosen_suites:  # FP8 + scales in flight vs device_put + qwix
    import jax
    from jax_m2n.bench import quantize as quantize_suite
    quantize_suite.main(jax, out_dir, _SIZE_MIB.value, _ITERS.value, _WARMUP.value,
                        lambda text: console.print(text, highlight=False, markup=False))
    chosen_suites.remove("quantize")
    if not chosen_suites:
      return mp_rc
  json_path = os.path.join(out_dir, "results.json")
  move_suites = [s for s in chosen_suites if s != "planner"]
  use_torch = any(isinstance(e, bench_engines.TorchGatherBcast) for e in engines) and \
      bool(move_suites)

  def sizes(on_gpu: bool) -> tuple[int, int]:
    size = _SIZE_MIB.value or (1024 if on_gpu else 64)
    model = _MODEL_MIB.value or (4096 if on_gpu else 128)
    return int(size * suites.MIB), int(model * suites.MIB)

  settings = runner.Settings(
      suites=tuple(chosen_suites), engines=tuple(e.name for e in engines),
      size_bytes=0, model_bytes=0, dtype=_DTYPE.value, iters=_ITERS.value,
      warmup=_WARMUP.value, planner_cold_reps=_PLANNER_COLD_REPS.value,
      link_gbps=_LINK_GBPS.value, torch_timeout_s=_TORCH_TIMEOUT_S.value)

  # torch.distributed first, in its own processes, before JAX claims the GPUs.
  torch_result = None
  if use_torch:
    gpus = _guess_gpu_count()
    if _TORCH_DEVICE.value == "cpu" or gpus > 0:
      on_gpu = _TORCH_DEVICE.value != "cpu"
      size, model = sizes(on_gpu)
      world = gpus if on_gpu else 8
      tcases = suites.build_cases(move_suites, size, model, settings.dtype, world)
      console.print(f"torch.distributed engine: {len(tcases)} cases on {world} "
                    f"{'GPUs (NCCL)' if on_gpu else 'host processes (gloo)'} ...")
      t0 = time.perf_counter()
      torch_result = runner.run_torch(tcases, settings, "cuda" if on_gpu else "cpu",
                                      world)
      console.print(f"torch.distributed engine: done in {time.perf_counter() - t0:.1f} s"
                    + (f" ({torch_result.get('skipped') or torch_result.get('error')})"
                       if torch_result.get("skipped") or torch_result.get("error") else ""))

  import jax
  devices = jax.devices()
  platform = devices[0].platform
  on_gpu = platform == "gpu"
  settings.size_bytes, settings.model_bytes = sizes(on_gpu)
  env = runner.environment(jax)
  if settings.link_gbps is not None:
    link = {"gbps": settings.link_gbps, "source": "--link_gbps"}
  elif on_gpu:
    link = {"gbps": runner.GPU_LINK_GBPS,
            "source": "measured H200 NVLink one-way (PyTorch copy_, 1 GiB)"}
  else:
    m = timing.memcpy_gbps()
    link = {"gbps": m["best_gbps"], "source": "numpy copy bandwidth measured now (best "
            f"of {m['reps']} x {m['bytes'] >> 20} MiB)", "memcpy": m}
  cases = suites.build_cases(move_suites, settings.size_bytes, settings.model_bytes,
                             settings.dtype, len(devices))
  if torch_result is not None and _TORCH_DEVICE.value == "cpu":
    # The gloo run stands in for the GPU engine: let its rows through on CPU.
    bench_engines.TorchGatherBcast.skip_reason = lambda self, case, platform: None

  rows: list[dict] = []
  planner_result = None
  torch_info = torch_result  # kept whole: its raw times survive a run killed later

  md_path = os.path.join(out_dir, "results.md")

  def save():
    doc = report.document(_settings_json(settings), env, link, rows, planner_result,
                          torch_info)
    report.write_json(doc, json_path)  # after every result: a killed run keeps its rows
    report.write_text(report.markdown(doc), md_path)
    return doc

  total = sum(1 for c in cases for e in engines if e.applies(c))
  planner_models = [m for s, m in (("smoke", suites.SMOKE_PLANNER),
                                   ("planner", suites.PlannerModel()))
                    if s in chosen_suites]
  scale_models = ([suites.PLANNER_4096] if "planner" in chosen_suites
                  and _PLANNER_SCALE.value else [])
  total += len(planner_models) + len(scale_models)
  console.print(f"jax_m2n bench: {len(devices)} x {devices[0].device_kind} ({platform}); "
                f"suites {','.join(chosen_suites)}; link {link['gbps']:.4g} GB/s; "
                f"out {out_dir}")
  with progress_display() as progress:
    task = progress.add_task("starting", total=total)

    def on_row(row: dict) -> None:
      rows.append(row)
      progress.advance(task)
      if row["status"] == "ok":
        extra = f"{row['mean_ms']:.4g} ms"
        if row.get("bound_ms"):
          extra += f" (bound {row['bound_ms']:.3g} ms, x{row['mean_ms'] / row['bound_ms']:.3g})"
      else:
        extra = f"{row['status']}: {row['reason']}"
      progress.console.print(f"  {row['suite']}/{row['case']} {row['engine']}: {extra}",
                             highlight=False, markup=False)
      save()

    def on_step(text: str) -> None:
      progress.update(task, description=text)

    for suite in chosen_suites:  # in the order asked for
      suite_cases = [c for c in cases if c.suite == suite]
      if suite_cases:
        runner.run_cases(jax, suite_cases, engines, settings, link["gbps"], torch_result,
                         on_row, on_step)
      model = {"smoke": suites.SMOKE_PLANNER, "planner": suites.PlannerModel()}.get(suite)
      if model is None:
        continue
      on_step(f"{suite}/{model.name}: planning cold x{settings.planner_cold_reps}, fresh "
              f"process, cached x{settings.iters}")
      try:
        result = suites.run_planner(model, settings.iters, settings.planner_cold_reps)
        if suite == "planner":
          planner_result = result
        for row in runner.planner_rows(result, model):
          row["suite"] = suite
          rows.append(row)
          progress.console.print(f"  {suite}/{model.name} {row['engine']}: "
                                 f"{row['mean_ms']:.4g} ms", highlight=False, markup=False)
      except Exception as e:  # noqa: BLE001 - reported like any failed case
        rows.append(runner.planner_failed_row(suite, model.name, e))
      progress.advance(task)
      save()
      for big in scale_models if suite == "planner" else []:
        on_step(f"{suite}/{big.name}: planning {big.devices} devices cold, fresh process")
        try:
          result = suites.run_planner_scale(big)
          d = result["details"]
          for row in runner.planner_rows(result, big):
            row["suite"] = suite
            row["details"] = d
            rows.append(row)
            progress.console.print(
                f"  {suite}/{big.name} {row['engine']}: {row['mean_ms']:.4g} ms "
                f"({d['transfers']} transfers, planning {d['plan_cpu_s']:.3g} s of CPU, "
                f"peak RSS {d['max_rss_bytes'] / 2**30:.2f} "
                f"GiB, {d['rss_bytes_per_transfer']:.0f} B per transfer)",
                highlight=False, markup=False)
        except Exception as e:  # noqa: BLE001 - reported like any failed case
          rows.append(runner.planner_failed_row(suite, big.name, e))
        progress.advance(task)
        save()

  env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
  doc = save()
  written = []
  if _PLOTS.value:
    try:
      written = plots.write_all(rows, out_dir, f"({env.get('device_count')} x "
                                f"{env.get('device_kind')})")
    except ImportError as e:
      console.print(f"plots: not written ({e}); draw them elsewhere with "
                    f"`python -m jax_m2n.bench.plots {json_path}`")
    except Exception as e:  # noqa: BLE001 - plots never fail a run
      console.print(f"plots: not written ({runner._error_text(e)})")  # noqa: SLF001
  report.print_tables(doc, console)
  console.print(f"wrote {json_path}, {md_path}"
                + (", " + ", ".join(written) if written else ""), highlight=False)
  bad = [r for r in rows if r["status"] in ("failed", "invalid")]
  if bad:
    console.print(f"{len(bad)} result(s) failed or were not bitwise equal (see above).",
                  style="bold red")
    return 1
  return mp_rc


class _PlainConsole:
  """print() with rich's Console.print signature (rich is optional: not on every GPU host)."""

  is_terminal = False

  def print(self, *objects, **_):
    print(*objects, flush=True)


class _PlainProgress:
  def __init__(self, console):
    self.console = console

  def __enter__(self):
    return self

  def __exit__(self, *_):
    return False

  def add_task(self, *_, **__):
    return 0

  def advance(self, *_):
    pass

  def update(self, *_, **__):
    pass


def _ui():
  """(console, progress factory): rich when installed, plain lines otherwise."""
  try:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)
  except ImportError:
    console = _PlainConsole()
    return console, lambda: _PlainProgress(console)
  console = Console()
  if not console.is_terminal:  # logs and CI: wide enough for the tables
    console = Console(width=200)
  columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
             TimeElapsedColumn())
  return console, lambda: Progress(*columns, console=console, transient=True)


def _settings_json(settings) -> dict:
  import dataclasses
  return dataclasses.asdict(settings)


def _run(argv) -> None:
  sys.exit(main(argv))


_HELP = ("--help", "-help", "-h", "--helpshort", "--helpfull", "-?")


def _parse_flags(argv):
  """absl's parsing with the exit statuses this module documents: --help prints the
  usage and every flag and exits 0; a bad flag is one line and exit status 2."""
  if any(a in _HELP for a in argv[1:]):
    print(__doc__)
    print(flags.FLAGS.main_module_help())
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _bad_flags(str(e).splitlines()[0] if str(e) else type(e).__name__)
    sys.exit(2)


if __name__ == "__main__":
  app.run(_run, flags_parser=_parse_flags)
