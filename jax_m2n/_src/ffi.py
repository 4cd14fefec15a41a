"""Loading the native handlers and registering the jax_m2n FFI targets.

Owns the one place that imports `jax_m2n._ffi` (CPU, required to run a reshard) and
`jax_m2n._ffi_cuda` (CUDA, optional) and registers their targets with XLA, once per
platform, on first use: `jax_m2n_reshard` (ensure_registered, which also creates the
NCCL communicator on CUDA) and the local data plane's `jax_m2n_local_copy` (and
`jax_m2n_local_store` on CUDA; ensure_local_registered, no communicator). Knows nothing about
plans or shardings; never moves data.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import ReshardError, ReshardValueError
from jax_m2n._src.topology import emulated_network

# The custom-call target name (docs/schedule_format.md, "The custom call").
TARGET_NAME = "jax_m2n_reshard"
# The local data plane's targets per XLA platform (docs/schedule_format.md, "The local
# copy schedule"); on CPU local_store is numpy's copy (jax_m2n/_src/local_copy.py).
LOCAL_TARGET_NAMES = {"cpu": ("jax_m2n_local_copy",),
                      "CUDA": ("jax_m2n_local_copy", "jax_m2n_local_store")}

# JAX platform name (`Device.platform`) -> (extension module, XLA platform name).
_MODULES = {
    "cpu": ("jax_m2n._ffi", "cpu"),
    "gpu": ("jax_m2n._ffi_cuda", "CUDA"),
    "cuda": ("jax_m2n._ffi_cuda", "CUDA"),
}

_lock = threading.Lock()
_registered: set[str] = set()          # JAX platform names ready to run
_targets_registered: set[str] = set()  # XLA platform names with the target registered
_local_registered: set[str] = set()    # XLA platform names with the local targets


def _import(module_name: str) -> Any:
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    raise ReshardError(
        f"reshard: the native extension {module_name} must be importable to move data; "
        f"got ImportError: {e}. Build it (bazel build //jax_m2n:all, or pip install .) "
        "and make sure the .so sits next to jax_m2n/__init__.py. Planning "
        "(jax_m2n.plan) works without it.") from e


def _init_cuda(module: Any, timeout_ms: int) -> None:
  """Creates the NCCL communicator over every JAX device (docs/dev_contracts.md).

  Collective over processes: every process reaches this through its first CUDA
  reshard. The unique id travels through jax.distributed's key-value store.
  """
  if module.is_initialized():
    return
  if jax.process_count() == 1:
    uid = module.nccl_unique_id()
  else:
    client = jax_compat.distributed_client()
    key = "jax_m2n/nccl_unique_id"
    if jax.process_index() == 0:
      uid = module.nccl_unique_id()
      client.key_value_set_bytes(key, uid)
    else:
      uid = client.blocking_key_value_get_bytes(key, timeout_ms)
  module.initialize(uid, [d.id for d in jax.devices()],
                    [(d.local_hardware_id, d.id) for d in jax.local_devices()],
                    timeout_ms=timeout_ms)


def transport_attrs(platform: str, topology: Any, devices: Any) -> dict[str, Any]:
  """Extra attributes of the custom call for a platform's transport: on CPU with
  `topology.emulate_network`, `network` (the NIC emulator's parameters and the domain of
  each of `devices`, the schedule's participants, ascending; xla_ffi/nic_emulator.h).
  Empty otherwise: the CUDA handler binds no such attribute (its links are real)."""
  if platform != "cpu":
    return {}
  network = emulated_network(topology, devices)
  if network is None:
    return {}
  return {"network": np.asarray(network, dtype=np.int64)}


def sticky_error(platform: str) -> str | None:
  """The CUDA transport's sticky error (a watchdog timeout/abort), if any.

  On CUDA a timeout is detected after the call has returned to XLA: an eager reshard
  checks this after its outputs are ready; every later call fails until re-initialized.
  """
  if _MODULES.get(platform, ("", ""))[1] != "CUDA" or platform not in _registered:
    return None
  return _cuda_module.error() if _cuda_module is not None else None


_cuda_module: Any = None


def load(platform: str) -> Any:
  """The extension module of a JAX platform (after `ensure_registered`)."""
  return _import(_MODULES[platform][0])


def _module_of(platform: str, api: str) -> tuple[str, str]:
  """(extension module, XLA platform) of a JAX platform; ReshardValueError naming `api`
  if it has no jax_m2n handler."""
  if platform not in _MODULES:
    raise ReshardValueError(
        f"{api}: devices must be on a platform with a jax_m2n handler "
        f"{tuple(sorted(_MODULES))}; got platform {platform!r}.")
  return _MODULES[platform]


def ensure_registered(platform: str, timeout_ms: int = 600_000) -> None:
  """Registers the `jax_m2n_reshard` target for a JAX platform; idempotent, thread-safe.

  On CUDA this also creates the NCCL communicator (collective over processes).

  Args:
    platform: a `jax.Device.platform` string: `cpu` or `gpu`/`cuda`.
    timeout_ms: bound on the CUDA initialization.

  Raises:
    ReshardValueError: the platform has no jax_m2n handler (e.g. TPU, ROCm).
    ReshardError: the platform's extension module cannot be imported.
  """
  if platform in _registered:
    return
  with _lock:
    if platform in _registered:
      return
    module_name, xla_platform = _module_of(platform, "reshard")
    module = _import(module_name)
    if xla_platform not in _targets_registered:
      targets = module.registrations()
      if TARGET_NAME not in targets:
        raise ReshardError(
            f"reshard: {module_name}.registrations() must provide {TARGET_NAME!r}; got "
            f"{sorted(targets)}. The extension and the Python package are out of step: "
            "rebuild the extension.")
      # The FFI state type (the decoded schedule) before the target that uses it.
      types = getattr(module, "type_registrations", None)
      for name, registration in (types() if types is not None else {}).items():
        jax.ffi.register_ffi_type(name, registration, platform=xla_platform)
      jax.ffi.register_ffi_target(TARGET_NAME, targets[TARGET_NAME],
                                  platform=xla_platform, api_version=1)
      _targets_registered.add(xla_platform)
    if xla_platform == "CUDA":
      global _cuda_module
      _init_cuda(module, timeout_ms)  # may raise TimeoutError; a later call retries
      _cuda_module = module
    # Both JAX spellings of the GPU platform share one registration.
    for name, (mod, _) in _MODULES.items():
      if mod == module_name:
        _registered.add(name)


def ensure_local_registered(platform: str) -> Any:
  """Registers the local data plane's targets (LOCAL_TARGET_NAMES) for a JAX platform
  and returns its extension module; idempotent, thread-safe, creates no communicator.

  Raises:
    ReshardValueError: the platform has no jax_m2n handler (e.g. TPU, ROCm).
    ReshardError: the extension cannot be imported or lacks the local targets.
  """
  module_name, xla_platform = _module_of(platform, "local_copy")
  module = _import(module_name)
  if xla_platform in _local_registered:
    return module
  with _lock:
    if xla_platform not in _local_registered:
      targets = module.registrations()
      names = LOCAL_TARGET_NAMES[xla_platform]
      missing = [name for name in names if name not in targets]
      if missing:
        raise ReshardError(
            f"local_copy: {module_name}.registrations() must provide {missing}; got "
            f"{sorted(targets)}. The extension and the Python package are out of step: "
            "rebuild the extension.")
      for name in names:
        jax.ffi.register_ffi_target(name, targets[name], platform=xla_platform,
                                    api_version=1)
      _local_registered.add(xla_platform)
  return module
