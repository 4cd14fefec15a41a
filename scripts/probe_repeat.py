"""Runs tests/probe_test.py's jit property N times, each in a fresh process on 8 forced
CPU devices, and says which runs aborted and on which case.

  python scripts/probe_repeat.py --runs 14                 # from a checkout
  python scripts/probe_repeat.py --runs 10 --out /tmp/probe --test test_jit_matches_jax

Each run's test logs every case to <out>/run<i>.cases before XLA compiles it
(JAX_M2N_PROBE_LOG), so a process that dies inside XLA's compile (SIGABRT, SIGSEGV) names
its case: the last line of that file. The run's output is in <out>/run<i>.log (Python's
faulthandler prints the stack of a fatal signal there). Prints one line per run and a
one-line summary: "probe_repeat: N runs, P passed, F failed, A aborted (...)". Exit code
0 when every run passed.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _last_case(path: str) -> str:
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError:
    return "(no case logged)"
  return lines[-1] if lines else "(no case logged)"


def _run(i: int, args) -> tuple[str, str]:
  cases = os.path.join(args.out, f"run{i}.cases")
  log = os.path.join(args.out, f"run{i}.log")
  for p in (cases, log):
    if os.path.exists(p):
      os.remove(p)
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_M2N_PROBE_LOG=cases,
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-x",
         "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "probe_test.py"),
         "-k", args.test]
  start = time.monotonic()
  with open(log, "w") as out:
    try:
      rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                          timeout=args.timeout_s, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
      rc = None
  took = time.monotonic() - start
  if rc == 0:
    return "passed", f"{took:.0f} s"
  if rc is None:
    return "timeout", f"after {args.timeout_s} s, last case: {_last_case(cases)}"
  if rc < 0:
    name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc
    return "aborted", f"{name} after {took:.0f} s, last case: {_last_case(cases)}"
  return "failed", f"exit {rc} after {took:.0f} s (see {log})"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--out", default="/tmp/jax_m2n_probe_repeat")
  ap.add_argument("--test", default="test_jit_matches_jax", help="pytest -k expression")
  ap.add_argument("--timeout_s", type=int, default=1800, help="per run")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  counts: dict[str, int] = {}
  aborted = []
  for i in range(args.runs):
    status, detail = _run(i, args)
    counts[status] = counts.get(status, 0) + 1
    print(f"run {i}: {status} ({detail})", flush=True)
    if status in ("aborted", "timeout"):
      aborted.append(f"run {i}: {detail}")
  summary = ", ".join(f"{counts.get(k, 0)} {k}" for k in
                      ("passed", "failed", "aborted", "timeout"))
  print(f"probe_repeat: {args.runs} runs, {summary}" +
        (f"; {'; '.join(aborted)}" if aborted else ""), flush=True)
  return 0 if counts.get("passed", 0) == args.runs else 1


if __name__ == "__main__":
  sys.exit(main())
