"""Engines: the ways of performing one case's data movement that the bench compares.

Owns, per engine, how a case is prepared (compiled, cached) before timing, the call that
is timed, how its outputs are awaited and freed, and how they are checked bitwise against
the numpy reference. Engines: jax_m2n per route (eager, and inside jit on one device set),
`jax.device_put`, XLA's own resharding inside jit, a numpy copy of the bytes each
destination receives (CPU), and torch.distributed (run out of process: torch_engine.py).
Never decides what is measured (suites.py) or how the clock runs (timing.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import numpy as np

from jax_m2n.bench import data as bench_data
from jax_m2n.bench.suites import Case

ROUTES = ("hierarchical", "flat", "gather_bcast")


@dataclasses.dataclass
class Inputs:
  """A case made concrete on devices: reference data, source arrays, shardings."""

  case: Case
  reference: list[np.ndarray]      # the global value of every leaf (the truth)
  x: list[Any]                     # source jax.Arrays, one per leaf
  src: list[Any]                   # source shardings
  dst: list[Any]                   # destination shardings
  platform: str                    # "cpu" or "gpu"
  # Replaces `x` by fresh on-device copies (same values, new buffers), as after a train
  # step. Called before every timed call, outside the clock: a jax.Array caches its host
  # value once read (`ArrayImpl._npy_value`), so `jax.device_put`'s host round trip
  # would be paid only once for a reused source; engines therefore read `inputs.x` at
  # call time.
  refresh: Callable[[], None] = lambda: None


@dataclasses.dataclass
class Prepared:
  """What the timing loop needs: the timed call, the wait, the release, the check."""

  run: Callable[[], Any]
  block: Callable[[Any], Any]
  release: Callable[[Any], None]
  check: Callable[[Any], str | None]   # None when bitwise equal, else why not
  info: dict = dataclasses.field(default_factory=dict)
  fresh_inputs: bool = True            # call inputs.refresh() before every call


class Engine:
  """One way of moving the data of a case."""

  name = ""
  description = ""
  route: str | None = None  # the planner route whose estimate is printed beside it

  def skip_reason(self, case: Case, platform: str) -> str | None:
    """Why this engine cannot run `case` here (None: it can)."""
    return None

  def applies(self, case: Case) -> bool:
    """Whether the engine belongs in this kind of case at all (silently left out)."""
    return True

  def prepare(self, inputs: Inputs) -> Prepared:
    raise NotImplementedError


# ---------------------------------------------------------------------------------------
# Checking JAX outputs
# ---------------------------------------------------------------------------------------

def _block(out):
  import jax
  return jax.block_until_ready(out)


def _release(out) -> None:
  import jax
  for leaf in jax.tree_util.tree_leaves(out):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def _aliased_shards(out) -> int:
  """Output shards that share memory with another shard of the same leaf.

  On CPU, `jax.device_put` may hand every replica the same host buffer (zero copy when
  the gathered host array happens to be aligned): valid for immutable arrays on one
  host, but it then copies 1/N of the bytes; the tables flag such rows.
  """
  import jax
  n = 0
  for leaf in jax.tree_util.tree_leaves(out):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      try:
        ptrs = [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
      except Exception:  # noqa: BLE001 - not every backend exposes pointers
        return 0
      n += len(ptrs) - len(set(ptrs))
  return n


def _jax_prepared(run, inputs: "Inputs", info: dict | None = None) -> "Prepared":
  """Prepared for engines returning jax.Arrays; counts calls with aliased outputs."""
  info = dict(info or {})
  info["calls_with_aliased_shards"] = 0

  def release(out):
    if _aliased_shards(out):
      info["calls_with_aliased_shards"] += 1
    _release(out)

  return Prepared(run, _block, release, lambda out: check_jax(out, inputs), info)


def check_jax(outs: Sequence[Any], inputs: Inputs) -> str | None:
  """Every output leaf: its sharding places it as the destination sharding does, and
  every addressable shard is bitwise equal to the reference's matching slice."""
  import jax
  if len(outs) != len(inputs.reference):
    return f"expected {len(inputs.reference)} leaves, got {len(outs)}"
  for i, (out, ref, dst) in enumerate(zip(outs, inputs.reference, inputs.dst)):
    name = inputs.case.tensors[i].name
    if not isinstance(out, jax.Array):
      return f"{name}: output is a {type(out).__name__}, not a jax.Array"
    if tuple(out.shape) != ref.shape or np.dtype(out.dtype) != ref.dtype:
      return (f"{name}: got {np.dtype(out.dtype)}{list(out.shape)}, expected "
              f"{ref.dtype}{list(ref.shape)}")
    if not out.sharding.is_equivalent_to(dst, ref.ndim):
      return f"{name}: output sharding {out.sharding} is not the destination {dst}"
    want = dst.devices_indices_map(ref.shape)
    shards = {s.device: s for s in out.addressable_shards}
    if set(shards) != {d for d in want if d.process_index == jax.process_index()}:
      return (f"{name}: output shards on devices {sorted(d.id for d in shards)}, expected "
              f"{sorted(d.id for d in want)}")
    for device, shard in shards.items():
      actual = np.asarray(shard.data)
      expected = ref[want[device]]
      if not bench_data.same_bits(actual, expected):
        return (f"{name} on device {device.id}: "
                f"{bench_data.describe_mismatch(actual, expected)}")
  return None


def _hlo_collectives(compiled_text: str) -> dict[str, int]:
  """XLA collectives and custom calls in an optimized HLO module (what jit really ran)."""
  names = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
           "reduce-scatter", "custom-call")
  return {n: len(re.findall(rf"\b{n}(?:-start)?\(", compiled_text)) for n in names}


# ---------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------

class M2NEager(Engine):
  """`jax_m2n.reshard(x, dst, route=...)` outside jit (the product's eager path)."""

  def __init__(self, route: str):
    self.route = route
    self.name = f"m2n_{route}"
    self.description = f"jax_m2n.reshard, route={route}, eager"

  def prepare(self, inputs: Inputs) -> Prepared:
    import jax_m2n
    dst, route = inputs.dst, self.route
    topology = inputs.case.domain_size

    def run():
      return jax_m2n.reshard(inputs.x, dst, route=route, topology=topology)

    return _jax_prepared(run, inputs)


class M2NJit(Engine):
  """`jax.jit(lambda a: jax_m2n.reshard(a, dst, src_sharding=src))` on one device set."""

  def __init__(self, route: str):
    self.route = route
    self.name = f"m2n_jit_{route}"
    self.description = f"jax_m2n.reshard inside jax.jit, route={route}"

  def applies(self, case: Case) -> bool:
    return case.colocated

  def prepare(self, inputs: Inputs) -> Prepared:
    import jax
    import jax_m2n
    src, dst, route = inputs.src, inputs.dst, self.route
    topology = inputs.case.domain_size
    fn = jax.jit(lambda a: jax_m2n.reshard(a, dst, route=route, src_sharding=src,
                                           topology=topology),
                 in_shardings=(src,))
    text = fn.lower(inputs.x).compile().as_text()
    info = {"hlo_ops": _hlo_collectives(text)}
    return _jax_prepared(lambda: fn(inputs.x), inputs, info)


class XlaJit(Engine):
  """`jax.jit(lambda a: a, out_shardings=dst)`: XLA's own resharding (collectives)."""

  name = "jit_identity"
  description = "jax.jit(lambda a: a, out_shardings=dst) (XLA collectives)"

  def applies(self, case: Case) -> bool:
    return case.colocated

  def prepare(self, inputs: Inputs) -> Prepared:
    import jax
    fn = jax.jit(lambda a: a, in_shardings=(inputs.src,), out_shardings=inputs.dst)
    text = fn.lower(inputs.x).compile().as_text()
    return _jax_prepared(lambda: fn(inputs.x), inputs, {"hlo_ops": _hlo_collectives(text)})


class DevicePut(Engine):
  """`jax.device_put(x, dst)`: what a JAX user does today."""

  name = "device_put"
  description = "jax.device_put(x, dst)"

  def prepare(self, inputs: Inputs) -> Prepared:
    import jax
    dst = inputs.dst
    return _jax_prepared(lambda: jax.device_put(inputs.x, dst), inputs)


def _slices(box, origin) -> tuple[slice, ...]:
  return tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin))


def _set_numpy_hugepages(enabled: bool) -> None:
  core = getattr(np, "_core", None) or np.core
  core.multiarray._set_madvise_hugepage(enabled)  # noqa: SLF001 - numpy's own switch


class NumpyCopy(Engine):
  """numpy copies of exactly the bytes each destination device receives (CPU only).

  For every destination device: a fresh buffer of its box, filled piece by piece
  (source box ∩ destination box) from a source shard's host memory, one thread, a
  device's own piece read from itself. The yardstick of the CPU requirement: jax_m2n
  within 2x of this.

  numpy asks Linux for transparent huge pages on large arrays (madvise), so its fresh
  buffers fault in 2 MiB at a time; XLA's buffers (jax_m2n's and device_put's outputs)
  fault in 4 KiB pages. `hugepages=False` (engine `numpy_copy_4k`) copies into buffers
  without that advice: the same first-touch cost as an XLA output buffer.
  """

  def __init__(self, hugepages: bool = True):
    self.hugepages = hugepages
    self.name = "numpy_copy" if hugepages else "numpy_copy_4k"
    self.description = ("numpy: copy each destination's bytes from the source shards "
                        "(1 thread" + (")" if hugepages else ", 4 KiB pages like XLA)"))

  def skip_reason(self, case: Case, platform: str) -> str | None:
    return None if platform == "cpu" else "CPU only (host memory is device memory there)"

  def prepare(self, inputs: Inputs) -> Prepared:
    from jax_m2n._src.layout import Layout, intersect
    work = []  # per leaf: [(device id, shape, dtype, [(dst slices, src view, src slices)])]
    for x, dst, ref in zip(inputs.x, inputs.dst, inputs.reference):
      src_layout = Layout.from_sharding(x.sharding, x.shape)
      views = {s.device.id: (src_layout.box_of(s.device.id), np.asarray(s.data))
               for s in x.addressable_shards}
      dst_layout = Layout.from_sharding(dst, x.shape)
      leaf = []
      for dev, dbox in zip(dst_layout.devices, dst_layout.boxes):
        pieces = []
        for sbox, holders in src_layout.shards():
          piece = intersect(sbox, dbox)
          if piece is None:
            continue
          holder = dev if dev in holders else holders[0]
          hbox, view = views[holder]
          pieces.append((_slices(piece, [lo for lo, _ in dbox]), view,
                         _slices(piece, [lo for lo, _ in hbox])))
        leaf.append((dev, tuple(hi - lo for lo, hi in dbox), ref.dtype, pieces))
      work.append((leaf, dst_layout))

    hugepages = self.hugepages

    def run():
      if not hugepages:
        _set_numpy_hugepages(False)
      try:
        return copy_all()
      finally:
        if not hugepages:
          _set_numpy_hugepages(True)

    def copy_all():
      outs = []
      for leaf, _ in work:
        bufs = []
        for dev, shape, dtype, pieces in leaf:
          buf = np.empty(shape, dtype)
          for dsl, view, ssl in pieces:
            np.copyto(buf[dsl], view[ssl])
          bufs.append((dev, buf))
        outs.append(bufs)
      return outs

    def check(outs):
      for (leaf, layout), bufs, ref, spec in zip(work, outs, inputs.reference,
                                                 inputs.case.tensors):
        for (dev, buf), box in zip(bufs, layout.boxes):
          expected = ref[_slices(box, [0] * len(box))]
          if not bench_data.same_bits(buf, expected):
            return (f"{spec.name} on device {dev}: "
                    f"{bench_data.describe_mismatch(buf, expected)}")
      return None

    # Reads the source shards' host memory directly: no cache to defeat, no refresh.
    return Prepared(run, lambda out: out, lambda out: None, check, fresh_inputs=False)


class TorchGatherBcast(Engine):
  """torch.distributed: all-gather on the source group, broadcast to the destinations
  (the RL frameworks' refit path). Runs out of process (torch_engine.py)."""

  name = "torch_gather_bcast"
  description = ("torch.distributed NCCL: all-gather on the sources, broadcast from the "
                 "first to the destinations, slice (1 process per GPU)")
  route = "gather_bcast"

  def skip_reason(self, case: Case, platform: str) -> str | None:
    return None if platform == "gpu" else "needs GPUs (torch.distributed NCCL)"


def all_engines() -> list[Engine]:
  """Every engine, in table order."""
  return ([M2NEager(r) for r in ROUTES] + [M2NJit(r) for r in ROUTES] +
          [XlaJit(), DevicePut(), NumpyCopy(), NumpyCopy(hugepages=False),
           TorchGatherBcast()])


ENGINE_NAMES = tuple(e.name for e in all_engines())
