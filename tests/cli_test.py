"""The `python -m jax_m2n plan` contract: text, --json fields, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from jax_m2n._src.cli import main

EXAMPLE_A = ["plan", "--shape", "4,8", "--dtype", "float32",
             "--src", "mesh(dp=1, tp=4) P(tp, None) @0",
             "--dst", "mesh(dp=2, tp=2) P(tp, None) @4"]


def _run(args, capsys):
  rc = main(args)
  out = capsys.readouterr()
  return rc, out.out, out.err


def test_json_contract(capsys):
  rc, out, err = _run(EXAMPLE_A + ["--json", "--domain-size", "4"], capsys)
  assert rc == 0 and not err
  doc = json.loads(out)
  assert doc["payload_bytes"] == 128 and doc["route"] == "hierarchical"
  assert set(doc["bytes_by_link"]) == {"local", "nvlink", "network"}
  assert all(isinstance(v, int) for v in doc["bytes_by_link"].values())
  assert set(doc["estimate_ms"]) == {"hierarchical", "flat", "gather_bcast"}
  assert all(isinstance(v, float) for v in doc["estimate_ms"].values())
  assert isinstance(doc["sol_ms"], float)
  for x in doc["transfers"]:
    assert set(x) >= {"src", "dst", "stage", "box", "bytes"}
    assert x["stage"] in ("local", "inject", "forward", "fanout", "gather", "bcast")
    assert x["bytes"] == 4 * (x["box"][0][1] - x["box"][0][0]) * (x["box"][1][1] - x["box"][1][0])
  # Every destination device receives exactly its box.
  got = {}
  for x in doc["transfers"]:
    got[x["dst"]] = got.get(x["dst"], 0) + x["bytes"]
  assert got == {4: 64, 5: 64, 6: 64, 7: 64}
  assert doc["bytes_by_link"] == {"local": 0, "nvlink": 128, "network": 128}


@pytest.mark.parametrize("route", ["hierarchical", "flat", "gather_bcast"])
def test_routes_and_bandwidth_flags(route, capsys):
  # Example A at a size where each leader's share is above the planner's minimum led
  # share (routes.MIN_LEAD_BYTES): a 128-byte tensor is led whole by one replica, and
  # then the hierarchical route's network time is the flat one's.
  args = list(EXAMPLE_A)
  args[args.index("--shape") + 1] = "1024,8192"
  rc, out, _ = _run(args + ["--json", "--route", route, "--nic-gbps", "25",
                            "--nvlink-gbps", "900", "--domain-size", "4"], capsys)
  doc = json.loads(out)
  assert rc == 0 and doc["route"] == route
  stages = {x["stage"] for x in doc["transfers"]}
  if route == "gather_bcast":
    assert stages <= {"gather", "bcast", "local"}
  elif route == "flat":
    assert stages <= {"inject", "local"}
  # Network-bound here: the flat route sends 2B through the network.
  aggregate = doc["route_estimate_ms"]
  assert aggregate["flat"] == pytest.approx(2 * aggregate["hierarchical"])
  # The schedule that runs: at least the aggregate (fill, steps, the call).
  assert all(doc["estimate_ms"][r] >= aggregate[r] for r in aggregate)


def test_text_output(capsys):
  rc, out, _ = _run(EXAMPLE_A, capsys)
  assert rc == 0
  assert "estimate" in out and "bound (sol)" in out and "inject" in out


@pytest.mark.parametrize("args, word", [
    (["--src", "mesh(tp=4) P(zz, None) @0"], "unknown axis"),
    (["--src", "mesh(tp=4) P(tp, tp) @0"], "used twice"),
    (["--src", "mesh(tp=3) P(tp, None) @0"], "divide evenly"),
    (["--shape", "4"], "one entry per tensor dim"),
    (["--dtype", "float33"], "dtype"),
    (["--src", "mesh(tp=2, tp=2) P(tp, None) @0"], "unique"),
    (["--route", "ring"], "route"),
    (["--domain-size", "0"], "domain-size"),
    (["--nic-gbps", "-1"], "nic-gbps"),
])
def test_bad_input_one_line_exit_2(args, word, capsys):
  argv = list(EXAMPLE_A)
  for i in range(0, len(args), 2):
    if args[i] in argv:
      argv[argv.index(args[i]) + 1] = args[i + 1]
    else:
      argv += args[i:i + 2]
  rc, out, err = _run(argv, capsys)
  assert rc == 2 and not out
  assert len(err.strip().splitlines()) == 1 and word in err, err
  assert "Traceback" not in err


def test_module_entry_point():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "jax_m2n", *EXAMPLE_A, "--json"],
                        capture_output=True, text=True, env=env, cwd=root, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stdout)["payload_bytes"] == 128
  bad = subprocess.run([sys.executable, "-m", "jax_m2n", "plan", "--shape", "4,8",
                        "--src", "mesh(tp=4) P(q, None)", "--dst", "mesh(tp=4) P(tp, None)"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=120)
  assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_bare_command_prints_usage_and_grammar(capsys):
  for argv in ([], ["plan"]):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and not out
    assert err.startswith("usage: python -m jax_m2n plan") and "mesh(NAME=SIZE, ...)" in err


def test_help_documents_the_layout_grammar(capsys):
  with pytest.raises(SystemExit) as e:
    main(["plan", "--help"])
  out = capsys.readouterr().out
  assert e.value.code == 0
  assert "mesh(NAME=SIZE, ...) P(ENTRY, ...) [@FIRST]" in out and "P()" in out
  assert "MAX_PLAN_TRANSFERS" in out


def test_times_in_readable_units(capsys):
  rc, out, _ = _run(EXAMPLE_A, capsys)
  assert rc == 0
  assert "e-0" not in out  # not `1.42e-07 ms`
  # A 128-byte tensor: the bound is in ns, the schedule's estimate (the call and its
  # steps on the default transport) in us.
  bound = next(l for l in out.splitlines() if l.startswith("bound (sol)"))
  assert bound.split(":")[1].split()[1] == "ns", bound
  estimate = next(l for l in out.splitlines() if l.startswith("estimate hierarchical"))
  assert estimate.split(":")[1].split()[1] == "us", estimate
  from jax_m2n._src.planner import fmt_time
  assert [fmt_time(v) for v in (1.42e-7, 0.0035, 12.0, 2500.0)] == [
      "0.142 ns", "3.5 us", "12 ms", "2.5 s"]


def test_short_partition_specs_as_jax(capsys):
  short = ["plan", "--shape", "4,8", "--src", "mesh(tp=4) P(tp) @0",
           "--dst", "mesh(dp=2, tp=2) P() @4", "--json"]
  long = ["plan", "--shape", "4,8", "--src", "mesh(tp=4) P(tp, None) @0",
          "--dst", "mesh(dp=2, tp=2) P(None, None) @4", "--json"]
  rc, out, _ = _run(short, capsys)
  rc2, out2, _ = _run(long, capsys)
  assert rc == rc2 == 0 and json.loads(out) == json.loads(out2)


@pytest.mark.parametrize("args, word", [
    (["--shape", "100000", "--src", "mesh(a=100000) P(a)", "--dst", "mesh(a=100000) P(None)"],
     "at most 8388608 transfers"),
    (["--shape", "4", "--src", "mesh(a=" + "1" + "0" * 30 + ") P(a)", "--dst", "mesh(a=4) P(a)"],
     "at most 1048576 devices"),
    (["--shape", "4", "--src", "mesh(a=2) P(a) @4294967296", "--dst", "mesh(a=4) P(a)"],
     "at most 2147483647"),
    (["--shape", "99999999999999999999", "--src", "mesh(a=1) P()", "--dst", "mesh(a=1) P()"],
     "dims must lie in"),
    (["--shape", "67108864", "--src", "mesh(a=2) P(a)", "--dst", "mesh(a=2) P(None)",
      "--chunk-bytes", "1"], "larger chunk_bytes"),
    (["--shape", "4", "--src", "mesh(a=2) P(a)", "--dst", "mesh(a=2) P(a)",
      "--nic-gbps", "1e-320"], "--nic-gbps must lie in"),
    (["--shape", "4", "--src", "mesh(a=2) P(a)", "--dst", "mesh(a=2) P(a)",
      "--nvlink-gbps", "inf"], "--nvlink-gbps must lie in"),
])
def test_limits_refused_in_one_line(args, word, capsys):
  rc, out, err = _run(["plan", *args, "--json"], capsys)
  assert rc == 2 and not out
  assert len(err.strip().splitlines()) == 1 and word in err, err


def test_json_is_strict_json_at_the_bandwidth_limits(capsys):
  rc, out, _ = _run(EXAMPLE_A + ["--json", "--nic-gbps", "1e-3", "--nvlink-gbps", "1e6"],
                    capsys)
  assert rc == 0
  json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_verbose_logs_what_was_planned(capsys):
  import logging
  from jax_m2n._src import planner
  planner.clear_caches()  # a cached plan is not planned (nor logged) again
  log = logging.getLogger("jax_m2n")
  handlers, level = list(log.handlers), log.level
  try:
    rc, _, err = _run(EXAMPLE_A + ["-v", "--route", "flat"], capsys)
  finally:
    log.handlers[:], log.level = handlers, level
  assert rc == 0
  line = next(l for l in err.splitlines() if "planned route flat" in l)
  assert "transfers inject 8" in line and "nvlink 256 B" in line


# (shape, dtype, src mesh axes, src spec, dst mesh axes, dst spec): each side's mesh
# over 4 devices, the source on devices 0-3 and the destination on 4-7, as the CLI's
# "mesh(...) P(...) @FIRST" spells them.
SAME_CALLS = [
    ((4, 8), "float32", {"dp": 1, "tp": 4}, ("tp", None), {"dp": 2, "tp": 2}, ("tp", None)),
    ((1024, 2048), "float32", {"fsdp": 2, "tp": 2}, ("fsdp", "tp"),
     {"dp": 2, "tp": 2}, (None, "tp")),
    ((512, 64, 16), "bfloat16", {"ep": 4}, ("ep", None, None), {"x": 4}, (None, None, "x")),
    ((4096,), "float32", {"tp": 4}, ("tp",), {"dp": 4}, (None,)),
]


def _cli_layout(axes, spec, first):
  entries = ", ".join("None" if e is None else e for e in spec)
  return f"mesh({', '.join(f'{k}={v}' for k, v in axes.items())}) P({entries}) @{first}"


@pytest.mark.parametrize("case", SAME_CALLS, ids=lambda c: "x".join(map(str, c[0])))
def test_cli_and_plan_give_the_same_estimates(case, capsys):
  # One default transport (planner.DEFAULT_TRANSPORT): `python -m jax_m2n plan` prices
  # the call as jax_m2n.plan() does on CPU devices, to the bit.
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_m2n
  shape, dtype, src_axes, src_spec, dst_axes, dst_spec = case
  rc, out, err = _run(["plan", "--shape", ",".join(map(str, shape)), "--dtype", dtype,
                       "--src", _cli_layout(src_axes, src_spec, 0),
                       "--dst", _cli_layout(dst_axes, dst_spec, 4), "--json"], capsys)
  assert rc == 0, err
  cli = json.loads(out)
  devs = np.array(jax.devices()[:8])
  src = NamedSharding(Mesh(devs[:4].reshape(tuple(src_axes.values())), tuple(src_axes)),
                      P(*src_spec))
  dst = NamedSharding(Mesh(devs[4:].reshape(tuple(dst_axes.values())), tuple(dst_axes)),
                      P(*dst_spec))
  plan = jax_m2n.plan(jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=src),
                      dst)
  assert plan.chunking.transport == "cpu"
  assert cli["estimate_ms"] == dict(plan.estimate_ms)
  assert cli["route_estimate_ms"] == {r: plan.with_route(r).route_estimate_ms()
                                      for r in plan.estimate_ms}
  assert cli["chunk_bytes"] == plan.chunk_bytes and cli["steps"] == plan.chunks.n_steps
