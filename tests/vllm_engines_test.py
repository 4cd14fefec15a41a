"""vLLM's "jax_m2n" weight-transfer backend and JAX arrays as a vLLM WeightSource, driven
through vLLM's own factories (`WeightTransferEngineFactory`, `WeightTransferTrainerFactory`)
and an in-process `VLLMWeightSyncClient` into a torch model on CPU: bitwise, the direct
parameters in place and the fused ones through the model's `load_weights`; the source's
metadata read by vLLM's own checks (ParamMeta, nccl_m2n's source layouts).

Runs where vLLM is installed (requirements/vllm.txt, its own virtual environment:
scripts/test.sh runs this file there when /work/venv-vllm or $JAX_M2N_VLLM_PYTHON is
set up); elsewhere it skips saying so. What of vLLM cannot run on a CPU-only machine:
its own trainer engines (ipc, nccl, nccl_m2n, sharded_rdt need CUDA, NCCL or NIXL), the
the accelerator synchronization of its base `update_weights` (no accelerator), and
its tensor-parallel layers (they need its distributed state on GPUs).
"""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

torch = pytest.importorskip("torch", reason="needs torch (requirements/torch.txt)")
pytest.importorskip("vllm", reason="needs vLLM (requirements/vllm.txt, installed in a "
                    "virtual environment of its own: see scripts/test.sh)")

from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer import (ParamMeta, VLLMWeightSyncClient,  # noqa: E402
                                              WeightTransferEngineFactory,
                                              WeightTransferTrainerFactory, m2n_common)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

from jax_m2n.integrations import vllm as jvllm  # noqa: E402
from jax_m2n.integrations import vllm_engines  # noqa: E402

D, H, V = 16, 8, 32


class TinyModel(torch.nn.Module):
  """A vLLM-style model: plain parameters with vLLM's default loader (resolved
  directly), a fused qkv its load_weights fills from q/k/v."""

  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Parameter(torch.zeros(V, D, dtype=torch.bfloat16),
                                    requires_grad=False)
    self.norm = torch.nn.Parameter(torch.zeros(D), requires_grad=False)
    self.qkv = torch.nn.Parameter(torch.zeros(3 * H, D, dtype=torch.bfloat16),
                                  requires_grad=False)
    self.embed.weight_loader = default_weight_loader
    self.norm.weight_loader = default_weight_loader
    self.loaded: list[str] = []

  def load_weights(self, weights):
    for name, w in weights:
      i = ("q_proj", "k_proj", "v_proj").index(name)
      self.qkv.data[i * H:(i + 1) * H].copy_(w.t())
      self.loaded.append(name)


class InProcessClient:
  """The four methods of vLLM's VLLMWeightSyncClient, calling a worker engine here."""

  def __init__(self, engine):
    self.engine, self.calls = engine, []

  def init_weight_transfer_engine(self, init_info):
    self.calls.append("init")
    self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

  def start_weight_update(self):
    self.calls.append("start")
    self.engine.start_weight_update()

  def update_weights(self, update_info):
    self.calls.append("update")
    self.engine.update_weights(update_info)

  def finish_weight_update(self, weight_version=None):
    self.calls.append(f"finish {weight_version}")
    self.engine.finish_weight_update()


def _tree(seed):
  rng = np.random.default_rng(seed)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  vals = {"embed": rng.standard_normal((V, D), np.float32),
          "norm": rng.standard_normal((D,), np.float32),
          "q_proj": rng.standard_normal((D, H), np.float32),
          "k_proj": rng.standard_normal((D, H), np.float32),
          "v_proj": rng.standard_normal((D, H), np.float32)}
  specs = {"embed": P("a", "b"), "norm": P("b"), "q_proj": P(None, "a"),
           "k_proj": P("b", None), "v_proj": P()}
  return vals, {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in vals.items()}


def _bits(t):
  return t.contiguous().view(torch.uint8).numpy()


def test_both_engines_through_vllms_factories_into_a_torch_model_bitwise():
  jvllm.register()
  jvllm.register()  # idempotent
  model = TinyModel()
  engine = WeightTransferEngineFactory.create_engine(
      WeightTransferConfig(backend="jax_m2n"),
      VllmConfig(device_config=DeviceConfig(device="cpu")), torch.device("cpu"), model)
  assert type(engine).__name__ == "JaxM2NWeightTransferEngine"
  client = InProcessClient(engine)
  assert isinstance(client, VLLMWeightSyncClient)
  vals, tree = _tree(0)
  source = jvllm.source(tree)
  trainer = WeightTransferTrainerFactory.trainer_init(
      vllm_engines.JaxM2NTrainerInitInfo(rank=0), client=client, source=source)
  try:
    for step in range(3):
      if step:
        vals, tree = _tree(step)
        source.update(tree)
      trainer.send_weights()
      assert engine.last["version"] == step + 1
      assert (engine.last["direct"], engine.last["fallback"]) == (2, 3)
      assert engine.last["path"] == "local"
      bf = ml_dtypes.bfloat16
      np.testing.assert_array_equal(_bits(model.embed.data),
                                    vals["embed"].astype(bf).view(np.uint8))
      np.testing.assert_array_equal(model.norm.data.numpy(), vals["norm"])
      qkv = np.ascontiguousarray(np.concatenate([vals[k].T for k in ("q_proj", "k_proj", "v_proj")]))
      np.testing.assert_array_equal(_bits(model.qkv.data), qkv.astype(bf).view(np.uint8))
    assert client.calls == ["init"] + ["start", "update", "finish 1", "start", "update",
                                       "finish 2", "start", "update", "finish 3"]
  finally:
    trainer.shutdown()
    engine.shutdown()


def test_jax_arrays_as_a_weight_source_pass_vllms_own_checks():
  vals, tree = _tree(5)
  source = jvllm.source(tree)
  metas = source.metadata
  assert all(isinstance(m, ParamMeta) for m in metas)
  assert [m.name for m in metas] == sorted(vals) == source.owned_names(0)
  assert source.implements_iter_full() and source.implements_iter_local()
  for m in metas:  # nccl_m2n's reading of a source's layout: one trainer rank, whole
    m2n_common.check_transferable(m.name, m.dtype, m.shape)
    assert m2n_common.expected_local_shape(m2n_common.m2n_param_meta(m, 1)) == m.shape
  for (name, full), (_, local) in zip(source.iter_full(), source.iter_local()):
    np.testing.assert_array_equal(full.numpy(), vals[name])
    assert local.shape == full.shape
  # One buffer (a one-device array) crosses through dlpack without a copy.
  x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(3, 4), jax.devices()[0])
  [(name, t)] = list(jvllm.source({"w": x}).iter_local())
  assert name == "w" and t.data_ptr() == x.unsafe_buffer_pointer()
