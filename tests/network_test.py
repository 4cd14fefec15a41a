"""Reshards across processes that each run on their own emulated host (network
namespaces behind shaped links: jax_m2n.testing.hosts), with no address configured:
network faults in the middle of a call (a cut link, a partition, a killed process)
fail every process within a bound, naming the process it cannot reach, and the next
call works; lossy, delayed links give bitwise results; a transfer server bound to an
address the peers cannot reach is an error naming process and address, not a hang.
Workers: tests/network_worker.py. Skips with the reason where namespaces cannot be made.
"""

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from jax_m2n.bench import multiprocess_cpu
from jax_m2n.testing.hosts import EmulatedHosts

pytestmark = pytest.mark.skipif(EmulatedHosts.unavailable() is not None,
                                reason=str(EmulatedHosts.unavailable()))

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "network_worker.py")
# Every process fails within this many seconds of the fault (docs/design.md, "Across
# processes", gives the measured times: about 1-1.7 s for a cut link).
FAIL_BOUND_S = 3.0


class Job:
  """N workers of one scenario, worker i in host i; their logs; the sync directory. A
  context manager: leaving it kills the workers still running."""

  def __init__(self, hosts, n, scenario, mib=16.0, port=7001):
    self.sync = tempfile.mkdtemp(prefix="m2n_net_")
    self.logs = [open(os.path.join(self.sync, f"{scenario}_{i}.log"), "w+")
                 for i in range(n)]
    coordinator = f"{hosts.address(0)}:{port}"
    env = multiprocess_cpu.worker_env()
    self.procs = [hosts.popen(i, [
        sys.executable, WORKER, "--process-id", str(i), "--num-processes", str(n),
        "--coordinator", coordinator, "--scenario", scenario, "--sync", self.sync,
        "--mib", str(mib)], env=env, stdout=self.logs[i], stderr=subprocess.STDOUT)
                  for i in range(n)]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for p in self.procs:  # whatever happened, no worker outlives the test
      if p.poll() is None:
        p.kill()

  def text(self, i) -> str:
    self.logs[i].flush()
    self.logs[i].seek(0)
    return self.logs[i].read()

  def tails(self) -> str:
    return "\n".join(f"--- process {i}:\n{self.text(i)[-2500:]}"
                     for i in range(len(self.procs)))

  def wait_for(self, pattern, who, timeout_s):
    """Waits until every process in `who` printed a line matching `pattern`."""
    deadline = time.monotonic() + timeout_s
    while True:
      missing = [i for i in who if not re.search(pattern, self.text(i), re.M)]
      if not missing:
        return
      if time.monotonic() > deadline:
        pytest.fail(f"no {pattern!r} from processes {missing} within {timeout_s} s:\n"
                    + self.tails())
      dead = [i for i in missing if self.procs[i].poll() is not None]
      if dead:
        pytest.fail(f"processes {dead} exited before {pattern!r}:\n" + self.tails())
      time.sleep(0.05)

  def finish(self, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    for p in self.procs:
      try:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pytest.fail("a worker did not finish:\n" + self.tails())

  def results(self, what):
    """{process: fields} of the RESULT lines for `what`."""
    out = {}
    for i in range(len(self.procs)):
      for line in self.text(i).splitlines():
        m = re.match(rf"RESULT {what} process=(\d+) (.*)", line)
        if m:
          fields = dict(re.findall(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)", m.group(2)))
          fields["line"] = line
          out[int(m.group(1))] = fields
    return out


def _check_failed_everywhere(job, what, t_fault, who, names):
  """Every process in `who` failed `what` within FAIL_BOUND_S of t_fault, its error
  naming one of `names[process]`; returns the times to fail."""
  found = job.results(what)
  assert sorted(found) == sorted(who), job.tails()
  times = {}
  for p, f in found.items():
    assert f.get("ok") == "1", f["line"]
    times[p] = float(f["at"]) - t_fault
    assert times[p] < FAIL_BOUND_S, (times[p], f["line"])
    assert any(n in f["error"] for n in names[p]), f["line"]
  print(f"{what}: seconds to fail after the fault, by process: "
        + ", ".join(f"{p}: {t:.2f}" for p, t in sorted(times.items())))
  for p, f in sorted(found.items()):
    print(f"  process {p}: {f['type']}: {f['error'][:400]}")
  return times


def _fault_job(hosts, disturb, heal, names):
  """A 3-process job: warm call, the test disturbs the next one mid-transfer, every
  process fails; healed, the next call works."""
  with Job(hosts, 3, "fault", mib=32) as job:
    job.wait_for(r"^CALL process=", range(3), 240)
    time.sleep(0.4)  # 32 MiB at 100 Mbit/s: about 3 s per copy, so mid-transfer
    t_fault = time.time()
    disturb()
    job.wait_for(r"^RESULT fault process=", range(3), 30)
    heal()
    open(os.path.join(job.sync, "healed"), "w").close()
    job.wait_for(r"^RESULT next_call process=", range(3), 120)
    job.finish()
    times = _check_failed_everywhere(job, "fault", t_fault, range(3), names)
    nxt = job.results("next_call")
    assert all(nxt[p].get("ok") == "1" for p in range(3)), job.tails()
    addresses = {int(m.group(1)): m.group(2) for i in range(3) for m in re.finditer(
        r"^ADDRESS process=(\d+) address=(\S+)", job.text(i), re.M)}
    return times, addresses


def test_link_cut_mid_transfer_fails_everywhere_then_the_next_call_works():
  with EmulatedHosts(3, rate="100mbit") as hosts:
    times, addresses = _fault_job(
        hosts, lambda: hosts.set_link(2, up=False), lambda: hosts.set_link(2, up=True),
        names={0: ["process 2"], 1: ["process 2"],
               2: ["coordinator at 10.77.0.1", "process 1", "process 0"]})
    # No address was configured: each server bound its own host's address.
    assert all(addresses[i].startswith(hosts.address(i) + ":") for i in range(3)), \
        addresses


def test_partition_between_two_processes_that_reach_the_coordinator():
  with EmulatedHosts(3, rate="100mbit") as hosts:
    _fault_job(hosts, lambda: hosts.partition(1, 2), lambda: hosts.heal(1, 2),
               names={0: ["process 1", "process 2"], 1: ["process 2"],
                      2: ["process 1"]})


def test_process_killed_mid_transfer():
  with EmulatedHosts(3, rate="100mbit") as hosts:
    with Job(hosts, 3, "killed", mib=32) as job:
      job.wait_for(r"^CALL process=", range(3), 240)
      time.sleep(0.4)
      t_fault = time.time()
      job.procs[2].kill()
      job.wait_for(r"^RESULT next_call process=", [0, 1], 120)
      job.finish()
      _check_failed_everywhere(job, "killed", t_fault, [0, 1],
                               {0: ["process 2"], 1: ["process 2"]})
      nxt = job.results("next_call")
      assert all(nxt[p].get("ok") == "1" for p in (0, 1)), job.tails()


@pytest.mark.skipif(EmulatedHosts.unavailable(wire=True) is not None,
                    reason=str(EmulatedHosts.unavailable(wire=True)))
def test_lossy_delayed_links_give_bitwise_results():
  # 10 ms and 0.5% loss on each link, each way: between two hosts 20 ms one way and
  # about 1% loss (a frame crosses two links).
  with EmulatedHosts(3, rate="1gbit", delay_ms=10, loss=0.005) as hosts:
    with Job(hosts, 3, "lossy", mib=1) as job:
      job.wait_for(r"^DONE process=", range(3), 240)
      job.finish()
      found = {i: job.results(f"lossy{i}") for i in range(3)}
      for i, by_process in found.items():
        assert sorted(by_process) == [0, 1, 2], job.tails()
        assert all(f.get("ok") == "1" for f in by_process.values()), job.tails()
      print("1 MiB over 20 ms / 1% loss paths, seconds per call (max over processes): "
            + ", ".join(f"{max(float(f['seconds']) for f in by.values()):.2f}"
                        for by in found.values()))


def test_unreachable_transfer_address_is_an_error_naming_process_and_address():
  # Every process told to bind 127.0.0.1 (a multi-host job with a wrong override): a
  # peer's loopback is not reachable from another host.
  with EmulatedHosts(3, rate="1gbit") as hosts:
    with Job(hosts, 3, "address", mib=1) as job:
      job.wait_for(r"^CALL process=", range(3), 240)
      job.wait_for(r"^RESULT address process=", range(3), 30)
      job.finish()
      found = job.results("address")
      for p, f in sorted(found.items()):
        assert f.get("ok") == "1", f["line"]
        assert float(f["seconds"]) < 10, f["line"]
        assert "127.0.0.1:" in f["error"] and "JAX_M2N_TRANSFER_HOST" in f["error"], \
            f["line"]
        print(f"process {p} after {f['seconds']} s: {f['error'][:300]}")
