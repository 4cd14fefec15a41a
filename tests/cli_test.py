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
  rc, out, _ = _run(EXAMPLE_A + ["--json", "--route", route, "--nic-gbps", "25",
                                 "--nvlink-gbps", "900", "--domain-size", "4"], capsys)
  doc = json.loads(out)
  assert rc == 0 and doc["route"] == route
  stages = {x["stage"] for x in doc["transfers"]}
  if route == "gather_bcast":
    assert stages <= {"gather", "bcast", "local"}
  elif route == "flat":
    assert stages <= {"inject", "local"}
  # Network-bound here: the flat route sends 2B through the network.
  assert doc["estimate_ms"]["flat"] == pytest.approx(2 * doc["estimate_ms"]["hierarchical"])


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
