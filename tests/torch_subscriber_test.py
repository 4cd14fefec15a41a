"""jax_m2n.torch.Subscriber: a JAX Publisher's versions pulled into torch tensors.

Bitwise against `x.astype(dtype)` of the published x, sliced as the rank's placement
says, over random trainer layouts, Shard / Replicate / Slice placements over 1, 2 and 4
ranks, dtypes (float32, bfloat16, float16, int8, with the float conversions), fused
q/k/v and gate/up and transposes, on both data paths (the local export; the network);
each rank receives only its bytes. Errors before any tensor is written: a wrong token,
a missing or extra name, a shape or dtype that does not fit. A publisher killed
mid-pull fails the pull within 2 s naming the tensors written; a torch subscriber
killed mid-pull harms nobody.
"""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

torch = pytest.importorskip("torch", reason="jax_m2n.torch needs torch "
                            "(requirements/torch.txt)")

import jax_m2n  # noqa: E402
import jax_m2n.torch as jt  # noqa: E402
from jax_m2n._src.jobs import engine  # noqa: E402

TOKEN = "torch-test-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = ml_dtypes.bfloat16


def _bits(x):
  if isinstance(x, torch.Tensor):
    x = x.contiguous().view(torch.uint8).numpy() if x.dim() else x.reshape(1).view(
        torch.uint8).numpy()
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _split(x, dim, rank, world):
  n = x.shape[dim] // world
  return np.take(x, range(rank * n, rank * n + n), axis=dim)


@pytest.fixture(scope="module")
def trainer():
  devs = np.array(jax.devices()[:4])
  return Mesh(devs.reshape(2, 2), ("a", "b"))


def _model(rng, trainer):
  """A small transformer-shaped pytree in JAX's (in, out) convention, with random
  trainer shardings, and the numpy values."""
  d, h, f, v = 16, 8, 32, 24
  leaves = {
      "embed": ((v, d), np.float32), "norm": ((d,), BF16),
      "layers": {"0": {"wq": ((d, h), np.float32), "wk": ((d, h), np.float32),
                       "wv": ((d, h), np.float32), "wo": ((h, d), np.float16),
                       "gate": ((d, f), BF16), "up": ((d, f), BF16),
                       "down": ((f, d), np.float32), "scale": ((4, 8), np.int8)}}}
  values, arrays = {}, {}

  def make(path, shape, dtype):
    if np.dtype(dtype) == np.int8:
      x = rng.integers(-128, 128, shape).astype(np.int8)
    else:
      x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    spec = P(*[("a", "b", None)[int(rng.integers(3))] if i < 2 else None
               for i in range(len(shape))])
    if len(shape) == 2 and spec[0] == spec[1] and spec[0] is not None:
      spec = P(spec[0], None)
    values[path] = x
    return jax.device_put(x, NamedSharding(trainer, spec))

  layer = {k: make(f"layers.0.{k}", *sd) for k, sd in leaves["layers"]["0"].items()}
  tree = {"embed": make("embed", *leaves["embed"]), "norm": make("norm", *leaves["norm"]),
          "layers": {"0": layer}}
  return tree, values


NAMES = {"embed": "embed.weight", "norm": "norm.weight",
         "layers.0.wq": jt.Into("qkv.weight", 0, 3, 0, transpose=True),
         "layers.0.wk": jt.Into("qkv.weight", 1, 3, 0, transpose=True),
         "layers.0.wv": jt.Into("qkv.weight", 2, 3, 0, transpose=True),
         "layers.0.wo": jt.Into("o.weight", transpose=True),
         "layers.0.gate": jt.Into("gate_up.weight", 0, 2, 0, transpose=True),
         "layers.0.up": jt.Into("gate_up.weight", 1, 2, 0, transpose=True),
         "layers.0.down": jt.Into("down.weight", transpose=True),
         "layers.0.scale": "scale"}
PLACEMENTS = {"embed.weight": jt.Shard(0), "norm.weight": jt.Replicate(),
              "qkv.weight": jt.Shard(0), "o.weight": jt.Shard(1),
              "gate_up.weight": jt.Shard(0), "down.weight": jt.Shard(1),
              "scale": jt.Slice((1, 2), (2, 4))}
DTYPES = {"embed.weight": torch.bfloat16, "norm.weight": torch.float32,
          "qkv.weight": torch.bfloat16, "o.weight": torch.float16,
          "gate_up.weight": torch.float32, "down.weight": torch.float16,
          "scale": torch.int8}


def _want(values, rank, world):
  """What rank `rank` of `world` must hold, by numpy (vLLM's conventions)."""
  np_of = {torch.bfloat16: BF16, torch.float32: np.float32, torch.float16: np.float16,
           torch.int8: np.int8}
  v = values
  out = {
      "embed.weight": _split(v["embed"], 0, rank, world),
      "norm.weight": v["norm"],
      "qkv.weight": np.concatenate([_split(v[f"layers.0.{k}"].T, 0, rank, world)
                                    for k in ("wq", "wk", "wv")]),
      "o.weight": _split(v["layers.0.wo"].T, 1, rank, world),
      "gate_up.weight": np.concatenate([_split(v[f"layers.0.{k}"].T, 0, rank, world)
                                        for k in ("gate", "up")]),
      "down.weight": _split(v["layers.0.down"].T, 1, rank, world),
      "scale": v["layers.0.scale"][1:3, 2:6]}
  return {k: x.astype(np_of[DTYPES[k]]) for k, x in out.items()}


@pytest.mark.parametrize("path", ["local", "network"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tp_ranks_bitwise_each_receiving_only_its_bytes(trainer, path, seed):
  rng = np.random.default_rng(seed)
  tree, values = _model(rng, trainer)
  with jax_m2n.Publisher(token=TOKEN) as pub:
    pub.publish(tree)
    for world in (1, 2, 4):
      got_bytes = []
      for rank in range(world):
        want = _want(values, rank, world)
        tensors = {k: torch.full(w.shape, 7, dtype=DTYPES[k]) for k, w in want.items()}
        with jt.Subscriber(pub.address, token=TOKEN, rank=rank, world_size=world) as sub:
          assert sub.pull_into(tensors, names=NAMES.get, placements=PLACEMENTS,
                               path=path, timeout_s=60) == 1
          assert sub.last_pull.path == path
          got_bytes.append(sub.last_pull.nbytes)
        for k, w in want.items():
          np.testing.assert_array_equal(_bits(tensors[k]), _bits(w), err_msg=k)
      # Each rank receives only its slices: the sharded targets split over the ranks,
      # the replicated one (norm) and the Slice (scale) arrive whole on every rank.
      wire = {"embed.weight": 2, "norm.weight": 2, "qkv.weight": 2, "o.weight": 2,
              "gate_up.weight": 2, "down.weight": 2, "scale": 1}
      per_rank = sum(w.size * wire[k] for k, w in _want(values, 0, world).items())
      assert got_bytes == [per_rank] * world


def test_pull_and_iter_pull_make_new_tensors_in_the_published_dtypes(trainer):
  tree, values = _model(np.random.default_rng(3), trainer)
  with jax_m2n.Publisher(token=TOKEN) as pub, jt.Subscriber(pub.address,
                                                             token=TOKEN) as sub:
    pub.publish(tree)
    out = sub.pull(timeout_s=60)
    assert sorted(out) == sorted(values)
    for k, x in values.items():
      np.testing.assert_array_equal(_bits(out[k]), _bits(x), err_msg=k)
    pub.publish(tree)
    pairs = list(sub.iter_pull(names=lambda p: p if p.startswith("layers") else None,
                               dtype=torch.float32 if False else None, timeout_s=60))
    assert sub.version == 2 and {n for n, _ in pairs} == {
        k for k in values if k.startswith("layers")}


def test_a_wrong_token_is_refused_when_the_subscriber_is_made(trainer):
  with jax_m2n.Publisher(token=TOKEN) as pub:
    with pytest.raises(jax_m2n.ReshardValueError, match="token"):
      jt.Subscriber(pub.address, token="another-token-0123456789")
    with pytest.raises(jax_m2n.ReshardValueError, match="rank"):
      jt.Subscriber(pub.address, token=TOKEN, rank=2, world_size=2)


@pytest.mark.parametrize("case", ["extra", "missing", "shape", "dtype", "outside"])
def test_bad_targets_are_one_error_naming_the_parameter_before_any_write(trainer, case):
  tree, values = _model(np.random.default_rng(4), trainer)
  want = _want(values, 0, 2)
  tensors = {k: torch.full(w.shape, 7, dtype=DTYPES[k]) for k, w in want.items()}
  names, placements = dict(NAMES), dict(PLACEMENTS)
  if case == "extra":  # a target nothing maps into
    tensors["lm_head.weight"] = torch.zeros(3)
    match = "lm_head.weight"
  elif case == "missing":  # a name the mapping gives that is not a target
    names["norm"] = "final_norm.weight"
    tensors["final_norm.weight"] = tensors.pop("norm.weight")
    names["embed"] = "tok_embeddings.weight"
    match = "tok_embeddings.weight"
  elif case == "shape":
    tensors["o.weight"] = torch.zeros(16, 8, dtype=torch.float16)  # not rank 0's slice
    match = "o.weight"
  elif case == "dtype":
    tensors["scale"] = torch.zeros(2, 4, dtype=torch.float32)  # int8 -> float: refused
    match = "scale"
  else:
    placements["scale"] = jt.Slice((3, 0), (2, 8))  # rows 3..5 of 4
    match = "scale"
  before = {k: x.clone() for k, x in tensors.items()}
  with jax_m2n.Publisher(token=TOKEN) as pub:
    pub.publish(tree)
    with jt.Subscriber(pub.address, token=TOKEN, rank=0, world_size=2) as sub:
      with pytest.raises(jax_m2n.ReshardError, match=match) as e:
        sub.pull_into(tensors, names=names.get, placements=placements, timeout_s=60)
      assert isinstance(e.value, (jax_m2n.ReshardValueError, jax_m2n.ReshardTypeError))
      assert sub.version == 0
  for k, x in tensors.items():
    assert torch.equal(x, before[k]), k  # nothing written


_PUBLISHER = textwrap.dedent("""
    import os, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np, jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d, leaves = sys.argv[1], int(sys.argv[3])
    mesh = Mesh(np.array(jax.devices()), ("a",))
    pub = jax_m2n.Publisher(token=sys.argv[2], keep=2)
    x = jax.device_put(np.arange(1 << 18, dtype=np.float32).reshape(512, 512),
                       NamedSharding(mesh, P("a")))
    v = 0
    while True:
      v = pub.publish({f"w{i}": x + v for i in range(leaves)})
      if v == 1:
        with open(d + "/addr.tmp", "w") as f:
          f.write(pub.address)
        os.replace(d + "/addr.tmp", d + "/addr")
      time.sleep(0.05)
""")


def _start_publisher(d, leaves):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, d, TOKEN, str(leaves)], env=env)
  deadline = time.monotonic() + 120
  while not os.path.exists(d + "/addr"):
    assert p.poll() is None and time.monotonic() < deadline, "the publisher died"
    time.sleep(0.05)
  return p, open(d + "/addr").read()


def test_a_publisher_killed_mid_pull_fails_it_within_2s_naming_what_was_written(
    monkeypatch):
  p, address = _start_publisher(tempfile.mkdtemp(), 8)
  killed = []
  request = engine.request

  def kill_once_the_pull_is_sent(*args):  # the bytes have not crossed yet
    got = request(*args)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    killed.append(time.monotonic())
    return got

  try:
    with jt.Subscriber(address, token=TOKEN, timeout_s=3) as sub:
      tensors = {f"w{i}": torch.zeros(512, 512) for i in range(8)}
      sub.pull_into(tensors, path="network", timeout_s=30)  # the plan registered
      v = sub.version
      for k, x in tensors.items():
        np.testing.assert_array_equal(
            x.numpy(), np.arange(1 << 18, dtype=np.float32).reshape(512, 512) + v - 1)
      monkeypatch.setattr(engine, "request", kill_once_the_pull_is_sent)
      with pytest.raises(jax_m2n.ReshardRuntimeError, match="written") as e:
        sub.pull_into(tensors, path="network", timeout_s=30)
      assert time.monotonic() - killed[0] < 2.0
      assert e.value.written == [] and "none" in str(e.value)
      assert "trainer process 0" in str(e.value) or "publisher" in str(e.value)
      assert sub.version == v
      with pytest.raises(jax_m2n.ReshardRuntimeError):  # and the next pull too (it
        sub.pull_into(tensors, timeout_s=30)  # reconnects: the handshake's timeout_s)
  finally:
    if p.poll() is None:
      p.kill()


_SUBSCRIBER = textwrap.dedent("""
    import sys
    import torch, jax_m2n.torch as jt
    sub = jt.Subscriber(sys.argv[1], token=sys.argv[2])
    tensors = {f"w{i}": torch.zeros(512, 512, dtype=torch.bfloat16) for i in range(4)}
    while True:
      sub.pull_into(tensors, timeout_s=30, path=sys.argv[3])
      print("pulled", sub.version, flush=True)
""")


@pytest.mark.parametrize("path", ["local", "network"])
def test_a_torch_subscriber_killed_mid_pull_harms_nobody(path):
  p, address = _start_publisher(tempfile.mkdtemp(), 4)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  victim = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, address, TOKEN, path],
                            env=env, stdout=subprocess.PIPE, text=True)
  try:
    for _ in range(3):
      assert victim.stdout.readline().startswith("pulled")
    victim.send_signal(signal.SIGKILL)  # most likely inside a pull: it loops on them
    victim.wait(timeout=30)
    with jt.Subscriber(address, token=TOKEN) as sub:
      for _ in range(2):
        out = sub.pull(path=path, timeout_s=30)
        want = np.arange(1 << 18, dtype=np.float32).reshape(512, 512) + sub.version - 1
        for x in out.values():
          np.testing.assert_array_equal(x.numpy(), want)
    assert p.poll() is None  # the publisher still publishes
  finally:
    for q in (victim, p):
      if q.poll() is None:
        q.kill()
        q.wait()


def test_importing_jax_m2n_imports_no_torch():
  code = "import sys, jax_m2n; print('torch' in sys.modules, 'vllm' in sys.modules)"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, check=True).stdout.split()
  assert out == ["False", "False"]
