"""vLLM's "jax_m2n" weight-transfer backend, and JAX arrays as a vLLM `WeightSource`.

Owns three classes built on vLLM's `vllm.distributed.weight_transfer` API (imported
here at the top: vLLM loads this module only when it makes one of them, after
`jax_m2n.integrations.vllm.register()`):
- `JaxM2NWeightTransferEngine` (worker side): `receive_weights` pulls a version from a
  `jax_m2n.Publisher` into the worker's model with `jax_m2n.torch.Subscriber`: this TP
  rank's slice straight into a parameter where vLLM's own destination resolution
  (`m2n_layout.resolve_parameter_destinations`, nccl_m2n's) says the name maps to one
  directly, else the whole tensor through the model's `load_weights`.
- `JaxM2NTrainerWeightTransferEngine` (trainer side): publishes the source's JAX pytree
  and drives start / update / finish through the `VLLMWeightSyncClient`.
- `JaxWeightSource`: a JAX pytree as a `WeightSource` (metadata and placements from the
  shardings; tensors through dlpack), for vLLM's own trainer engines too.
Moves bytes only through jax_m2n's Publisher and torch Subscriber.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Iterator

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from vllm.distributed.weight_transfer.base import (ParamMeta, Replicate, Shard,
                                                   TrainerInitInfo,
                                                   TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer import m2n_common, m2n_layout

import jax_m2n
import jax_m2n.torch as jt
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.torch.targets import TORCH_OF

_API = "jax_m2n.integrations.vllm"


def _dotted_paths(tree: Any) -> tuple[list[str], list[Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return ([jt.dotted(manifest_lib.key_path(p)) for p, _ in flat], [x for _, x in flat])


class JaxWeightSource(WeightSource):
  """A JAX pytree (e.g. {"model.layers.0.self_attn.q_proj.weight": jax.Array, ...}) as
  a vLLM `WeightSource`. Names: each leaf's dotted key path (or `names(path)`).

  Metadata: in a one-process trainer every parameter is owned by rank 0 whole
  (`owners=None`); in a `jax.distributed` trainer with one device per process, owned
  by the processes in mesh order with one `Shard(dim)` / `Replicate()` per mesh axis
  (from the NamedSharding's spec). `iter_local` yields this process's piece, `iter_full`
  the whole tensor: through dlpack without a copy where it is one buffer (a one-device
  array, a process's shard), else gathered (one host copy; a collective across
  processes).
  """

  def __init__(self, tree: Any, names: Any = None):
    paths, leaves = _dotted_paths(tree)
    self.names = [names(p) if names else p for p in paths]
    self.arrays = leaves
    self.tree = tree

  def update(self, tree: Any) -> None:
    """The trainer's new arrays (the same names, shapes, dtypes and shardings: the
    metadata does not change); the next `send_weights` publishes them."""
    paths, leaves = _dotted_paths(tree)
    if len(leaves) != len(self.arrays) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(leaves, self.arrays)):
      raise jax_m2n.ReshardValueError(f"{_API}: update must keep every leaf's shape and "
                                      "dtype; got another tree.")
    self.arrays, self.tree = leaves, tree

  @functools.cached_property
  def metadata(self) -> list[ParamMeta]:
    return [self._meta(n, a) for n, a in zip(self.names, self.arrays)]

  def _meta(self, name: str, a: jax.Array) -> ParamMeta:
    dtype = TORCH_OF[np.dtype(a.dtype)]
    if jax.process_count() == 1:
      return ParamMeta(name, dtype, tuple(a.shape))
    s = a.sharding
    if not isinstance(s, NamedSharding) or len(s.addressable_devices) != 1:
      raise jax_m2n.ReshardValueError(
          f"{_API}: a multi-process trainer's array must be a NamedSharding with one "
          f"device per process; got {type(s).__name__} for {name!r}.")
    mesh = s.mesh
    placements = []
    for axis in mesh.axis_names:
      dim = next((d for d, e in enumerate(s.spec) if e == axis or (
          isinstance(e, tuple) and axis in e)), None)
      placements.append(Replicate() if dim is None else Shard(dim))
    return ParamMeta(name, dtype, tuple(a.shape),
                     owners=tuple(d.process_index for d in mesh.devices.flat),
                     mesh_shape=tuple(mesh.devices.shape), placements=tuple(placements))

  def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
    for name, a in zip(self.names, self.arrays):
      yield name, _full(a)

  def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
    for name, a in zip(self.names, self.arrays):
      if jax.process_count() == 1:
        yield name, _full(a)
      else:
        yield name, torch.from_dlpack(a.addressable_shards[0].data)


def _full(a: jax.Array) -> torch.Tensor:
  if len(a.sharding.device_set) == 1:
    return torch.from_dlpack(a)  # no copy
  if a.is_fully_addressable:
    return torch.from_numpy(np.array(a))  # (a writable copy: torch wants one)
  from jax.experimental import multihost_utils
  return torch.from_numpy(np.array(multihost_utils.process_allgather(a, tiled=True)))


# ---------------------------------------------------------------------------------------
# The worker side
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class JaxM2NInitInfo(WeightTransferInitInfo):
  """The worker's init info: the Publisher's address and token; `rank` / `world_size`:
  this worker's tensor-parallel rank (None: vLLM's TP group where it is initialized,
  else 0 of 1)."""
  address: str = ""
  token: str = ""
  rank: int | None = None
  world_size: int | None = None
  timeout_s: float = 300.0


@dataclasses.dataclass
class JaxM2NUpdateInfo(WeightTransferUpdateInfo):
  """One update: the version to pull (None: the newest after the last one)."""
  version: int | None = None
  timeout_s: float | None = None


class JaxM2NWeightTransferEngine(WeightTransferEngine[JaxM2NInitInfo, JaxM2NUpdateInfo]):
  """vLLM worker engine "jax_m2n": pulls a `jax_m2n.Publisher`'s versions into the model.

  Per update: the version's parameter names, shapes and dtypes (no bytes), vLLM's
  destination resolution on this worker's model (direct: this TP rank's slice of a
  parameter whose loader is a plain copy or a column / row parallel one; else the
  whole tensor), then one pull of exactly those bytes (direct ones in place, converted
  to the parameter's dtype), then `model.load_weights` of the others. Weights are
  applied in place: start / finish do nothing (no layerwise reload: a quantized model
  needs another backend).
  """

  init_info_cls = JaxM2NInitInfo
  update_info_cls = JaxM2NUpdateInfo

  def __init__(self, config, vllm_config, device, model):
    super().__init__(config, vllm_config, device, model)
    self.subscriber: jt.Subscriber | None = None
    self.last: dict[str, Any] = {}

  def init_transfer_engine(self, init_info: JaxM2NInitInfo) -> None:
    rank, world = init_info.rank, init_info.world_size
    if rank is None or world is None:
      from vllm.distributed import parallel_state
      if parallel_state.model_parallel_is_initialized():
        rank = parallel_state.get_tensor_model_parallel_rank()
        world = parallel_state.get_tensor_model_parallel_world_size()
      else:
        rank, world = 0, 1
    self.subscriber = jt.Subscriber(init_info.address, token=init_info.token, rank=rank,
                                    world_size=world, timeout_s=init_info.timeout_s)

  def start_weight_update(self) -> None:
    pass

  def finish_weight_update(self) -> None:
    pass

  def update_weights(self, update_info: dict[str, Any]) -> None:
    """As vLLM's, synchronizing the device only where there is one (vLLM's base
    synchronizes the accelerator, which raises on a machine without one)."""
    self.receive_weights(self.parse_update_info(update_info))
    if self.device.type != "cpu":
      torch.accelerator.synchronize()

  def receive_weights(self, update_info: JaxM2NUpdateInfo) -> None:
    sub = self.subscriber
    if sub is None:
      raise jax_m2n.ReshardRuntimeError(f"{_API}: receive_weights must follow "
                                        "init_transfer_engine; it did not.")
    version, leaves = sub.published(version=update_info.version,
                                    timeout_s=update_info.timeout_s)
    params = dict(self.model.named_parameters())
    names = [n for n, _, _ in leaves]
    dtypes = [params[n].dtype if n in params else d for n, _, d in leaves]
    shapes = [s for _, s, _ in leaves]
    dests = m2n_layout.resolve_parameter_destinations(
        self.model, names, dtypes, shapes, num_workers=sub.world_size,
        shard_axis_size=sub.world_size, allow_direct=True)
    tensors, placements, fallback = {}, {}, []
    wanted = self._model_dtype()
    for dest, (name, shape, published) in zip(dests, leaves):
      if dest.direct:
        dim = dest.placements[m2n_common.DESTINATION_SHARD_AXIS] if (
            dest.placements is not m2n_common.REPLICATED) else m2n_common.REPLICATE
        tensors[name] = dest.tensor
        placements[name] = jt.Replicate() if dim == m2n_common.REPLICATE else jt.Shard(dim)
      else:
        want = wanted if wanted is not None and published.is_floating_point else published
        tensors[name] = torch.empty(shape, dtype=want, device=self.device)
        fallback.append(name)
    sub.pull_into(tensors, names=lambda p: p, placements=placements, version=version,
                  timeout_s=update_info.timeout_s)
    if fallback:
      self.model.load_weights([(n, tensors[n]) for n in fallback])
    self.last = {"version": version, "direct": len(tensors) - len(fallback),
                 "fallback": len(fallback), "path": sub.last_pull.path,
                 "bytes": sub.last_pull.nbytes}

  def _model_dtype(self) -> torch.dtype | None:
    dtype = getattr(self.model_config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype in (
        torch.float32, torch.bfloat16, torch.float16) else None

  def shutdown(self) -> None:
    if self.subscriber is not None:
      self.subscriber.close()
      self.subscriber = None


# ---------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class JaxM2NTrainerInitInfo(TrainerInitInfo):
  """The trainer's init info: where the Publisher listens ("host:port"; None:
  127.0.0.1 on a free port), its token (None: a new one), the versions it keeps."""
  backend: ClassVar[str] = "jax_m2n"
  address: str | None = None
  token: str | None = None
  keep: int = 2
  timeout_s: float = 300.0
  world_size: int | None = None  # the workers' TP size (None: theirs)


class JaxM2NTrainerWeightTransferEngine(TrainerWeightTransferEngine[JaxM2NTrainerInitInfo]):
  """vLLM trainer engine "jax_m2n": a `jax_m2n.Publisher` of the source's JAX pytree.

  `trainer_init` (every trainer process: the Publisher is collective) makes the
  Publisher; the sender (rank 0) hands its address and token to the workers through
  `client.init_weight_transfer_engine`. `send_weights` publishes a version (a snapshot:
  the trainer may update its arrays at once), then the sender drives start / update
  (the workers pull it) / finish.
  """

  init_info_cls = JaxM2NTrainerInitInfo

  @classmethod
  def trainer_init(cls, init_info: JaxM2NTrainerInitInfo, *, client, source=None):
    if not isinstance(source, JaxWeightSource):
      raise jax_m2n.ReshardTypeError(f"{_API}: the jax_m2n trainer engine's source must "
                                     "be a JaxWeightSource (jax_m2n.integrations.vllm."
                                     f"source(tree)); got {type(source).__name__}.")
    engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                 rank=init_info.rank)
    token = init_info.token or jax_m2n.new_token()
    engine.publisher = jax_m2n.Publisher(init_info.address, token=token,
                                         keep=init_info.keep)
    engine.timeout_s = init_info.timeout_s
    if engine.is_sender:
      info = {"address": engine.publisher.address, "token": token,
              "timeout_s": init_info.timeout_s}
      if init_info.world_size is not None:
        info["world_size"] = init_info.world_size
      client.init_weight_transfer_engine(info)
    return engine

  def send_weights(self) -> None:
    version = self.publisher.publish(self.source.tree)
    if self.is_sender:
      self.client.start_weight_update()
      self.client.update_weights({"version": version, "timeout_s": self.timeout_s})
      self.client.finish_weight_update(weight_version=str(version))
    self.version = version

  def shutdown(self) -> None:
    self.publisher.close()
