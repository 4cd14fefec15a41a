"""What a person running weight sync can see of it (issue 45), against a live Publisher
in this process (8 CPU devices: the publisher on 0-3, subscribers on 4-7): the records
of local, network, delta and relayed pulls (bytes against the tree and the plan, phases
summing to the total, control calls against the channel's own count), a failed pull's
record, `Publisher.stats()`, the Prometheus metrics against a known pull, the
`python -m jax_m2n jobs status` command (readable, --json, its token rules, a
subprocess), and the logging (one line per version and per pull, a WARNING per
failure, nothing printed)."""

import json
import logging
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import prometheus_client
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import cli
from jax_m2n._src.jobs import channel, delta, records
from jobs_faults import pass_over

TOKEN = "operate-test-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def meshes():
  devs = np.array(jax.devices())
  return (Mesh(devs[:4].reshape(2, 2), ("a", "b")),
          Mesh(devs[4:].reshape(2, 2), ("x", "y")))


def _tree(trainer, scale=1.0):
  w = (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * scale)
  b = np.linspace(0, 1, 16, dtype=np.float32)
  return {"w": jax.device_put(w, NamedSharding(trainer, P("a", "b"))),
          "b": jax.device_put(b, NamedSharding(trainer, P("b")))}


def _dst(gen):
  # w: two column halves, each on 2 devices; b: two halves, each on 2 devices.
  return {"w": NamedSharding(gen, P(None, "y")), "b": NamedSharding(gen, P("x"))}


def _phases_sum_to_the_total(r):
  assert min(r.wait_s, r.plan_s, r.move_s, r.compose_s) >= 0
  assert r.wait_s + r.plan_s + r.move_s + r.compose_s == pytest.approx(r.total_s,
                                                                      abs=1e-6)


def test_records_of_a_local_and_a_network_pull(meshes):
  trainer, gen = meshes
  tree = _tree(trainer)
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    assert sub.last_pull is None and sub.last_failure is None
    pub.publish(tree)
    t0 = time.time()
    out = sub.pull(_dst(gen), dtype={"w": jnp.bfloat16, "b": None}, path="local")
    r = sub.last_pull
    assert (r.version, r.path, r.route) == (1, "local", "flat")
    # The result: w in bfloat16, b in float32 (global sizes).
    assert r.result_bytes == 8 * 16 * 2 + 16 * 4 == sum(a.nbytes for a in out.values())
    # Local: every destination device copies its box in the published float32.
    assert r.wire_bytes == 4 * (8 * 8 * 4) + 4 * (8 * 4)
    assert r.relay_parent is None and r.delta_ratio is None and r.retries == ()
    assert t0 <= r.started_at <= time.time()
    _phases_sum_to_the_total(r)

    before = dict(channel.stats)
    version = pub.publish(tree)
    sub.pull(_dst(gen), dtype={"w": jnp.bfloat16, "b": None}, path="network")
    r = sub.last_pull
    assert (r.version, r.path, r.route) == (version, "network", "hierarchical")
    assert r.result_bytes == 8 * 16 * 2 + 16 * 4
    # Hierarchical in one process: each distinct box leaves the trainer once, in the
    # wire dtype (w narrowed to bfloat16 by the publisher), and is fanned out here.
    assert r.wire_bytes == 8 * 16 * 2 + 16 * 4
    assert r.control_calls == channel.stats["calls"] - before["calls"] > 0
    assert r.control_bytes_sent == channel.stats["sent_bytes"] - before["sent_bytes"]
    assert r.control_bytes_received == (channel.stats["received_bytes"]
                                        - before["received_bytes"])
    _phases_sum_to_the_total(r)
    # Offered through the publisher's transport for that version: what was fetched.
    held = {v.version: v for v in pub.stats().versions}
    assert held[version].offered_bytes == r.wire_bytes
    assert held[1].offered_bytes == 0  # version 1 went the local way


def test_a_delta_pull_records_its_ratio(meshes):
  trainer, gen = meshes
  host = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  src = NamedSharding(trainer, P("a", "b"))
  dst = NamedSharding(gen, P("x", "y"))
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish({"w": jax.device_put(host, src)})
    out = sub.pull(dst, delta=True, path="network")
    assert sub.last_pull.path == "network" and sub.last_pull.delta_ratio is None
    changed = host.copy()
    changed[0, :4] += 1  # 4 of 4096 elements
    pub.publish({"w": jax.device_put(changed, src)})
    before = delta.stats["subscriber_pulled_bytes"]
    out = sub.pull(dst, delta=True, donate=out, path="network")
    r = sub.last_pull
    np.testing.assert_array_equal(np.asarray(out["w"]), changed)
    assert (r.version, r.path, r.route) == (2, "delta", "flat")
    assert r.wire_bytes == delta.stats["subscriber_pulled_bytes"] - before > 0
    assert r.delta_ratio == pytest.approx(r.wire_bytes / host.nbytes) and (
        r.delta_ratio < 0.1)
    _phases_sum_to_the_total(r)


def test_a_relayed_pull_records_its_parent_and_the_status_shows_the_tree(meshes):
  trainer, gen = meshes
  dst = NamedSharding(gen, P("y"))
  with jax_m2n.Publisher(token=TOKEN) as pub:
    version = pub.publish(_tree(trainer))
    first = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
    second = jax_m2n.Subscriber(pub.address, token=TOKEN, relay=True)
    try:
      first.pull(dst, version=version, path="network")
      assert first.last_pull.path == "relay"
      assert first.last_pull.relay_parent == "the trainer"
      assert first.last_pull.wire_bytes == 8 * 16 * 4 + 16 * 4  # all from the trainer
      # The first member "dies" (its recorded address is a closed port): the second
      # passes it over and pulls from the trainer.
      closed = pass_over(pub, version, first._state.relay.id)
      second.pull(dst, version=version, path="network")
      r = second.last_pull
      assert (r.path, r.relay_parent, r.retries) == ("relay", closed, ("relay re-route",))
      assert r.wire_bytes == 8 * 16 * 4 + 16 * 4
      _phases_sum_to_the_total(r)
      reply = jax_m2n._src.jobs.status.ask(pub.address, TOKEN)
    finally:
      first.close()
      second.close()
  [relay] = reply["relays"]
  ids = [first._state.relay.id, second._state.relay.id]
  assert relay["version"] == version
  assert [(m["member"], m["upstream"], m["dead"]) for m in relay["members"]] == [
      (ids[0], None, True), (ids[1], None, False)]  # re-routed: from the trainer now
  text = jax_m2n._src.jobs.status.summary(reply)
  assert f"{ids[0]} at {closed} <- the trainer (done, dead)" in text
  assert f"{ids[1]} at " in text


def test_a_failed_pull_leaves_its_record_and_the_last_pull_stays(meshes):
  trainer, gen = meshes
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(_tree(trainer))
    sub.pull(_dst(gen))
    last = sub.last_pull
    t0 = time.time()
    with pytest.raises(jax_m2n.ReshardTimeoutError):
      sub.pull(_dst(gen), timeout_s=0.2)
    f = sub.last_failure
    assert (f.cause, f.version, f.path) == ("timeout", 0, "")
    assert f.error.startswith("ReshardTimeoutError: Subscriber.pull: a version newer")
    assert 0.2 <= f.seconds < 2.0 and t0 <= f.at <= time.time()
    with pytest.raises(jax_m2n.ReshardValueError):
      sub.pull({"w": _dst(gen)["w"]}, version=1)  # "b" missing
    assert (sub.last_failure.cause, sub.last_failure.version) == ("value", 1)
    assert sub.last_pull is last


def test_publisher_stats(meshes):
  trainer, gen = meshes
  tree = _tree(trainer)
  here = sum(s.data.nbytes for a in tree.values() for s in a.addressable_shards)
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub:
    s = pub.stats()
    assert (s.process, s.address, s.transport) == (0, pub.address, "net")
    assert (s.versions, s.last_version, s.last_published_at, s.subscribers) == (
        (), 0, None, 0)
    t0 = time.time()
    for _ in range(3):
      pub.publish(tree)
    with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
      sub.pull(_dst(gen), path="network")
      sub.pull(_dst(gen), version=2, path="network")
      with pytest.raises(jax_m2n.ReshardRuntimeError):  # a malformed call: refused
        sub._state.connections.root().call({"op": "nonsense"}, 5.0, "nonsense")
      s = pub.stats()
    assert [v.version for v in s.versions] == [2, 3] and s.last_version == 3
    assert all(v.bytes == here for v in s.versions) and s.held_bytes == 2 * here
    assert t0 <= s.last_published_at == s.versions[-1].published_at <= time.time()
    assert s.subscribers == 1 and len(s.peers) == 1
    assert (s.peers[0].version, s.peers[0].last_op) == (3, "nonsense")
    assert s.pulls_answered == s.answered["pull"] == 2 and s.answered["register"] == 1
    assert s.failures == {"refused": 1}
    assert s.offered_bytes == sum(v.offered_bytes for v in s.versions) > 0
    assert s.served_bytes >= s.offered_bytes  # the net transport counts what it sent
    assert s.exports == 1 and s.export_bytes >= 2 * here  # CPU: the snapshot is one
    json.dumps(s.to_json(), allow_nan=False)  # JSON as it is


def test_metrics_match_a_known_pull(meshes):
  trainer, gen = meshes
  registry = prometheus_client.CollectorRegistry()
  value = registry.get_sample_value
  with pytest.raises(jax_m2n.ReshardTypeError, match="CollectorRegistry"):
    jax_m2n.Subscriber("127.0.0.1:1", token=TOKEN, metrics="registry")
  with jax_m2n.Publisher(token=TOKEN, metrics=registry) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN, metrics=registry) as sub, jax_m2n.Subscriber(
          pub.address, token=TOKEN, metrics=registry) as other:  # shares the metrics
    pub.publish(_tree(trainer))
    sub.pull(_dst(gen), dtype={"w": jnp.bfloat16, "b": None}, path="network")
    r = sub.last_pull
    other.pull(_dst(gen), path="local")
    with pytest.raises(jax_m2n.ReshardTimeoutError):
      sub.pull(_dst(gen), timeout_s=0.1)
    net = {"path": "network"}
    assert value("jax_m2n_pulls_total", net) == 1
    assert value("jax_m2n_pulls_total", {"path": "local"}) == 1
    assert value("jax_m2n_pull_wire_bytes_total", net) == r.wire_bytes == 320
    assert value("jax_m2n_pull_result_bytes_total", net) == r.result_bytes == 320
    assert value("jax_m2n_pull_seconds_count", net) == 1
    assert value("jax_m2n_pull_seconds_sum", net) == pytest.approx(r.total_s)
    assert value("jax_m2n_pull_phase_seconds_sum", {"phase": "move"}) == pytest.approx(
        r.move_s + other.last_pull.move_s)
    assert value("jax_m2n_pull_failures_total", {"cause": "timeout"}) == 1
    s = pub.stats()
    assert value("jax_m2n_versions_published_total") == 1
    assert value("jax_m2n_versions_held") == 1
    assert value("jax_m2n_held_bytes") == s.held_bytes
    assert value("jax_m2n_subscribers_connected") == s.subscribers == 2
    assert value("jax_m2n_offered_bytes_total") == s.offered_bytes == 320
    assert value("jax_m2n_pulls_answered_total", {"op": "pull"}) == 1
    assert value("jax_m2n_pulls_answered_total", {"op": "local"}) == 1


@pytest.fixture(scope="module")
def live(meshes):
  trainer, gen = meshes
  pub = jax_m2n.Publisher(token=TOKEN)
  pub.publish(_tree(trainer))
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    sub.pull(_dst(gen), path="network")
  yield pub
  pub.close()


def test_the_status_command_readable_and_json(live, capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_M2N_TOKEN", TOKEN)
  assert cli.main(["jobs", "status", live.address]) == 0
  text = capsys.readouterr().out
  assert text.startswith(f"publisher {live.address} (trainer process 0, transport net)")
  for line in ("versions: 1 held, 640 B; last published 1, ",
               "  version 1: 640 B, published ", "pulls answered: 1 (pull 1); other "
               "requests: manifest 1, register 1, versions 1", "failures: none",
               "local exports: 1", "relays: none"):
    assert line in text, (line, text)
  monkeypatch.delenv("JAX_M2N_TOKEN")
  path = tmp_path / "token"
  path.write_text(TOKEN + "\n")
  assert cli.main(["jobs", "status", live.address, "--json",
                   "--token-file", str(path)]) == 0
  got = json.loads(capsys.readouterr().out)
  now = live.stats().to_json()
  # A status answer counts the status calls answered before it.
  assert (got["stats"]["answered"]["status"], now["answered"]["status"]) == (1, 2)
  assert {k: v for k, v in got["stats"].items() if k not in ("answered", "peers")} == {
      k: v for k, v in now.items() if k not in ("answered", "peers")}
  assert got["relays"] == [] and got["status"] == 1


@pytest.mark.parametrize("args,env,status,word", [
    (["jobs", "status", "no-port"], TOKEN, 2, "host:port"),
    (["jobs", "status", "127.0.0.1:1"], None, 2, "JAX_M2N_TOKEN"),
    (["jobs", "status", "127.0.0.1:1", "--token-file", "/nonexistent"], None, 2,
     "--token-file must be a readable file"),
    (["jobs", "status", "LIVE"], "not-the-token-but-long-enough", 2,
     "token must be the one"),
    (["jobs", "status", "LIVE"], "short", 2, "at least 16"),
    (["jobs", "status", "127.0.0.1:1", "--timeout", "0.5"], TOKEN, 1, "within 0.5 s"),
    (["jobs", "status", "LIVE", "--token", TOKEN], TOKEN, 2, "unrecognized"),
    (["jobs"], TOKEN, 2, "required"),
])
def test_the_status_command_refuses_in_one_line(live, capsys, monkeypatch, args, env,
                                                status, word):
  args = [live.address if a == "LIVE" else a for a in args]
  if env is None:
    monkeypatch.delenv("JAX_M2N_TOKEN", raising=False)
  else:
    monkeypatch.setenv("JAX_M2N_TOKEN", env)
  assert cli.main(args) == status
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and err.startswith("jax_m2n: error: ")
  assert word in err, err


def test_the_status_command_as_a_program(live):
  env = dict(os.environ, JAX_M2N_TOKEN=TOKEN, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  got = subprocess.run([sys.executable, "-m", "jax_m2n", "jobs", "status", live.address,
                        "--json"], env=env, capture_output=True, text=True, timeout=120)
  assert got.returncode == 0, got.stderr
  assert json.loads(got.stdout)["stats"]["last_version"] == 1


def test_one_log_line_per_version_and_pull_a_warning_per_failure_nothing_printed(
    meshes, caplog, capsys):
  trainer, gen = meshes
  caplog.set_level(logging.INFO, logger="jax_m2n")
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    caplog.clear()
    pub.publish(_tree(trainer))
    sub.pull(_dst(gen), path="network")
    with pytest.raises(jax_m2n.ReshardTimeoutError):
      sub.pull(_dst(gen), timeout_s=0.1)
    got = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
  assert capsys.readouterr() == ("", "")
  assert [(n, l) for n, l, _ in got] == [("jax_m2n", "INFO"), ("jax_m2n", "INFO"),
                                         ("jax_m2n", "WARNING")], got
  assert got[0][2] == "Publisher: version 1 published: 2 leaves, 640 B held here"
  assert re.fullmatch(r"Subscriber\.pull: version 1 by network \(hierarchical route\): "
                      r"576 B, 576 B received, [0-9.]+ s \(wait [0-9.]+, plan [0-9.]+, "
                      r"move [0-9.]+, compose [0-9.]+\)", got[1][2]), got[1][2]
  assert got[2][2].startswith("Subscriber.pull: failed after ")


def test_the_jobs_layer_prints_nothing_and_logs_under_one_name():
  jobs = os.path.join(ROOT, "jax_m2n", "_src", "jobs")
  for dirpath, _, files in os.walk(jobs):
    for f in files:
      if f.endswith(".py"):
        text = open(os.path.join(dirpath, f)).read()
        assert not re.search(r"(?<![\w.])print\(", text), f
        assert set(re.findall(r"getLogger\(([^)]*)\)", text)) <= {'"jax_m2n"'}, f
        assert "logging.basicConfig" not in text, f


def test_records_are_frozen():
  r = records.PullFailure("timeout", "e", 0.0, 0.0, 0, "")
  with pytest.raises(AttributeError):
    r.cause = "other"
