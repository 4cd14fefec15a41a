"""jax_m2n.integrations.tunix: install() / uninstall(), and every call shape tunix's
reshard paths make, through tunix's own functions (tunix.rl.reshard.reshard_pytree,
reshard_model_to_mesh, tunix.generate.utils.transfer_state_with_mappings), each
compared with tunix's own jax.device_put fallback (the adapter uninstalled) where that
works. Full-weight GRPO across meshes is in tunix_grpo_test.py."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
pytest.importorskip("tunix", reason="needs google-tunix (the jax_m2n[tunix] extra)")
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from tunix.generate import utils as generate_utils  # noqa: E402
from tunix.rl import reshard as tunix_reshard  # noqa: E402
from tunix.tests import test_common as tc  # noqa: E402

import jax_m2n  # noqa: E402
from jax_m2n.integrations import tunix as m2n_tunix  # noqa: E402

D = jax.devices()
A = Mesh(np.array(D[:4]).reshape(2, 2), ("fsdp", "tp"))  # a trainer: fsdp2 x tp2
B = Mesh(np.array(D[4:]).reshape(1, 4), ("fsdp", "tp"))  # a rollout: tp4, disjoint


@pytest.fixture(autouse=True)
def _uninstalled_after():
  yield
  m2n_tunix.uninstall()


@contextlib.contextmanager
def _tunix_guard():
  """The transfer guard RLCluster.sync_weights runs the weight sync under on CPU."""
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    yield


def _assert_same(out, ref):
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert o.sharding == r.sharding and o.dtype == r.dtype
    if jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key):
      o, r = jax.random.key_data(o), jax.random.key_data(r)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


def test_import_jax_m2n_never_imports_tunix():
  code = ("import sys, jax_m2n, jax_m2n.integrations, jax_m2n.integrations.tunix\n"
          "bad = [m for m in sys.modules if m == 'tunix' or m.startswith('tunix.')]\n"
          "assert not bad, bad\nprint('clean')\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(jax_m2n.__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-2000:]


def test_install_is_idempotent_and_uninstall_restores_tunix():
  original = tunix_reshard._get_reshard_fn_jax_device_put
  pathways = tunix_reshard._get_reshard_fn_pathwaysutils
  assert not m2n_tunix.is_installed()
  m2n_tunix.install()
  hook = tunix_reshard._get_reshard_fn_jax_device_put
  assert hook is not original and m2n_tunix.is_installed()
  m2n_tunix.install()
  assert tunix_reshard._get_reshard_fn_jax_device_put is hook
  assert tunix_reshard._get_reshard_fn_pathwaysutils is pathways
  m2n_tunix.uninstall()
  assert tunix_reshard._get_reshard_fn_jax_device_put is original
  assert not m2n_tunix.is_installed()
  m2n_tunix.uninstall()  # no-op
  assert tunix_reshard._get_reshard_fn_jax_device_put is original


def test_pathways_stays_first(monkeypatch):
  """Where Pathways loads, tunix uses it and never reaches jax_m2n. Pathways needs TPU
  cloud: a factory that loads stands in for pathwaysutils here."""
  moved = []

  def pathways_factory(**kwargs):
    del kwargs
    return lambda x, shardings: moved.append("pathways") or x

  m2n_tunix.install()
  monkeypatch.setattr(tunix_reshard, "_get_reshard_fn_pathwaysutils", pathways_factory)
  x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(A, P("fsdp")))
  before = m2n_tunix.reshard_count()
  tunix_reshard.reshard_pytree(x, NamedSharding(B, P("tp")))
  assert moved == ["pathways"] and m2n_tunix.reshard_count() == before
  monkeypatch.undo()  # Pathways absent again (it raises ImportError): jax_m2n
  out = tunix_reshard.reshard_pytree(x, NamedSharding(B, P("tp")))
  assert m2n_tunix.reshard_count() == before + 1
  _assert_same(out, jax.device_put(x, NamedSharding(B, P("tp"))))


def test_install_without_tunix_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "tunix.rl.reshard", None)  # import fails
  with pytest.raises(ImportError, match=r"jax_m2n\[tunix\]"):
    m2n_tunix.install()
  assert not m2n_tunix.is_installed()


def _params():
  rng = np.random.default_rng(1)
  return {
      "w": jax.device_put(rng.standard_normal((16, 32), np.float32),
                          NamedSharding(A, P("fsdp", "tp"))),
      "b": jax.device_put(rng.standard_normal(32).astype(jnp.bfloat16),
                          NamedSharding(A, P("tp"))),
      "emb": jax.device_put(rng.standard_normal((64, 16), np.float32),
                            NamedSharding(A, P(None, "fsdp"))),
  }


def _dst():
  return {"w": NamedSharding(B, P(None, "tp")), "b": NamedSharding(B, P()),
          "emb": NamedSharding(B, P("tp"))}


def _both(fn):
  """fn() with tunix's device_put fallback, then with jax_m2n installed."""
  m2n_tunix.uninstall()
  ref = jax.block_until_ready(fn())
  m2n_tunix.install()
  before = m2n_tunix.reshard_count()
  out = jax.block_until_ready(fn())
  assert m2n_tunix.reshard_count() > before, "the call did not reach jax_m2n"
  return out, ref


@pytest.mark.parametrize("target_kind", ["shardings", "arrays"])
def test_reshard_pytree_targets_as_shardings_or_arrays(target_kind):
  src = _params()
  if target_kind == "shardings":
    target = _dst()
  else:  # tunix's update_params passes the rollout's own arrays as the target
    target = jax.tree.map(lambda a, s: jax.device_put(jnp.zeros_like(a), s), src, _dst())
  out, ref = _both(lambda: tunix_reshard.reshard_pytree(src, target))
  _assert_same(out, ref)


def test_reshard_pytree_under_tunixs_guard_where_device_put_fails():
  src, dst = _params(), _dst()
  with _tunix_guard(), pytest.raises(jax.errors.JaxRuntimeError,
                                     match="Disallowed host-to-device"):
    jax.block_until_ready(tunix_reshard.reshard_pytree(src, dst))
  m2n_tunix.install()
  with _tunix_guard():
    out = jax.block_until_ready(tunix_reshard.reshard_pytree(src, dst))
  _assert_same(out, jax.device_put(src, dst))


def test_flat_dict_keyed_by_tuple_paths():
  src = {("layers", 0, "w"): _params()["w"], ("layers", 1, "w"): _params()["w"] * 2,
         ("lm_head", "kernel"): _params()["emb"]}
  dst = {("layers", 0, "w"): NamedSharding(B, P("tp")),
         ("layers", 1, "w"): NamedSharding(B, P(None, "tp")),
         ("lm_head", "kernel"): NamedSharding(B, P())}
  out, ref = _both(lambda: tunix_reshard.reshard_pytree(src, dst))
  assert set(out) == set(src)
  _assert_same(out, ref)


def test_typed_prng_keys_move_device_to_device_under_the_guard():
  keys = jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(A, P("fsdp")))
  src = {"rngs": keys, "w": _params()["w"]}
  dst = {"rngs": NamedSharding(B, P("tp")), "w": NamedSharding(B, P(None, "tp"))}
  ref = jax.device_put(src, dst)
  m2n_tunix.install()
  with _tunix_guard():  # device_put moves keys between layouts through host memory
    out = jax.block_until_ready(tunix_reshard.reshard_pytree(src, dst))
  assert jax.random.key_impl(out["rngs"]) == jax.random.key_impl(keys)
  _assert_same(out, ref)
  # A key leaf on one device, and one whose layout is kept, through jax_m2n as well.
  single = jax.device_put(jax.random.key(5), D[1])
  out = m2n_tunix.reshard({"k": single, "keep": keys}, {"k": D[6], "keep": None})
  _assert_same(out, jax.device_put({"k": single, "keep": keys}, {"k": D[6], "keep": None}))


def test_pinned_host_destinations_are_delegated_as_device_put():
  src = _params()
  dst = jax.tree.map(lambda s: NamedSharding(s.mesh, s.spec, memory_kind="pinned_host"),
                     _dst())
  out, ref = _both(lambda: tunix_reshard.reshard_pytree(src, dst))
  assert all(a.sharding.memory_kind == "pinned_host" for a in jax.tree.leaves(out))
  _assert_same(out, ref)


def test_donate_input():
  ref = jax.device_put(_params(), _dst())
  src = _params()
  m2n_tunix.install()
  out = tunix_reshard.reshard_pytree(src, _dst(), donate_input=True)
  assert all(a.is_deleted() for a in jax.tree.leaves(src))
  _assert_same(out, ref)


def test_reshard_model_to_mesh():
  def load():
    model = tc.ToyTransformer(config=tc.ModelConfig(vocab_size=64), rngs=nnx.Rngs(0))
    model = tunix_reshard.reshard_model_to_mesh(model, A)  # from device 0 to mesh A
    model = tunix_reshard.reshard_model_to_mesh(model, B)  # A -> B: jax_m2n's path
    return nnx.state(model)

  out, ref = _both(load)
  _assert_same(out, ref)
  assert all(a.sharding.mesh == B for a in jax.tree.leaves(out))


class _Trainer(nnx.Module):
  """Source parameters as a trainer names them (one transposed against the rollout)."""

  def __init__(self):
    rng = np.random.default_rng(2)
    put = lambda shape, spec: jax.device_put(  # noqa: E731
        rng.standard_normal(shape, np.float32), NamedSharding(A, spec))
    self.attn_q = nnx.Param(put((16, 32), P("fsdp", "tp")))
    self.mlp_up = nnx.Param(put((16, 64), P(None, "tp")))
    self.mlp_down = nnx.Param(put((64, 16), P("tp", "fsdp")))
    self.norm = nnx.Param(put((16,), P("fsdp")))


class _Rollout(nnx.Module):
  """The same weights as a rollout engine names and lays them out on mesh B."""

  def __init__(self):
    put = lambda shape, spec: jax.device_put(  # noqa: E731
        np.zeros(shape, np.float32), NamedSharding(B, spec))
    self.q_proj = nnx.Param(put((32, 16), P("tp")))  # attn_q transposed
    self.up_proj = nnx.Param(put((16, 64), P(None, "tp")))
    self.down_proj = nnx.Param(put((64, 16), P("tp")))
    self.scale = nnx.Param(put((16,), P()))


MAPPINGS = {"attn_q": ("q_proj", None), "mlp_up": ("up_proj", None),
            "mlp_down": ("down_proj", None), "norm": ("scale", None)}


@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_transfer_state_with_mappings(chunk):
  """Key mappings, a transpose, the flat-dict reshard and its chunks
  (reshard_chunk_size): one reshard call per chunk, equal to device_put's result."""
  src = nnx.state(_Trainer())
  kwargs = {} if chunk is None else {"reshard_chunk_size": chunk}

  def transfer():
    dst = nnx.state(_Rollout())
    return generate_utils.transfer_state_with_mappings(
        src, dst, MAPPINGS, transpose_keys={"attn_q": (1, 0)},
        reshard_fn=tunix_reshard.reshard_pytree, **kwargs)

  before = m2n_tunix.reshard_count()
  out, ref = _both(transfer)
  calls = m2n_tunix.reshard_count() - before
  assert calls == (1 if chunk is None else -(-len(MAPPINGS) // chunk))
  _assert_same(out, ref)
  np.testing.assert_array_equal(np.asarray(out["q_proj"][...]),
                                np.asarray(src["attn_q"][...]).T)
  assert out["q_proj"][...].sharding == NamedSharding(B, P("tp"))


def test_transfer_state_with_mappings_under_tunixs_guard():
  src = nnx.state(_Trainer())
  ref = generate_utils.transfer_state_with_mappings(
      src, nnx.state(_Rollout()), MAPPINGS, transpose_keys={"attn_q": (1, 0)},
      reshard_fn=tunix_reshard.reshard_pytree, reshard_chunk_size=2)
  m2n_tunix.install()
  dst = nnx.state(_Rollout())
  with _tunix_guard():
    out = generate_utils.transfer_state_with_mappings(
        src, dst, MAPPINGS, transpose_keys={"attn_q": (1, 0)},
        reshard_fn=tunix_reshard.reshard_pytree, reshard_chunk_size=2)
    jax.block_until_ready(out)
  _assert_same(out, ref)


def test_errors_are_jax_m2ns_before_data_moves():
  m2n_tunix.install()
  src = _params()
  bad = dict(_dst(), w=NamedSharding(B, P("tp", "fsdp", None)))  # rank 3 for a matrix
  with pytest.raises(jax_m2n.ReshardError):
    tunix_reshard.reshard_pytree(src, bad)
  assert not any(a.is_deleted() for a in jax.tree.leaves(src))
