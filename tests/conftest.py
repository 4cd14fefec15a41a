"""pytest's hook file for tests/: the CPU devices the tests expect.

Most test files need 8 devices. On a machine with one GPU, JAX's default backend would
be that GPU: `pytest tests/` then failed (probe_test's case generation raised IndexError
at collection). Unless a run selects only GPU test files (names containing "gpu"), JAX
is pinned here to 8 forced CPU devices before any test module imports it: the devices
Bazel's runs get (tests/BUILD sets JAX_PLATFORMS=cpu, pytest_main.py the count). The GPU
files then skip with their reasons. An explicit JAX_PLATFORMS or XLA_FLAGS device count
wins; a file that still has too few devices skips with a reason (probe_test).
"""

import os
import sys

import pytest

CPU_DEVICES = 8


def _gpu_only(args) -> bool:
  files = [os.path.basename(str(a).split("::")[0]) for a in args]
  return bool(files) and all("gpu" in f for f in files)


def pytest_configure(config):
  if _gpu_only(config.args):
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
  jax = sys.modules.get("jax")
  if jax is not None:  # imported already (a plugin): its config read the old env
    try:
      jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    except Exception:  # noqa: BLE001 - a backend already started keeps its devices
      pass


def pytest_collection_modifyitems(config, items):
  """Where the devices are still too few (JAX_PLATFORMS or XLA_FLAGS set otherwise),
  the CPU-device tests skip with that reason rather than fail on missing devices."""
  if _gpu_only(config.args):
    return
  jax = sys.modules.get("jax")
  if jax is None:
    return
  n = jax.device_count()
  if n >= CPU_DEVICES:
    return
  skip = pytest.mark.skip(reason=(
      f"needs {CPU_DEVICES} devices; got {n} {jax.devices()[0].platform} device(s) "
      "(JAX_PLATFORMS / XLA_FLAGS set otherwise). Hint: JAX_PLATFORMS=cpu."))
  for item in items:
    if "gpu" not in os.path.basename(str(item.fspath)):
      item.add_marker(skip)


@pytest.fixture
def no_data_moves(monkeypatch):
  """Fails the test if reshard builds or runs a per-device program: argument errors
  come first, before any data moves (reshard_errors_test, probe_test)."""
  from jax_m2n._src import eager  # after pytest_configure set the devices

  def forbidden(*args, **kwargs):
    raise AssertionError("reshard built or ran a program before rejecting its input")
  monkeypatch.setattr(eager.cache, "build_programs", forbidden)
  monkeypatch.setattr(eager.EagerReshard, "__call__", forbidden)
