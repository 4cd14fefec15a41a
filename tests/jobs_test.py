"""Publisher / Subscriber between two separate programs (no shared jax.distributed) on
127.0.0.1: the trainer job in 1 and 2 processes x the generator job in 1 and 2, 30
random layout pairs x 3 versions bitwise with dtype= and donation, a second pull that
plans nothing, bytes from the trainer per route; and the failures: a publisher that
dies or closes while a pull waits (an error naming it within 2 s), a subscriber that
dies mid-pull (the publisher and a later subscriber unharmed, a restart reconnects), a
wrong token. Workers: tests/jobs_worker.py; every launch is bounded and its processes
killed on timeout."""

import os
import signal
import time

import pytest

import launcher
from jax_m2n.testing.hosts import EmulatedHosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "jobs_worker.py")


class Jobs(launcher.Procs):
  """Started worker processes (a trainer job, generator jobs) sharing one directory."""

  def __init__(self):
    super().__init__("m2n_jobs_")

  def start(self, role, processes, scenario, devices=4, seed=5, tag="", hosts=None,
            on=(), path="auto"):
    """Starts `processes` workers of one job; returns their names. With `hosts`
    (EmulatedHosts), worker i runs on emulated host `on[i]` and the job's coordinator
    on `on[0]`'s."""
    port = launcher.free_port()
    names = []
    for i in range(processes):
      argv = [WORKER, "--role", role, "--process-id", i, "--num-processes", processes,
              "--devices", devices // processes, "--port", port, "--dir", self.dir,
              "--scenario", scenario, "--seed", seed, "--path", path]
      if hosts is not None:
        argv += ["--host", hosts.address(on[i]), "--coordinator", hosts.address(on[0])]
      names.append(f"{role}{tag}{i}")
      super().start(names[-1], argv, hosts=hosts, host=on[i] if hosts else 0)
    return names

  def run(self, trainers, generators, scenario, seed, path="auto"):
    """A trainer job and a generator job to their end (bounded); no FAIL line; the
    generators' "RESULT <scenario>" lines, one per generator process."""
    t = self.start("trainer", trainers, scenario, seed=seed)
    g = self.start("generator", generators, scenario, seed=seed, path=path)
    self.wait(g, 300)
    self.wait(t, 60)
    text = self.logs()
    assert "FAIL" not in text, text
    found = self.results(scenario)
    assert len(found) == generators, text
    return found


@pytest.fixture
def jobs():
  j = Jobs()
  yield j
  j.kill()


@pytest.mark.parametrize("trainers,generators,path", [
    (1, 1, "auto"), (2, 1, "auto"), (1, 2, "auto"), (2, 2, "auto"), (1, 1, "network"),
    (2, 2, "network")])
def test_random_layouts_versions_bitwise(jobs, trainers, generators, path):
  # On one host "auto" reads the trainer's memory in place (the local data plane);
  # "network" crosses the transport as between hosts.
  found = jobs.run(trainers, generators, "random", seed=10 * trainers + generators,
                   path=path)
  for _, f, line in found:
    assert int(f["ok"]) == 30 * 3 and f["replanned"] == "0" and f["donated"] == "True", line
    assert f["path"] == ("local" if path == "auto" else "network"), line
  if generators == 2:  # a replicated pytree: the trainer's bytes once per job (hierarchical)
    # or once per destination device (flat: 4 devices)
    routes = {}
    for _, f, line in jobs.results("route"):
      # Each process's record of the pull: what its engine received, by that route.
      assert f["record"] == f["received"] and f["record_route"] == f["route"], line
      got = routes.setdefault(f["route"], [0, 0, int(f["payload"])])
      got[0] += int(f["pulled"])
      got[1] = int(f["plan_from_publisher"])
    assert routes["hierarchical"][0] == routes["hierarchical"][1] == routes["hierarchical"][2]
    assert routes["flat"][0] == routes["flat"][1] == 4 * routes["flat"][2]
  print("\n".join(line for _, _, line in found + jobs.results("route")))


@pytest.mark.skipif(EmulatedHosts.unavailable() is not None,
                    reason=str(EmulatedHosts.unavailable()))
def test_across_emulated_hosts_on_shaped_links(jobs):
  # Each of the 4 processes on its own emulated host (own address, 1 Gbit/s link): the
  # trainer job on hosts 0-1, the generator job on hosts 2-3; no address is configured
  # for the generator's own transfer servers (they bind the route to its coordinator).
  with EmulatedHosts(4, rate="1gbit") as hosts:
    t = jobs.start("trainer", 2, "random", seed=41, hosts=hosts, on=(0, 1))
    g = jobs.start("generator", 2, "random", seed=41, hosts=hosts, on=(2, 3))
    jobs.wait(g, 300)
    jobs.wait(t, 60)
  text = jobs.logs()
  assert "FAIL" not in text, text
  found = jobs.results("random")
  assert len(found) == 2, text
  for _, f, line in found:
    assert int(f["ok"]) == 30 * 3 and f["replanned"] == "0", line
  # Each generator process's transfer server bound its own host's address, and the
  # trainer's bytes crossed once per job (hierarchical) or once per device (flat).
  routes = {}
  for name, f, line in jobs.results("route"):
    host = hosts.address(2 + int(name[-1]))
    assert f["transfer"].startswith(host + ":"), line
    got = routes.setdefault(f["route"], [0, int(f["payload"])])
    got[0] += int(f["pulled"])
  assert routes["hierarchical"][0] == routes["hierarchical"][1], routes
  assert routes["flat"][0] == 4 * routes["flat"][1], routes
  print("\n".join(line for _, _, line in found + jobs.results("route")))


def _failed_within(jobs, kill_at):
  found = jobs.results("waited")
  assert len(found) == 1 and found[0][1]["ok"] == "1", jobs.logs()
  seconds = float(found[0][1]["failed_at"]) - kill_at
  return seconds, found[0][2]


def test_a_dead_publisher_fails_a_waiting_pull_within_2s(jobs):
  t = jobs.start("trainer", 1, "wait")
  g = jobs.start("generator", 1, "wait")
  waiting = os.path.join(jobs.dir, "generator_waiting")
  deadline = time.monotonic() + 120
  while not os.path.exists(waiting) and time.monotonic() < deadline:
    time.sleep(0.05)
  time.sleep(0.7)  # the pull is waiting in its long polls
  killed_at = time.time()
  jobs.proc(t[0]).send_signal(signal.SIGKILL)
  jobs.wait(g, 60)
  seconds, line = _failed_within(jobs, killed_at)
  assert seconds < 2.0 and "127.0.0.1" in line, line
  print(f"dead publisher: the waiting pull failed {seconds:.2f} s after the kill: {line}")


def test_a_closed_publisher_fails_a_waiting_pull_at_once(jobs):
  jobs.start("trainer", 1, "close")
  g = jobs.start("generator", 1, "close")
  jobs.wait(g, 120)
  deadline = time.monotonic() + 30  # the trainer reports once its close() returned
  while not jobs.results("closed") and time.monotonic() < deadline:
    time.sleep(0.05)
  closed = jobs.results("closed")
  assert closed, jobs.logs()
  seconds, line = _failed_within(jobs, float(closed[0][1]["at"]))
  assert seconds < 2.0 and "closed" in line, line
  print(f"closed publisher: the waiting pull failed {seconds:.2f} s after close: {line}")


def test_a_subscriber_dying_mid_pull_harms_nobody_and_a_restart_reconnects(jobs):
  t = jobs.start("trainer", 1, "wait")
  dead = jobs.start("generator", 1, "die_mid", tag="a")
  jobs.wait(dead, 120)
  assert jobs.proc(dead[0]).returncode == 3 and jobs.results("die_mid"), jobs.logs()
  other = jobs.start("generator", 1, "again", tag="b")   # another subscriber job
  jobs.wait(other, 120)
  restarted = jobs.start("generator", 1, "again", tag="c")  # the dead one, restarted
  jobs.wait(restarted, 120)
  pulled = jobs.results("pulled")
  assert len(pulled) == 2 and all(f["ok"] == "1" for _, f, _ in pulled), jobs.logs()
  assert jobs.proc(t[0]).poll() is None  # the publisher still serves
  token = jobs.start("generator", 1, "wrong_token", tag="d")
  jobs.wait(token, 120)
  found = jobs.results("wrong_token")
  assert found and found[0][1]["ok"] == "1" and "token" in found[0][2], jobs.logs()
  jobs.wait(t, 60)
