"""The scale suite (jax_m2n/bench/scale.py): its model has the leaves and layouts its
docstring says, and one small measurement runs here (8 CPU devices, 30 leaves): bitwise
equal to jax.device_put, at most one compile per participating device on the first
call, none on a repeat. Timings are the suite's, never asserted here."""

import math

import jax
import pytest

from jax_m2n.bench import scale


def test_the_model_has_856_leaves_that_every_mesh_axis_divides():
  rows = scale.tree_specs()
  assert len(rows) == 856 == 14 * scale.LAYERS + 2
  assert len({name for name, *_ in rows}) == len(rows)
  assert {stage for _, stage, _, _ in rows} == set(range(scale.STAGES))
  for _, _, shape, gen in rows:
    assert all(d % 16 == 0 for d in shape) and len(gen) == len(shape)
  assert sum(math.prod(shape) * 2 for _, _, shape, _ in rows) < 64 << 20
  assert scale.layers_for(16) == 1 and scale.layers_for(856) == 61
  with pytest.raises(ValueError, match="14 \\* layers \\+ 2"):
    scale.layers_for(57)


@pytest.mark.parametrize("n, trainer, generator", [
    (8, (1, 1), (2, 4)), (32, (2, 2), (4, 8)), (64, (4, 2), (8, 8)),
    (256, (8, 4), (16, 16))])
def test_mesh_shapes(n, trainer, generator):
  assert scale.mesh_shapes(n) == (trainer, generator)
  (ep, tp), (dp, gtp) = scale.mesh_shapes(n)
  assert ep * tp * scale.STAGES == n == dp * gtp


def test_layouts_place_stages_on_eighths_and_the_generator_on_all():
  names, srcs, dsts, topology = scale.layouts(jax, 8, layers=8)
  assert len(names) == len(srcs) == len(dsts) == 14 * 8 + 2
  assert {d.id for s in srcs for d in s.sharding.device_set} == set(range(8))
  assert all(len(s.sharding.device_set) == 1 for s in srcs)  # one device per stage
  assert all(len(d.device_set) == 8 for d in dsts)
  assert topology.domain_size == 2


def test_a_small_measurement_is_bitwise_and_compiles_once_per_device():
  row = scale.run_model(8, 30, iters=2, div=64)
  assert row["bitwise_equal"] and row["leaves"] == 30
  assert 0 < row["reshard_first_events"]["compiles"] <= 8
  assert row["reshard_repeat_events"]["compiles"] == 0
  assert row["reshard_repeat_events"]["traces"] == 0
