"""The eager call's contract under pressure (issue 26): every leaf is checked before any
leaf moves, the programs follow JAX's config toggles as jax.device_put does
(jax_enable_x64 turned off after an int64 array was made; jax_debug_nans /
jax_debug_infs on while the data holds NaN / inf), and JAX_M2N_CPU_ASYNC=1 callers on
several threads (in a subprocess: the mode is read when a layout is built).

Each test uses shapes of its own, so that its first call builds its layout.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import eager


@pytest.fixture(scope="module")
def devs():
  return np.array(jax.devices()[:8])


def _sharded(devs, ids, spec):
  return NamedSharding(Mesh(devs[ids], ("x",)), spec)


@pytest.fixture
def count_moves(monkeypatch):
  """Counts the eager programs run and the jax.device_put calls of delegated leaves."""
  runs = []
  run = eager.EagerReshard.__call__
  put = jax.device_put

  def counted_run(self, *args, **kwargs):
    runs.append("eager")
    return run(self, *args, **kwargs)

  def counted_put(*args, **kwargs):
    runs.append("device_put")
    return put(*args, **kwargs)
  monkeypatch.setattr(eager.EagerReshard, "__call__", counted_run)
  monkeypatch.setattr(eager.delegate.jax, "device_put", counted_put)
  return runs


# ---------------------------------------------------------------------------------------
# Every leaf is checked before any leaf moves
# ---------------------------------------------------------------------------------------

def test_a_delegated_leaf_with_a_wrong_src_sharding_moves_nothing(devs, count_moves):
  src, dst = _sharded(devs, slice(0, 4), P("x")), _sharded(devs, slice(4, 8), P("x"))
  x = jax.device_put(np.arange(24.0, dtype=np.float32), src)
  host = jnp.ones(24)  # uncommitted: delegated to jax.device_put
  del count_moves[:]
  with pytest.raises(jax_m2n.ReshardValueError, match=r"src_sharding of x\['b'\]"):
    jax_m2n.reshard({"a": x, "b": host}, dst, src_sharding={"a": x.sharding, "b": dst})
  assert count_moves == []


def test_a_bad_moved_leaf_runs_no_delegated_one(devs, count_moves):
  src = _sharded(devs, slice(0, 4), P("x"))
  x = jax.device_put(np.arange(20.0, dtype=np.float32).reshape(4, 5), src)
  dst = {"a": _sharded(devs, slice(4, 8), P(None, "x")),  # 5 columns over 4 devices
         "b": devs[3]}
  del count_moves[:]
  with pytest.raises(jax_m2n.ReshardValueError, match=r"x\['a'\]"):
    jax_m2n.reshard({"a": x, "b": np.ones(3)}, dst)
  assert count_moves == []


# ---------------------------------------------------------------------------------------
# Config toggles
# ---------------------------------------------------------------------------------------

@pytest.fixture
def x64_off():
  """Restores jax_enable_x64 (off in these tests' process) after the test."""
  yield
  jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.uint64])
def test_64_bit_array_after_x64_is_turned_off_moves_like_device_put(devs, dtype, x64_off):
  src, dst = _sharded(devs, slice(0, 4), P("x")), _sharded(devs, slice(2, 6), P())
  jax.config.update("jax_enable_x64", True)
  host = (np.arange(36) - 7).astype(dtype) * (2**40 if dtype != np.float64 else 1.5)
  x = jax.device_put(host.reshape(12, 3), src)
  jax.config.update("jax_enable_x64", False)
  for _ in range(2):  # the first call builds the layout, the second one reuses it
    y = jax_m2n.reshard(x, dst)
    ref = jax.device_put(x, dst)
    assert y.dtype == ref.dtype == dtype
    assert y.sharding == ref.sharding
    # The bytes, as they were: jax.device_put's own values are wrong here (jax 0.10.2:
    # zeros for int64, its resharding program traced with x64 off), so not the oracle.
    np.testing.assert_array_equal(np.asarray(y), host.reshape(12, 3))
  jax.config.update("jax_enable_x64", True)  # and back: the same layout with x64 on
  np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst)), host.reshape(12, 3))


def _specials():
  return np.array([np.nan, np.inf, -np.inf, 1.0, -0.0, np.nan, 3.0, 4.0] * 3,
                  dtype=np.float32)


@pytest.mark.parametrize("flag", ["jax_debug_nans", "jax_debug_infs"])
def test_nan_and_inf_move_under_the_debug_checkers(devs, flag):
  src, dst = _sharded(devs, slice(0, 4), P("x")), _sharded(devs, slice(4, 8), P())
  host = _specials()
  x = jax.device_put(host, src)
  jax.config.update(flag, True)
  try:
    for _ in range(2):  # built under the flag, then the cached (fast path) call
      y = jax_m2n.reshard(x, dst)
      np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.device_put(x, dst)))
      np.testing.assert_array_equal(np.asarray(y), host)
  finally:
    jax.config.update(flag, False)


def test_nan_moves_under_a_debug_nans_context(devs):
  src, dst = _sharded(devs, slice(0, 2), P("x")), _sharded(devs, slice(6, 8), P("x"))
  host = _specials()[:16]
  x = jax.device_put(host, src)
  with jax.debug_nans(True), jax.debug_infs(True):
    y = jax_m2n.reshard(x, dst)
    y2 = jax_m2n.reshard(x, devs[5], dtype=jnp.bfloat16)  # fused: no astype runs
  np.testing.assert_array_equal(np.asarray(y), host)
  # As float32: numpy on ml_dtypes' bfloat16 does not always see NaN == NaN as equal
  # (numpy 2.5 / jax 0.11.2), the values are what is compared.
  np.testing.assert_array_equal(np.asarray(y2).astype(np.float32),
                                host.astype(jnp.bfloat16).astype(np.float32))
