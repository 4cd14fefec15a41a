"""The jobs control plane against a live Publisher in this process (8 CPU devices: the
publisher on 0-3, a subscriber on 4-7), through the public classes: a fuzzer
(hypothesis) of what strangers send to its control port and of malformed calls from an
authenticated client, each refused while the publisher keeps serving; a flood during
which a subscriber connects and pulls; the token (its rules, never sent, a wrong one
named on the subscriber); a pull's control round trips counted; loopback by default;
dst / dtype / version errors raised before any byte moves; pulls bitwise against
jax.device_put, Quantize as reshard's. The control channel alone:
jobs_security_test.py."""

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import auth, channel, engine, local
from doctest_test import run_docstring_examples

sys.path.insert(0, os.path.dirname(__file__))
import jobs_attacks as attacks  # noqa: E402

TOKEN = "protocol-test-token-0123456789"


@pytest.fixture(scope="module")
def published():
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  rng = np.random.default_rng(0)
  host = {"w": rng.standard_normal((8, 16)).astype(np.float32),
          "b": rng.standard_normal((16,)).astype(np.float32),
          "n": np.arange(24, dtype=np.int32).reshape(4, 6)}
  tree = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("a", "b"))),
          "b": jax.device_put(host["b"], NamedSharding(mesh, P("b"))),
          "n": jax.device_put(host["n"], NamedSharding(mesh, P(None, "a")))}
  pub.publish(tree)
  yield pub, tree, host
  pub.close()


@pytest.fixture(scope="module")
def gen():
  return Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("x", "y"))


def _dst(gen):
  return {"w": NamedSharding(gen, P(None, "y")), "b": NamedSharding(gen, P("x")),
          "n": NamedSharding(gen, P())}


def _bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("fn", [jax_m2n.Publisher, jax_m2n.Subscriber],
                         ids=["Publisher", "Subscriber"])
def test_docstring_examples_run(fn):
  run_docstring_examples(fn)


def test_binds_loopback_by_default_and_pulls_bitwise(published, gen):
  pub, tree, host = published
  assert pub.address.startswith("127.0.0.1:")
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    out = sub.pull(_dst(gen), dtype={"w": jnp.bfloat16, "b": None, "n": jnp.float32},
                   version=1)
    assert sub.version == 1
    for k, d in (("w", jnp.bfloat16), ("b", None), ("n", jnp.float32)):
      want = jax.device_put(tree[k] if d is None else tree[k].astype(d), _dst(gen)[k])
      assert out[k].sharding == _dst(gen)[k] and out[k].dtype == want.dtype
      np.testing.assert_array_equal(_bits(out[k]), _bits(want))


@pytest.mark.parametrize("host_cut", [True, False], ids=["numpy_cut", "xla_cut"])
def test_network_pulls_are_bitwise_whichever_way_the_publisher_cuts(published, gen,
                                                                    host_cut,
                                                                    monkeypatch):
  # A small plan in its published dtypes is cut with numpy (offering.HOST_CUT_BYTES),
  # others by XLA programs; both give the same bytes, over layouts whose pieces are
  # whole shards, runs and strided boxes, packed alone and several to a pack.
  from jax_m2n._src.jobs import exports, offering
  monkeypatch.setattr(offering, "HOST_CUT_BYTES", 1 << 20 if host_cut else 0)
  reads = []
  shard = exports.Export.host_shard
  monkeypatch.setattr(exports.Export, "host_shard",
                      lambda self, *a: reads.append(a) or shard(self, *a))
  pub, tree, _ = published
  layouts = [_dst(gen),
             {"w": NamedSharding(gen, P("x", "y")), "b": NamedSharding(gen, P()),
              "n": NamedSharding(gen, P("y", "x"))},
             {"w": NamedSharding(gen, P("y", None)), "b": NamedSharding(gen, P("y")),
              "n": NamedSharding(gen, P(("x", "y"), None))}]
  for route in ("hierarchical", "flat"):
    with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
      for dst in layouts:
        for _ in range(2):  # the first pull registers the plan, the second reuses it
          out = sub.pull(dst, version=1, path="network", route=route)
          for k in dst:
            want = jax.device_put(tree[k], dst[k])
            assert out[k].sharding == dst[k]
            np.testing.assert_array_equal(_bits(out[k]), _bits(want))
  assert bool(reads) == host_cut


def test_quantize_matches_reshard(published, gen):
  pub, tree, _ = published
  spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 8})
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    out = sub.pull(_dst(gen), dtype={"w": spec, "b": None, "n": None}, version=1)
  want = jax_m2n.reshard(tree["w"], _dst(gen)["w"], dtype=spec)
  np.testing.assert_array_equal(_bits(out["w"].qvalue), _bits(want.qvalue))
  np.testing.assert_array_equal(_bits(out["w"].scale), _bits(want.scale))


def test_wrong_and_short_tokens_are_errors_on_the_subscriber(published):
  pub, _, _ = published
  t0 = time.monotonic()
  with pytest.raises(jax_m2n.ReshardValueError,
                     match="token must be the one the publisher holds"):
    jax_m2n.Subscriber(pub.address, token="not-the-token-but-long-enough")
  assert time.monotonic() - t0 < 3.0  # named at once, not after timeout_s
  with pytest.raises(jax_m2n.ReshardValueError, match="at least 16 characters"):
    jax_m2n.Subscriber(pub.address, token="s3cret")
  with pytest.raises(jax_m2n.ReshardValueError, match="at least 16 bytes"):
    jax_m2n.Publisher(token=b"s3cret")
  with pytest.raises(jax_m2n.ReshardTypeError, match="token"):
    jax_m2n.Subscriber(pub.address, token=1234)


def test_the_token_never_travels(published, monkeypatch):
  pub, _, _ = published
  sent = []
  for name in ("send", "send_multipart"):
    real = getattr(zmq.Socket, name)

    def spy(self, data, *a, _real=real, **k):
      sent.extend(bytes(d) for d in (data if isinstance(data, list) else [data]))
      return _real(self, data, *a, **k)
    monkeypatch.setattr(zmq.Socket, name, spy)
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    sub._state.connections.root().call({"op": "versions", "after": 0, "wait_ms": 0}, 5.0,
                                       "versions")
  assert sent and not any(TOKEN.encode() in s for s in sent)
  assert not any(TOKEN.encode().hex().encode() in s for s in sent)


@pytest.mark.parametrize("path,first_calls,steady_calls", [
    ("network", 4, 1),  # versions, manifest, register the plan, pull; then one pull
    ("local", 4, 1),    # versions, manifest, the export, "pulled" (the word after the
                        # copy, unanswered); then versions (memory after)
])
def test_a_steady_state_pulls_control_messages_are_counted(published, gen, path,
                                                           first_calls, steady_calls):
  # A pull that recurs (same layouts, a newer version) sends one message: on the network
  # path the pull of the newest version after its last (the plan is registered with the
  # one publisher process; the answer names the version offered), on the local path the
  # versions request, answered while it copies from the publisher's memory: asserted,
  # so that it cannot regress silently.
  _, tree, _ = published
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(tree)
    before = dict(channel.stats)
    sub.pull(_dst(gen), version=1, path=path)
    first = {k: channel.stats[k] - before.get(k, 0) for k in ("calls", "sent")}
    for _ in range(3):
      before = dict(channel.stats)
      version = pub.publish(tree)
      out = sub.pull(_dst(gen), path=path)
      steady = {k: channel.stats[k] - before.get(k, 0) for k in ("calls", "sent")}
      assert sub.version == version and sub._state.path == path
      np.testing.assert_array_equal(_bits(out["w"]), _bits(jax.device_put(
          tree["w"], _dst(gen)["w"])))
      assert steady == {"calls": steady_calls, "sent": steady_calls}, (path, steady)
  assert first["calls"] == first_calls, (path, first)


def test_a_pull_of_the_newest_in_one_message_falls_back_where_it_must(published, gen):
  """The one-message network pull (the newest version after the last, offered at once)
  where the newest has another layout set, where none is newer yet (the publisher
  answers after NEWEST_WAIT_S; the pull then waits the usual way), and after close."""
  _, tree, _ = published
  trainer = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  other = {"w": jax.device_put(np.full((4, 8), 7, np.float32),
                               NamedSharding(trainer, P("b")))}
  dst = NamedSharding(gen, P("x"))
  pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    pub.publish(tree)
    sub.pull(dst, path="network")
    v = pub.publish(tree)
    before = dict(channel.stats)
    out = sub.pull(dst, path="network")  # one message
    assert channel.stats["calls"] - before.get("calls", 0) == 1
    assert sub.version == v and sub.last_pull.path == "network"
    np.testing.assert_array_equal(_bits(out["n"]), _bits(tree["n"]))
    v = pub.publish(other)  # the newest has another layout set: named, pulled after
    out = sub.pull(dst, path="network")
    assert sub.version == v and (np.asarray(out["w"]) == 7).all()
    pub.publish(other)
    out = sub.pull(dst, path="network")
    assert sub.version == v + 1 and out["w"].shape == (4, 8)
    # None newer yet: the publisher answers "none" after NEWEST_WAIT_S, the pull waits on.
    timer = threading.Timer(2 * engine.NEWEST_WAIT_S, pub.publish, (other,))
    timer.start()
    try:
      t0 = time.monotonic()
      out = sub.pull(dst, path="network", timeout_s=30)
      assert sub.version == v + 2 and time.monotonic() - t0 >= engine.NEWEST_WAIT_S
    finally:
      timer.join()
    # Published within the publisher's wait (made long here, so that a loaded machine
    # cannot delay the publish past it): offered at once.
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(engine, "NEWEST_WAIT_S", 5.0)
      timer = threading.Timer(0.1, pub.publish, (other,))
      timer.start()
      try:
        before = dict(channel.stats)
        sub.pull(dst, path="network", timeout_s=30)
        assert sub.version == v + 3 and channel.stats["calls"] - before["calls"] == 1
      finally:
        timer.join()
    # A version asked by number: one message too; a dropped one refused (keep=2).
    v = pub.publish(other)
    before = dict(channel.stats)
    out = sub.pull(dst, version=v, path="network")
    assert sub.version == v and channel.stats["calls"] - before["calls"] == 1
    out = sub.pull(dst, version=v - 1, path="network")  # older, still held
    assert (np.asarray(out["w"]) == 7).all()
    with pytest.raises(jax_m2n.ReshardValueError, match=f"version {v - 2} must be held"):
      sub.pull(dst, version=v - 2, path="network")
    # None newer within timeout_s: the timeout bounds the whole wait.
    t0 = time.monotonic()
    with pytest.raises(jax_m2n.ReshardTimeoutError, match="timeout_s=0.3"):
      sub.pull(dst, path="network", timeout_s=0.3)
    assert time.monotonic() - t0 < 0.3 + engine.NEWEST_WAIT_S
    pub.close()
    t0 = time.monotonic()
    with pytest.raises(jax_m2n.ReshardRuntimeError, match="closed"):
      sub.pull(dst, path="network", timeout_s=5)
    assert time.monotonic() - t0 < 2 * (engine.NEWEST_WAIT_S + engine.NEWEST_ANSWER_S)


@pytest.mark.parametrize("path,steady_calls", [("network", 1), ("local", 1)])
def test_prepare_makes_the_first_pull_a_steady_one(published, gen, path, steady_calls):
  # prepare() does the first pull's work (manifest, plan, registration or export,
  # compiled copies on both sides) and moves no weights; the first pull after it then
  # sends what a recurring pull sends, and nothing crosses the transport before it.
  _, tree, _ = published
  with jax_m2n.Publisher(token=TOKEN, keep=2) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as sub:
    pub.publish(tree)
    moved = dict(engine.stats)
    assert sub.prepare(_dst(gen), path=path) == 1
    assert dict(engine.stats) == moved and sub.version == 0
    with pytest.raises(jax_m2n.ReshardValueError, match="Subscriber.prepare: .*prefix"):
      sub.prepare({"w": _dst(gen)["w"]}, path=path)
    before = dict(channel.stats)
    compiled = local._copies.cache_info().misses, engine._direct_recipe.cache_info().misses
    out = sub.pull(_dst(gen), path=path)
    first = {k: channel.stats[k] - before.get(k, 0) for k in ("calls", "sent")}
    assert first == {"calls": steady_calls, "sent": steady_calls}, (path, first)
    assert (local._copies.cache_info().misses,  # nothing prepared again
            engine._direct_recipe.cache_info().misses) == compiled
    assert sub.version == 1 and sub._state.path == path
    np.testing.assert_array_equal(_bits(out["w"]), _bits(jax.device_put(
        tree["w"], _dst(gen)["w"])))


def test_bad_arguments_fail_before_any_byte_moves(published, gen):
  pub, tree, _ = published
  before = dict(engine.stats)
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    with pytest.raises(jax_m2n.ReshardValueError, match="prefix"):
      sub.pull({"w": _dst(gen)["w"], "b": _dst(gen)["b"]}, version=1)  # "n" missing
    with pytest.raises(jax_m2n.ReshardValueError, match="prefix of the published pytree"):
      sub.pull({**_dst(gen), "extra": _dst(gen)["b"]}, version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="must keep its shape"):
      sub.pull({**_dst(gen), "w": jax.ShapeDtypeStruct((4, 16), np.float32,
                                                       sharding=_dst(gen)["w"])}, version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="hold shape"):
      sub.pull({**_dst(gen), "n": NamedSharding(gen, P(None, ("x", "y")))}, version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="route"):
      sub.pull(_dst(gen), route="ring", version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="route"):
      sub.pull(_dst(gen), route="gather_bcast", version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="version"):
      sub.pull(_dst(gen), version=0)
    with pytest.raises(jax_m2n.ReshardTimeoutError, match="version 5"):
      sub.pull(_dst(gen), version=5, timeout_s=0.3)
    with pytest.raises(jax_m2n.ReshardTypeError, match="donate"):
      sub.pull(_dst(gen), version=1, donate={"w": 3})
  assert dict(engine.stats) == before  # nothing was pulled
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:  # and the publisher serves
    assert sub.pull(_dst(gen), version=1)["w"].shape == (8, 16)


# ---------------------------------------------------------------------------------------
# Strangers and malformed calls
# ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

# Calls of the publisher's ops with fields of any type and value (a wait or an offer
# the publisher would hold is kept short by answer_s: the client then reconnects).
bodies = st.fixed_dictionaries({"op": st.sampled_from(
    ["versions", "manifest", "pieces", "delta", "relay_join", "relay_poll", "relay_done",
     "bye", "nope", ""])}, optional={
        "after": json_values, "wait_ms": json_values, "id": json_values,
        "version": json_values, "base": json_values, "wire": json_values,
        "groups": json_values, "timeout_ms": json_values, "group": json_values,
        "member": json_values, "chunk_bytes": json_values, "dense": json_values,
        "measure": json_values, "calibrate": json_values})


@pytest.fixture(scope="module")
def insider(published):
  pub, _, _ = published
  state = {"client": None}

  def client():
    if state["client"] is None or state["client"].broken is not None:
      state["client"] = channel.Client("test", pub.address, auth.as_key("test", TOKEN),
                                       5.0, "the publisher")
    return state["client"]
  yield client
  if state["client"] is not None:
    state["client"].close()


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=st.one_of(attacks.pre_auth(), st.tuples(st.just("post"), bodies)))
def test_fuzz_strangers_and_malformed_calls_are_refused(published, insider, case):
  pub, _, _ = published
  if case[0] == "pre":
    _, kind, data, source = case
    attacks.send_case(pub._server.port, kind, data, source)
  else:
    try:
      out = insider().call(case[1], 0.5, "a fuzzed call")
      assert set(out) <= {"versions", "closed", "keep", "manifest", "tickets", "pending",
                          "children", "upstream", "salt", "chunks", "error", "kind",
                          "member", "head", "parent", "delta", "dense"}, out
    except jax_m2n.ReshardError:
      pass  # refused (an error reply) or held past answer_s: both change nothing
  assert pub._server._thread.is_alive() and pub._server.gate._thread.is_alive()


def test_a_subscriber_connects_and_pulls_during_a_flood(published, gen):
  pub, tree, _ = published
  seconds = 4.0
  floods = [subprocess.Popen(
      [sys.executable, attacks.__file__, "--port", str(pub._server.port), "--kind", kind,
       "--rate", "200", "--seconds", str(seconds), "--source", source],
      stdout=subprocess.PIPE, text=True)
      for kind, source in (("hello", "127.0.0.2"), ("garbage", "127.0.0.3"))]
  try:
    time.sleep(0.5)
    want = jax.device_put(tree["w"], _dst(gen)["w"])
    pulls = 0
    until = time.monotonic() + seconds - 1.0
    while time.monotonic() < until or not pulls:
      with jax_m2n.Subscriber(pub.address, token=TOKEN, timeout_s=10.0) as sub:
        out = sub.pull(_dst(gen), version=1)
      np.testing.assert_array_equal(_bits(out["w"]), _bits(want))
      pulls += 1
    assert all(f.poll() is None for f in floods)  # the floods ran all along
    for f in floods:
      f.communicate(timeout=30)
  finally:
    for f in floods:
      if f.poll() is None:
        f.kill()
  assert pub._server.gate.stats["refused"] > 0


def test_the_publisher_serves_after_the_fuzzer(published, gen):
  pub, tree, _ = published
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    out = sub.pull(_dst(gen), version=1)
  for k in tree:
    np.testing.assert_array_equal(_bits(out[k]), _bits(jax.device_put(tree[k],
                                                                      _dst(gen)[k])))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"keep": 0}, jax_m2n.ReshardValueError, "keep must be an int >= 1; got 0"),
    ({"keep": True}, jax_m2n.ReshardTypeError, "keep must be an int >= 1"),
    ({"encrypt": "yes"}, jax_m2n.ReshardTypeError, "encrypt must be a bool"),
    ({"transport": "nccl"}, jax_m2n.ReshardValueError,
     "transport must be 'net' or 'transfer_server'; got 'nccl'"),
    ({"encrypt": True, "transport": "transfer_server"}, jax_m2n.ReshardValueError,
     "encrypt=True needs transport='net'"),
])
def test_publisher_arguments_are_checked_before_any_port_opens(kwargs, error, match):
  fds = len(os.listdir("/proc/self/fd"))
  with pytest.raises(error, match=match):
    jax_m2n.Publisher(token=TOKEN, **kwargs)
  assert len(os.listdir("/proc/self/fd")) == fds


def test_slow_work_on_the_publisher_never_silences_its_control_thread(published, gen,
                                                                      monkeypatch):
  # Cutting, encoding and offering run on the publisher's worker thread: while one
  # subscriber's request takes 3 s there (a stand-in for a large cut or delta encode),
  # the server thread answers another subscriber's calls at once, and the slow pull
  # still completes bitwise (nobody concludes the publisher died).
  from jax_m2n._src.jobs import offering  # noqa: PLC0415
  _, tree, _ = published
  answer = offering.Offers.answer
  stalled = threading.Event()

  def slow(self, caller, body):
    if not stalled.is_set():
      stalled.set()
      time.sleep(3.0)
    return answer(self, caller, body)

  monkeypatch.setattr(offering.Offers, "answer", slow)
  with jax_m2n.Publisher(token=TOKEN) as pub, jax_m2n.Subscriber(
      pub.address, token=TOKEN) as slow_sub, jax_m2n.Subscriber(
          pub.address, token=TOKEN) as watcher:
    pub.publish(tree)
    got = {}
    puller = threading.Thread(target=lambda: got.update(out=slow_sub.pull(
        _dst(gen), version=1, path="network")))
    puller.start()
    assert stalled.wait(30)
    root = watcher._state.connections.root()
    for _ in range(5):
      start = time.monotonic()
      reply = root.call({"op": "versions", "after": 0, "wait_ms": 0}, 5.0, "versions")
      assert time.monotonic() - start < 0.5 and reply["versions"][0][0] == 1
      time.sleep(0.2)
    puller.join(30)
    assert not puller.is_alive()
    np.testing.assert_array_equal(_bits(got["out"]["w"]), _bits(jax.device_put(
        tree["w"], _dst(gen)["w"])))
