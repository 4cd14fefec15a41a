"""Reshards across CPU processes under jax.distributed (127.0.0.1): randomized layout
pairs bitwise on every process, a trainer -> generator pytree refit with dtype= and
donation, bytes across processes vs the plan, mismatched arguments, and failures
(a process that raises before the call, dies mid-transfer, never arrives; Ctrl-C)
with their time to fail. Workers: tests/multiprocess_cpu_worker.py; every launch is
bounded and its children killed on timeout."""

import os
import re
import signal
import time

import pytest

import launcher

WORKER = os.path.join(launcher.ROOT, "tests", "multiprocess_cpu_worker.py")


def launch(num_processes, devices, scenario, *extra, timeout=240, interrupt=None):
  """Runs the worker in every process; returns their outputs (stdout + stderr).
  `interrupt`: a process id sent SIGINT once every process has printed WAITING."""
  port = launcher.free_port()
  argvs = [[WORKER, "--process-id", str(i), "--num-processes", str(num_processes),
            "--devices", str(devices), "--port", str(port), "--scenario", scenario,
            *extra] for i in range(num_processes)]

  def send_interrupt(procs, logs, deadline):
    while time.monotonic() < deadline:
      if sum("WAITING" in launcher.read(log) for log in logs[:-1]) == num_processes - 1:
        break
      time.sleep(0.1)
    time.sleep(0.5)
    procs[interrupt].send_signal(signal.SIGINT)

  # The absent process sleeps (and an interrupted call's last process): killed after.
  last_sleeps = scenario in ("absent", "interrupt")
  workers = launcher.run(
      argvs, name=f"{scenario}_{port}", timeout_s=timeout,
      wait_for=range(num_processes - 1) if last_sleeps else None,
      started=send_interrupt if interrupt is not None else None)
  return [w.output for w in workers]


def results(outs, what):
  """The RESULT lines for `what`, as (process, fields dict, line)."""
  found = []
  for out in outs:
    for line in out.splitlines():
      m = re.match(rf"RESULT {what} process=(\d+) (.*)", line)
      if m:
        fields = dict(re.findall(r"(\w+)=(\S+)", m.group(2)))
        found.append((int(m.group(1)), fields, line))
  return found


def _no_fail(outs, n_ok_processes):
  text = "\n".join(outs)
  assert " FAIL" not in text, text[-6000:]
  assert text.count("DONE process=") >= n_ok_processes, text[-6000:]


@pytest.mark.parametrize("num_processes,devices,seed", [(2, 4, 11), (4, 2, 12)])
def test_random_layout_pairs_bitwise_and_bytes(num_processes, devices, seed):
  outs = launch(num_processes, devices, "random", "--cases", "30", "--seed", str(seed))
  _no_fail(outs, num_processes)
  found = results(outs, "random")
  assert sorted(p for p, _, _ in found) == list(range(num_processes)), outs[0][-3000:]
  assert all(int(f["ok"]) == 30 for _, f, _ in found)
  plan = {int(f["plan_network"]) for _, f, _ in found}
  assert len(plan) == 1  # every process derived the same plans
  sent = sum(int(f["sent"]) for _, f, _ in found)
  assert sent == plan.pop() > 0  # one copy of each planned network byte, no more
  print("\n".join(line for _, _, line in found))


def test_model_pytree_bitwise_with_key_value_operations_constant_per_call():
  """4 processes, a 122-leaf pytree of mixed layouts: bitwise on every process, and a
  call's key-value operations bounded by a constant of the processes (the agreement,
  the end, the finish), not growing with the leaves or their layouts."""
  num_processes = 4
  outs = launch(num_processes, 2, "scale", "--cases", "30", "--seed", "5")
  _no_fail(outs, num_processes)
  found = results(outs, "scale")
  assert sorted(p for p, _, _ in found) == list(range(num_processes)), outs[0][-3000:]
  # Per call: the outcome's get, the fingerprint's post, one directory read and at
  # most one get per peer not there yet, the done counter and (the last) its post;
  # the call's end travels in the beats. (The first call also starts this process's
  # engine: its address posted and the peers' read, once per job.)
  bound = 5 + (num_processes - 1)
  for _, f, line in found:
    assert f["ok"] == "1" and int(f["leaves"]) == 122, line
    for k in ("kv_repeat", "kv_small"):
      assert 1 <= int(f[k]) <= bound, line
  print("\n".join(line for _, _, line in found))


@pytest.fixture(scope="module")
def refit_outs():
  """One 2 x 4 launch for the refit and the mismatch checks (start-up is slow here)."""
  return launch(2, 4, "refit")


def test_refit_pytree_bf16_donation_routes_and_jit(refit_outs):
  outs = refit_outs
  _no_fail(outs, 2)
  refit = results(outs, "refit")
  assert len(refit) == 2 and all(f["donated"] == "True" for _, f, _ in refit)
  by_route = {}
  for _, f, _ in results(outs, "bytes"):
    route = f["route"]
    got = by_route.setdefault(route, [0, int(f["plan_network"])])
    got[0] += int(f["sent"])
  assert set(by_route) == {"hierarchical", "flat", "gather_bcast"}
  for route, (sent, planned) in by_route.items():
    assert sent == planned, (route, sent, planned)
  # 1 source process -> 4 replicas on 1 process: hierarchical sends each byte once.
  assert by_route["flat"][0] == 4 * by_route["hierarchical"][0]
  assert len([1 for _, f, _ in results(outs, "large_pytree") if f["ok"] == "1"]) == 2
  jit = results(outs, "jit")
  assert len(jit) == 2 and all(f["ok"] == "1" for _, f, _ in jit)


def test_mismatched_arguments_fail_on_every_process(refit_outs):
  outs = refit_outs
  _no_fail(outs, 2)
  found = results(outs, "mismatch")
  fields = {"shape", "dtype", "sharding", "route", "pytree"}
  for pid in (0, 1):
    mine = {f["field"] for p, f, _ in found if p == pid and f["ok"] == "1"}
    assert mine == fields, (pid, mine)
  assert all("No data moved" in line for _, _, line in found)
  assert len([1 for _, f, _ in results(outs, "next_call") if f["ok"] == "1"]) == 2
  print("\n".join(line for _, _, line in found))


@pytest.mark.parametrize("kind", ["raise", "die", "vanish", "absent", "interrupt"])
def test_failures_reach_every_process_and_the_next_call_works(kind):
  """The last of 4 processes fails (raises before the call and exits / dies right after
  offering its bytes / dies before its call / stays alive but never calls), or process
  0 is interrupted: the
  others fail, naming the process, and a later call over the healthy ones works."""
  outs = launch(4, 2, kind, interrupt=0 if kind == "interrupt" else None)
  tags = {kind, "interrupt_peer"}
  found = [r for t in tags for r in results(outs, t)]
  survivors = [0, 1, 2]
  assert sorted(p for p, _, _ in found) == survivors, "\n".join(o[-2000:] for o in outs)
  culprit = "process 0" if kind == "interrupt" else "process 3"
  for pid, f, line in found:
    assert f["ok"] == "1", line
    seconds = float(f["seconds"])
    assert seconds < 30, line  # generous: the measured times are printed
    if f["type"] != "KeyboardInterrupt":
      assert culprit in line, line
  nxt = [(p, f) for p, f, _ in results(outs, "next_call") if f["after"] == kind]
  assert sorted(p for p, f in nxt if f["ok"] == "1") == survivors, nxt
  print("\n".join(line for _, _, line in found))
