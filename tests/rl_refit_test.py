"""Tier 0: the RL refit example (examples/rl_refit.py), two small steps, 8 CPU devices.

Checks the example's claims end to end: after every refit the generator's parameters
equal the trainer's float32 ones cast to the generator's dtype (`astype`) bitwise, sit
in the generator's shardings on the generator's devices, and equal what `astype` +
`jax.device_put` delivers; with and without overlap, for every generator dtype. Also
its layout flags and checksum.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from examples import rl_refit

SMALL = rl_refit.RefitConfig(
    steps=2, layers=1, d_model=32, heads=4, digits=3, batch_size=32, group_size=4,
    timing_reps=1, log_every=1, progress=False)


def _bits(x):
  return np.asarray(x).view(np.uint8)


def _check_refit(result, cfg, trainer, generator):
  """The last refit: generator layout and devices, astype of the trainer's bitwise."""
  assert result.checksums_equal == [True] * cfg.steps
  assert result.baseline_equal
  generator_devices = set(generator.mesh.devices.flat)
  trainer_devices = set(trainer.mesh.devices.flat)
  assert cfg.layouts.endswith("@same") or not generator_devices & trainer_devices
  flat_dst, treedef = jax.tree.flatten(result.generator_shardings)
  assert treedef == jax.tree.structure(result.trainer_params)
  for src, dst, dst_sharding in zip(jax.tree.leaves(result.trainer_params),
                                    jax.tree.leaves(result.generator_params), flat_dst):
    assert src.dtype == jnp.float32
    assert dst.dtype == jnp.dtype(cfg.generator_dtype)
    assert dst_sharding.mesh == generator.mesh
    assert dst.sharding.is_equivalent_to(dst_sharding, dst.ndim)
    assert dst.sharding.device_set == generator_devices
    assert src.sharding.device_set == trainer_devices
    np.testing.assert_array_equal(_bits(dst), _bits(src.astype(dst.dtype)))
  assert all(len(t) == cfg.steps for t in result.times_ms.values())


# Every preset and route, each generator dtype with and without overlap (one run each).
CASES = (
    (rl_refit.PRESETS[0], "hierarchical", "bfloat16", True),     # the defaults
    (rl_refit.PRESETS[1], "hierarchical", "float8_e4m3fn", True),
    (rl_refit.PRESETS[2], "hierarchical", "float32", False),
    (rl_refit.PRESETS[3], "hierarchical", "bfloat16", False),
    (rl_refit.PRESETS[0], "flat", "float8_e4m3fn", False),
    (rl_refit.PRESETS[0], "gather_bcast", "float32", True),
)


@pytest.mark.parametrize("layouts,route,generator_dtype,overlap", CASES)
def test_two_steps_refit_is_bitwise_and_in_generator_layout(
    layouts, route, generator_dtype, overlap):
  cfg = dataclasses.replace(SMALL, layouts=layouts, route=route,
                            generator_dtype=generator_dtype, overlap=overlap)
  trainer, generator = rl_refit.make_sides(cfg, jax.devices())
  result = rl_refit.run(cfg)
  _check_refit(result, cfg, trainer, generator)
  assert len(result.returned_early) == (cfg.steps if overlap else 0)
  assert {k: len(v) for k, v in result.step_ms.items()} == {
      "waited": cfg.timing_reps, "overlapped": cfg.timing_reps}
  assert all(ms > 0 for v in result.step_ms.values() for ms in v)
  assert set(result.waited_phase_ms) == {"refit", "rollout", "train"}
  converting = generator_dtype != "float32"
  assert list(result.engine_ms) == (
      [f"jax_m2n.reshard(dtype={generator_dtype})", "astype + jax_m2n.reshard",
       "astype + jax.device_put"] if converting else
      ["jax_m2n.reshard", "jax.device_put"])
  assert all(len(ms) == cfg.timing_reps for ms in result.engine_ms.values())


def test_sample_widens_fp8_weights():
  params = rl_refit.init_params(jax.random.key(0), SMALL)
  prompts = jnp.zeros((4, SMALL.digits), jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn):
    cast = jax.tree.map(lambda x: x.astype(dtype), params)
    tokens = rl_refit.sample(cast, prompts, jax.random.key(1), heads=SMALL.heads)
    assert tokens.shape == (4, SMALL.seq_len)
    assert ((tokens[:, SMALL.digits + 1:] >= 0)
            & (tokens[:, SMALL.digits + 1:] < rl_refit.NUM_DIGITS)).all()


def test_default_layouts_shard_params_differently_on_each_side():
  trainer, generator = rl_refit.make_sides(SMALL, jax.devices())
  params = jax.eval_shape(lambda: rl_refit.init_params(jax.random.key(0), SMALL))
  src = rl_refit.param_shardings(params, trainer)
  dst = rl_refit.param_shardings(params, generator)
  assert src["layers"][0]["wq"].spec == P("fsdp", "tp")
  assert dst["layers"][0]["wq"].spec == P(None, "tp")
  assert dst["embed"].spec == P("tp", None)
  assert [d.id for d in generator.mesh.devices.flat] == [4, 5, 6, 7]


@pytest.mark.parametrize("layouts,per_side,want", (
    ("fsdp2xtp2->tp2xdp2", 2, ({"fsdp": 2, "tp": 1}, {"tp": 2, "dp": 1})),  # 4 GPUs
    ("fsdp2xtp2->tp2xdp2", 0, ({"fsdp": 2, "tp": 2}, {"tp": 2, "dp": 2})),
    ("fsdp4->tp2xdp2@same", 0, ({"fsdp": 4}, {"tp": 2, "dp": 2})),
    ("tp2->tp2xdp2", 1, ({"tp": 1}, {"tp": 1, "dp": 1})),
))
def test_layouts_fit_devices_per_side(layouts, per_side, want):
  cfg = dataclasses.replace(SMALL, layouts=layouts, devices_per_side=per_side)
  sides = rl_refit.make_sides(cfg, jax.devices())
  assert tuple(dict(side.mesh.shape) for side in sides) == want


def test_explicit_meshes_and_specs():
  cfg = dataclasses.replace(
      SMALL, generator_mesh="data=2,model=2",
      generator_specs="batch=data,hidden=model,vocab=model,model=")
  _, generator = rl_refit.make_sides(cfg, jax.devices())
  assert dict(generator.mesh.shape) == {"data": 2, "model": 2}
  assert generator.spec(("model", "hidden")) == P(None, "model")
  assert generator.spec(("batch", None)) == P("data", None)


@pytest.mark.parametrize("field,value,match", (
    ("layouts", "fsdp2xtp2", "must read"),
    ("trainer_mesh", "fsdp=8", "must fit on the 8 devices"),
    ("layouts", "tp2xfsdp3->tp2", "by halving"),
    ("generator_mesh", "data=2,model=2", "unless rules are given"),
    ("generator_specs", "hidden=nope", "must map logical axes"),
    ("trainer_mesh", "fsdp=0", "sizes >= 1"),
))
def test_bad_layout_flags_fail_clearly(field, value, match):
  cfg = dataclasses.replace(SMALL, **{field: value})
  with pytest.raises(ValueError, match=match):
    rl_refit.make_sides(cfg, jax.devices())


def test_checksum_sees_values_and_positions():
  x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  swapped = x.at[0, 1].set(x[1, 0]).at[1, 0].set(x[0, 1])
  nudged = x.at[2, 3].set(jnp.nextafter(x[2, 3], jnp.inf))
  base = rl_refit.checksums([x])
  assert base != rl_refit.checksums([swapped])
  assert base != rl_refit.checksums([nudged])
  assert rl_refit.checksums([x.astype(jnp.bfloat16)]).dtype == jnp.uint32
