"""The jobs control plane against a live Publisher in this process (8 CPU devices: the
publisher on 0-3, a subscriber on 4-7): a fuzzer (hypothesis) of malformed, oversized,
unauthenticated, forged, replayed and out-of-order messages, each refused while the
publisher keeps serving; the token (challenge-response, never sent, wrong token an
error on the subscriber); loopback by default; dst / dtype / version errors raised
before any byte moves; pulls bitwise against jax.device_put, Quantize as reshard's."""

import json
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import auth, engine, messages
from doctest_test import run_docstring_examples

TOKEN = "protocol-test-token"


@pytest.fixture(scope="module")
def published():
  old = messages.MAX_MESSAGE_BYTES
  messages.MAX_MESSAGE_BYTES = 1 << 20  # the server's zmq limit: oversized tests stay small
  try:
    pub = jax_m2n.Publisher(token=TOKEN, keep=2)
  finally:
    messages.MAX_MESSAGE_BYTES = old
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


def test_quantize_matches_reshard(published, gen):
  pub, tree, _ = published
  spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 8})
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    out = sub.pull(_dst(gen), dtype={"w": spec, "b": None, "n": None}, version=1)
  want = jax_m2n.reshard(tree["w"], _dst(gen)["w"], dtype=spec)
  np.testing.assert_array_equal(_bits(out["w"].qvalue), _bits(want.qvalue))
  np.testing.assert_array_equal(_bits(out["w"].scale), _bits(want.scale))


def test_wrong_token_is_an_error_on_the_subscriber(published):
  pub, _, _ = published
  with pytest.raises(jax_m2n.ReshardValueError, match="token"):
    jax_m2n.Subscriber(pub.address, token="not-the-token")
  with pytest.raises(jax_m2n.ReshardTypeError, match="token"):
    jax_m2n.Subscriber(pub.address, token=1234)


def test_the_token_never_travels(published, monkeypatch):
  pub, _, _ = published
  sent = []
  real = zmq.Socket.send

  def spy(self, data, *a, **k):
    sent.append(bytes(data))
    return real(self, data, *a, **k)
  monkeypatch.setattr(zmq.Socket, "send", spy)
  jax_m2n.Subscriber(pub.address, token=TOKEN).close()
  assert sent and not any(TOKEN.encode() in s for s in sent)
  assert not any(TOKEN.encode().hex().encode() in s for s in sent)


def test_bad_arguments_fail_before_any_byte_moves(published, gen):
  pub, tree, _ = published
  before = dict(engine.stats)
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    with pytest.raises(jax_m2n.ReshardValueError, match="prefix"):
      sub.pull({"w": _dst(gen)["w"], "b": _dst(gen)["b"]}, version=1)  # "n" missing
    with pytest.raises(jax_m2n.ReshardValueError, match="name no published leaf"):
      sub.pull({**_dst(gen), "extra": _dst(gen)["b"]}, version=1)
    with pytest.raises(jax_m2n.ReshardValueError, match="published shape"):
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
# The fuzzer
# ---------------------------------------------------------------------------------------

class Raw:
  """A raw DEALER socket to the publisher: frames in, the reply (or None) out."""

  def __init__(self, address):
    self.sock = zmq.Context.instance().socket(zmq.DEALER)
    self.sock.setsockopt(zmq.LINGER, 0)
    self.sock.connect(f"tcp://{address}")

  def send(self, *frames, wait_s=1.0):
    self.sock.send_multipart(list(frames))
    if self.sock.poll(int(wait_s * 1000)):
      return json.loads(self.sock.recv())
    return None

  def close(self):
    self.sock.close(0)


def _handshake(raw, token=TOKEN):
  """A session done by hand: (session, session key)."""
  mine = auth.nonce()
  c = raw.send(messages.encode({"m2n": 1, "type": "hello", "nonce": mine.hex()}))
  theirs, session = bytes.fromhex(c["nonce"]), bytes.fromhex(c["session"])
  key = token.encode()
  w = raw.send(messages.encode({"m2n": 1, "type": "auth", "session": session.hex(),
                                "proof": auth.client_proof(key, mine, theirs,
                                                           session).hex()}))
  assert w["type"] == "welcome", w
  return session, auth.session_key(key, mine, theirs, session)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

bodies = st.fixed_dictionaries({"op": st.sampled_from(
    ["versions", "manifest", "pieces", "bye", "nope", ""])}, optional={
        "after": json_values, "wait_ms": json_values, "id": json_values,
        "version": json_values, "wire": json_values, "groups": json_values,
        "timeout_ms": json_values})


@st.composite
def attacks(draw):
  kind = draw(st.sampled_from(["bytes", "json", "hello", "auth", "sealed_forged",
                               "sealed_body", "replay", "frames", "oversized",
                               "deep"]))
  return kind, draw(st.binary(max_size=200)), draw(json_values), draw(bodies)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(attack=attacks())
def test_fuzz_malformed_oversized_out_of_order_messages_are_refused(published, attack):
  pub, _, _ = published
  kind, blob, value, body = attack
  server = pub._server
  refused = server.refused
  raw = Raw(pub.address)
  try:
    if kind == "bytes":
      reply = raw.send(blob)
      assert reply is None or reply["type"] == "error" or kind  # never a welcome
      assert reply is not None and reply["type"] == "error"
    elif kind == "json":
      reply = raw.send(json.dumps(value).encode())
      assert reply["type"] == "error"
    elif kind == "hello":  # a hello with a bad nonce, or a good one: never a session
      msg = {"m2n": 1, "type": "hello", "nonce": value}
      reply = raw.send(json.dumps(msg).encode())
      assert reply["type"] == "error"
    elif kind == "auth":  # no hello, or a proof made without the token
      c = raw.send(messages.encode({"m2n": 1, "type": "hello",
                                    "nonce": auth.nonce().hex()}))
      reply = raw.send(messages.encode({"m2n": 1, "type": "auth", "session": c["session"],
                                        "proof": secrets.token_hex(32)}))
      assert reply["type"] == "error" and "token" in reply["message"]
    elif kind == "sealed_forged":  # a real session, a body sealed with another key
      session, _ = _handshake(raw)
      reply = raw.send(auth.seal(secrets.token_bytes(32), session, auth.TO_SERVER, 1, body))
      assert reply["type"] == "error" and "MAC" in reply["message"]
    elif kind == "sealed_body":  # a properly sealed but malformed call
      session, key = _handshake(raw)
      reply = raw.send(auth.seal(key, session, auth.TO_SERVER, 1, body), wait_s=2.0)
      if body["op"] == "bye":
        assert reply is None
      elif reply["type"] == "sealed":
        _, out = auth.open_sealed(key, auth.TO_CLIENT, reply)
        assert set(out) <= {"versions", "closed", "keep", "manifest", "uuids", "error",
                            "kind"}
      else:
        assert reply["type"] == "error"
    elif kind == "replay":  # the same seq twice, then an older one: refused
      session, key = _handshake(raw)
      call = {"op": "versions", "after": 0, "wait_ms": 0}
      first = raw.send(auth.seal(key, session, auth.TO_SERVER, 5, call))
      assert first["type"] == "sealed"
      for seq in (5, 4):
        reply = raw.send(auth.seal(key, session, auth.TO_SERVER, seq, call))
        assert reply["type"] == "error" and "seq" in reply["message"]
    elif kind == "frames":  # several frames in one message
      reply = raw.send(blob or b"x", blob + b"y")
      assert reply["type"] == "error"
    elif kind == "oversized":  # past zmq's limit: the connection is dropped, no reply
      reply = raw.send(b"x" * ((1 << 20) + 1), wait_s=0.3)
      assert reply is None
    elif kind == "deep":
      reply = raw.send(b"[" * 100000 + b"]" * 100000)
      assert reply["type"] == "error"
  finally:
    raw.close()
  assert server.refused >= refused  # counted, never crashed
  assert pub._server._thread.is_alive()


def test_the_publisher_serves_after_the_fuzzer(published, gen):
  pub, tree, _ = published
  with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
    out = sub.pull(_dst(gen), version=1)
  np.testing.assert_array_equal(_bits(out["w"]), _bits(jax.device_put(tree["w"],
                                                                       _dst(gen)["w"])))
