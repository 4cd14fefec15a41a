"""The public reshard op: validation, eager dispatch across device sets, lowering in jit.

Owns `reshard` and `plan`: it turns arrays and shardings into layouts, asks the planner,
encodes the schedule and runs the `jax_m2n_reshard` custom call, either as one small
compiled program per participating device (outside jit, any device sets) or inside one
SPMD program (`shard_map`, inside jit). It never decides what moves (the planner does)
and never moves bytes itself (the native handler does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import numbers
import queue
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import schedule
from jax_m2n._src.errors import (ReshardError, ReshardTimeoutError, ReshardTypeError,
                                 ReshardValueError)
from jax_m2n._src.layout import MAX_RANK, Layout
from jax_m2n._src.planner import DEFAULT_CHUNK_BYTES, ROUTES, Plan, plan_reshard
from jax_m2n._src.topology import Topology, as_topology

# How long a device waits for its peers inside the handler before every waiting device
# fails with ReshardTimeoutError. Generous: a peer may be busy with earlier work.
DEFAULT_TIMEOUT_S = 300.0
_MAX_TIMEOUT_S = float(2**40 // 1000)  # the handlers' bound on the timeout_ms attribute

_API = "reshard"


def _trace_state_clean() -> bool:
  """False while JAX traces (inside jit, shard_map...): reshard then stages the call."""
  from jax._src import core  # no public spelling in jax 0.10-0.11
  return core.trace_state_clean()


# ---------------------------------------------------------------------------------------
# Pytree handling and validation (everything here runs before any data moves)
# ---------------------------------------------------------------------------------------

def _is_dst_leaf(v: Any) -> bool:
  return v is None or isinstance(v, (Sharding, jax.ShapeDtypeStruct))


def _leaf_names(x: Any) -> list[str]:
  """`x['w'][0]`-style names of the leaves of x, in leaf order (error messages only)."""
  return ["x" + jax.tree_util.keystr(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(x)[0]]


def _broadcast_prefix(api: str, what: str, prefix: Any, x: Any, treedef, n: int,
                      names: Callable[[], list[str]]) -> list[Any]:
  """The leaves of `prefix` broadcast onto x's leaves (like jax.device_put's argument)."""
  if isinstance(prefix, (Sharding, jax.ShapeDtypeStruct)):
    return [prefix] * n
  flat, tree = jax.tree_util.tree_flatten(prefix, is_leaf=_is_dst_leaf)
  if tree == treedef:
    return flat
  try:
    full = jax.tree_util.tree_leaves(
        jax.tree.broadcast(prefix, x, is_leaf=_is_dst_leaf), is_leaf=_is_dst_leaf)
  except (ValueError, TypeError) as e:
    raise ReshardValueError(
        f"{api}: {what} must be one Sharding or a pytree prefix of x (as for "
        f"jax.device_put); got structure {tree} for x of structure {treedef}. "
        f"Detail: {e}") from None
  if len(full) != n:
    raise ReshardValueError(
        f"{api}: {what} must be one Sharding or a pytree prefix of x; got {len(full)} "
        f"leaves after broadcasting onto the {n} leaves of x.")
  return full


def _dst_sharding_of(api: str, name: str, dst: Any, shape, dtype) -> Sharding:
  """The destination sharding of one leaf; checks a ShapeDtypeStruct's shape/dtype."""
  if isinstance(dst, jax.ShapeDtypeStruct):
    if tuple(dst.shape) != tuple(shape) or np.dtype(dst.dtype) != np.dtype(dtype):
      raise ReshardValueError(
          f"{api}: the destination of {name} must keep its shape and dtype (reshard "
          f"moves data, it does not reshape or cast); got {dtype}{list(shape)} -> "
          f"{np.dtype(dst.dtype)}{list(dst.shape)}. Hint: cast or reshape before or "
          "after the reshard.")
    dst = dst.sharding
    if dst is None:
      raise ReshardTypeError(
          f"{api}: a ShapeDtypeStruct destination of {name} must carry a sharding; got "
          "sharding=None.")
  if isinstance(dst, PartitionSpec):
    raise ReshardTypeError(
        f"{api}: the destination of {name} must be a jax.sharding.Sharding; got "
        f"PartitionSpec {dst}. Hint: wrap it as NamedSharding(mesh, spec).")
  if not isinstance(dst, Sharding):
    raise ReshardTypeError(
        f"{api}: the destination of {name} must be a jax.sharding.Sharding; got "
        f"{type(dst).__name__} {dst!r}.")
  return dst


def _check_holds(api: str, name: str, sharding: Sharding, shape, what: str) -> None:
  """A sharding must be able to hold `shape`: right rank, divisible dims."""
  if isinstance(sharding, NamedSharding):
    spec = sharding.spec
    if len(spec) > len(shape):
      raise ReshardValueError(
          f"{api}: the {what} sharding of {name} must have at most one PartitionSpec "
          f"entry per dim; got {spec} for shape {tuple(shape)} (rank {len(shape)}).")
    if spec is PartitionSpec.UNCONSTRAINED or any(
        e is PartitionSpec.UNCONSTRAINED for e in spec):
      raise ReshardValueError(
          f"{api}: the {what} sharding of {name} must be fully specified; got {spec}.")
  try:
    sharding.shard_shape(tuple(shape))
  except Exception as e:  # noqa: BLE001 - JAX raises several types here
    raise ReshardValueError(
        f"{api}: the {what} sharding of {name} must be able to hold shape "
        f"{tuple(shape)} (sharded dims divisible by their mesh size, rank <= "
        f"{MAX_RANK}); got {sharding}. JAX says: {e}") from None
  if len(shape) > MAX_RANK:
    raise ReshardValueError(
        f"{api}: {name} must have rank at most {MAX_RANK}; got shape {tuple(shape)}.")


def _check_dtype(api: str, name: str, dtype) -> None:
  """Whole bytes per element, no extended dtypes: the handler copies plain bytes."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    raise ReshardTypeError(
        f"{api}: {name} must have a plain array dtype; got the extended dtype {dtype}. "
        "Hint: reshard jax.random.key_data(keys) and wrap the result again.")
  if jax.dtypes.itemsize_bits(dtype) % 8:
    raise ReshardTypeError(
        f"{api}: {name} must have whole bytes per element; got {dtype} "
        f"({jax.dtypes.itemsize_bits(dtype)} bits). Hint: bitcast packed sub-byte data "
        "to uint8 first.")


def _check_memory_kind(api: str, name: str, sharding: Sharding, what: str) -> None:
  kind = sharding.memory_kind
  if kind is None:
    return
  device = next(iter(sharding.device_set))
  try:
    default = device.default_memory().kind
  except Exception:  # noqa: BLE001 - some backends expose no memories
    default = kind
  if kind != default:
    raise ReshardValueError(
        f"{api}: the {what} of {name} must be in device memory ({default!r}); got "
        f"memory kind {kind!r}. Hint: move between memory kinds with jax.device_put.")


def _check_route(api: str, route: Any) -> None:
  if route not in ROUTES:
    raise ReshardValueError(
        f"{api}: route must be one of {ROUTES}; got {route!r}. Hint: 'hierarchical' is "
        "the product; 'flat' and 'gather_bcast' are baselines.")


def _timeout_ms(api: str, timeout_s: Any) -> int:
  if timeout_s is None:
    timeout_s = DEFAULT_TIMEOUT_S
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not (
      0 < timeout_s <= _MAX_TIMEOUT_S):
    raise ReshardValueError(
        f"{api}: timeout_s must be a number of seconds in (0, {_MAX_TIMEOUT_S:.0f}]; got "
        f"{timeout_s!r}.")
  return max(1, int(round(float(timeout_s) * 1000)))


def _topology_key(topology: Any) -> Any:
  if isinstance(topology, list):
    return tuple(tuple(g) for g in topology)
  return topology


def _platform_of(devices) -> str:
  return next(iter(devices)).platform


def _check_in_process(api: str, platform: str, devices) -> None:
  """The CPU transport meets its peers in one process: refuse others' devices up front
  (the handler would otherwise wait for peers that can never arrive)."""
  if platform != "cpu":
    return
  me = jax.process_index()
  remote = sorted(d.id for d in devices if d.process_index != me)
  if remote:
    raise ReshardValueError(
        f"{api}: on CPU every participating device must belong to this process (the CPU "
        f"transport is in-process); got devices {remote} of other processes. Hint: "
        "multi-process reshards need GPUs (NCCL), or reshard within each process.")


def _same_layout(a: Sharding, b: Sharding, shape) -> bool:
  """Whether two shardings place `shape` identically (same devices, same boxes)."""
  if a == b:
    return True
  return Layout.from_sharding(a, shape) == Layout.from_sharding(b, shape)


def _site(tag: bytes, sched: np.ndarray, salt: int = 0) -> int:
  """A rendezvous key: equal for every participant of one call, stable across processes."""
  h = hashlib.blake2b(digest_size=8)
  h.update(tag)
  h.update(salt.to_bytes(8, "little", signed=False))
  h.update(np.ascontiguousarray(sched).tobytes())
  return int.from_bytes(h.digest(), "little") >> 1  # a non-negative int64


def _map_native_error(e: Exception) -> ReshardError:
  """A native handler error as the jax_m2n exception (the native message kept)."""
  msg = str(e)
  if ("DEADLINE_EXCEEDED" in msg or "timed out" in msg.lower()
      or "timeout" in msg.lower()):
    return ReshardTimeoutError(
        f"{_API}: a participating device did not arrive in time; the handler says: "
        f"{msg}. Hint: every participating device must call reshard with identical "
        "layouts in the same order (the collective contract); raise timeout_s if a "
        "peer is merely slow.")
  return ReshardError(f"{_API}: the native handler failed: {msg}")


# ---------------------------------------------------------------------------------------
# Eager: one small program per participating device, dispatched from per-device threads
# ---------------------------------------------------------------------------------------

class _Batch:
  """The outcome of one reshard's per-device programs: a countdown latch."""

  __slots__ = ("_cv", "_left", "results", "failed", "errors")

  def __init__(self, n: int):
    self._cv = threading.Condition(threading.Lock())
    self._left = n
    self.results: list[Any] = [None] * n
    self.failed: list[BaseException | None] = [None] * n
    self.errors: list[BaseException] = []

  def done(self, i: int, result: Any, error: BaseException | None) -> None:
    with self._cv:
      self.results[i] = result
      if error is not None:
        self.failed[i] = error
        self.errors.append(error)
      self._left -= 1
      if not self._left:
        self._cv.notify_all()

  def wait(self) -> None:
    with self._cv:
      while self._left:
        self._cv.wait()


class _Worker:
  """A persistent thread that dispatches the programs of one device.

  The CPU handler waits for its peers, so the programs of one reshard must run
  concurrently: dispatched one after another from one Python thread they run one after
  another and the first waits forever (seen here; DESIGN.md, notes/gpu-machine.md
  "Dispatch"). One thread per device, reused by every call (starting threads per call
  would cost more than the 1 KiB reshard itself).
  """

  def __init__(self, device_id: int):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._loop, name=f"jax_m2n-dev{device_id}",
                                    daemon=True)
    self._thread.start()

  def submit(self, batch: _Batch, i: int, fn: Callable[..., Any], *args) -> None:
    """Runs fn(*args) on this device's thread; its result or error goes to batch[i]."""
    self._queue.put((batch, i, fn, args))

  def _loop(self) -> None:
    while True:
      batch, i, fn, args = self._queue.get()
      result = None
      try:
        result = fn(*args)
      except BaseException as e:  # noqa: BLE001 - handed to the calling thread
        batch.done(i, None, e)
      else:
        batch.done(i, result, None)
      del batch, fn, args, result  # drop buffer references while idle


_workers: dict[int, _Worker] = {}
_workers_lock = threading.Lock()


def _worker(device_id: int) -> _Worker:
  w = _workers.get(device_id)
  if w is None:
    with _workers_lock:
      w = _workers.get(device_id)
      if w is None:
        w = _workers[device_id] = _Worker(device_id)
  return w


try:  # the class behind jax.Array (checked construction is the public fallback)
  from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover
  _ArrayImpl = None


# One eager reshard at a time per process: interleaving two calls' per-device programs
# from several user threads could order them differently on different devices.
_dispatch_lock = threading.Lock()


@dataclasses.dataclass
class _DeviceProgram:
  device: Any                                  # jax.Device
  call: Callable[..., Any]                     # the compiled per-device program
  operands: tuple[tuple[int, int], ...]        # (leaf, index into leaf's shards)
  results: tuple[int, ...]                     # leaves this device holds a dst shard of
  schedule: np.ndarray


def _compile(jitted, in_types) -> Callable[..., Any]:
  return jitted.lower(*in_types).compile()


def _run_device(prog: _DeviceProgram, args: list) -> list:
  outs = prog.call(*args)
  jax.block_until_ready(outs)  # handler errors surface here
  return outs


@dataclasses.dataclass
class _EagerReshard:
  """Everything one (shapes, dtypes, shardings, route, topology) needs, built once."""

  plan: Plan
  programs: list[_DeviceProgram]
  out_avals: list[tuple[tuple[int, ...], Any, Sharding]]  # shape, dtype, dst sharding
  # Per leaf: for each of dst's addressable devices (in its order): (program, result).
  out_slots: list[list[tuple[int, int]]]
  src_shard_index: list[dict[int, int]]      # per leaf: device id -> index in _arrays
  platform: str
  site: int
  avals: list[Any] = dataclasses.field(default_factory=list)  # per leaf, after call 1

  def __post_init__(self):
    self.avals = [None] * len(self.out_avals)

  def __call__(self, leaves: Sequence[jax.Array], donate: bool,
               devices: Sequence[int] | None = None) -> list[jax.Array]:
    """Runs the reshard; `devices` (tests only) dispatches a subset, abandoning the rest.

    Raises the handler's error as a ReshardError (no partial outputs).
    """
    shards = [_addressable_arrays(x) for x in leaves]
    programs = self.programs
    if devices is not None:
      programs = [p for p in programs if p.device.id in devices]
    n = len(programs)
    batch = _Batch(n)
    with _dispatch_lock:
      # Programs 1.. go to their devices' threads; this thread runs program 0 itself.
      arguments = [[shards[t][k] for t, k in p.operands] for p in programs]
      for i in range(1, n):
        _worker(programs[i].device.id).submit(batch, i, _run_device, programs[i],
                                              arguments[i])
      if n:
        try:
          result = _run_device(programs[0], arguments[0])
        except Exception as e:  # noqa: BLE001 - re-raised below as a ReshardError
          batch.done(0, None, e)
        else:
          batch.done(0, result, None)
      del shards
      batch.wait()
      # A program that never reached the handler (not dispatched, or refused by JAX
      # for a deleted input) leaves its peers waiting: consume its generation so they
      # fail now and later calls line up (CPU). Handler errors come back as several
      # Python types, so the inputs tell, not the exception type. Under the lock: no
      # other call of this site may start before.
      self._abandon([p for p in self.programs if devices is not None
                     and p.device.id not in devices] +
                    [p for p, e, args in zip(programs, batch.failed, arguments)
                     if e is not None and any(a.is_deleted() for a in args)])
    results = batch.results
    sticky = m2n_ffi.sticky_error(self.platform)
    if sticky is not None:
      batch.errors.append(ReshardError(sticky))
    if batch.errors:
      for outs in results:  # no partial outputs: free what completed
        for o in outs or ():
          o.delete()
      mapped = [_map_native_error(e) for e in batch.errors]
      k = next((i for i, m in enumerate(mapped) if isinstance(m, ReshardTimeoutError)), 0)
      raise mapped[k] from batch.errors[k]
    if devices is not None:
      return []
    if donate:
      for x in leaves:
        if not x.is_deleted():
          x.delete()
    out = []
    for t, ((shape, dtype, sharding), slots) in enumerate(zip(self.out_avals,
                                                              self.out_slots)):
      arrays = [results[p][r] for p, r in slots]
      aval = self.avals[t]
      if aval is None:
        y = jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)
        if _ArrayImpl is not None and type(y) is _ArrayImpl:
          self.avals[t] = y.aval
      else:
        # What make_array_from_single_device_arrays builds, without re-checking what
        # the first call checked (half the per-leaf cost of a small reshard).
        y = _ArrayImpl(aval, sharding, arrays, committed=True, _skip_checks=True)
      out.append(y)
    return out

  def _abandon(self, programs: Sequence[_DeviceProgram]) -> None:
    if programs and self.platform == "cpu":
      m2n_ffi.load(self.platform).abandon(self.site, [p.device.id for p in programs])


def _addressable_arrays(x: jax.Array) -> list:
  """x's single-device arrays in x.sharding._addressable_device_assignment order."""
  arrays = getattr(x, "_arrays", None)
  if arrays is None:
    order = {d: i for i, d in enumerate(x.sharding._addressable_device_assignment)}
    out = [None] * len(order)
    for s in x.addressable_shards:
      out[order[s.device]] = s.data
    return out
  return arrays


def _build_eager(shapes, dtypes, srcs, dsts, route, topology, timeout_ms,
                 chunk_bytes) -> _EagerReshard:
  devices = {}
  for s in itertools.chain(srcs, dsts):
    for d in s._device_assignment:
      devices[d.id] = d
  platform = _platform_of(devices.values())
  _check_in_process(_API, platform, devices.values())
  staging = platform != "cpu"
  m2n_ffi.ensure_registered(platform, timeout_ms)
  topo = as_topology(topology, devices.values())
  src_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(srcs, shapes)]
  dst_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(dsts, shapes)]
  itemsizes = [np.dtype(dt).itemsize for dt in dtypes]
  plan = plan_reshard(src_layouts, dst_layouts, itemsizes, topo, route, chunk_bytes)
  site = _site(b"eager", schedule.encode(plan, None, staging))
  bufs = schedule.buffers(plan)
  timeout = np.int64(timeout_ms)

  local = [d for d in plan.devices if devices[d].process_index == jax.process_index()]
  src_shard_index = [
      {d.id: i for i, d in enumerate(s._addressable_device_assignment)} for s in srcs]
  programs: list[_DeviceProgram] = []
  to_compile = []
  result_index: dict[tuple[int, int], tuple[int, int]] = {}  # (leaf, dev) -> (prog, r)
  for dev_id in local:
    device = devices[dev_id]
    ops = bufs.operands.get(dev_id, {})
    res = bufs.results.get(dev_id, {})
    operand_leaves = sorted(ops, key=ops.get)
    result_leaves = sorted(res, key=res.get)
    sharding = SingleDeviceSharding(device)
    in_types = []
    for t in operand_leaves:
      box = src_layouts[t].box_of(dev_id)
      in_types.append(jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in box), dtypes[t],
                                           sharding=sharding))
    out_types = []
    for t in result_leaves:
      box = dst_layouts[t].box_of(dev_id)
      out_types.append(jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in box), dtypes[t]))
    workspace = max(1, schedule.workspace_bytes(plan, dev_id, staging))
    out_types.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
    sched = schedule.encode(plan, dev_id, staging)
    # The workspace is a returned output, so XLA keeps the call on every device, even
    # on a source-only one. has_side_effect=True would do the same but costs 3-8x the
    # dispatch time (JAX leaves its C++ fast path for programs with effects).
    call = jax.ffi.ffi_call(m2n_ffi.TARGET_NAME, out_types, has_side_effect=False)

    def body(*shards, call=call, sched=sched):
      return tuple(call(*shards, schedule=sched, site=np.int64(site), timeout_ms=timeout))

    jitted = jax.jit(body, in_shardings=(sharding,) * len(in_types),
                     out_shardings=(sharding,) * len(out_types))
    for r, t in enumerate(result_leaves):
      result_index[(t, dev_id)] = (len(programs), r)
    programs.append(_DeviceProgram(
        device, None,
        tuple((t, src_shard_index[t][dev_id]) for t in operand_leaves),
        tuple(result_leaves), sched))
    to_compile.append((jitted, in_types))

  # Compile the per-device programs concurrently, on the devices' threads (XLA compiles
  # without the GIL): the first call of a many-device reshard pays about one compile.
  batch = _Batch(len(programs))
  for i, (p, (jitted, in_types)) in enumerate(zip(programs, to_compile)):
    _worker(p.device.id).submit(batch, i, _compile, jitted, in_types)
  batch.wait()
  if batch.errors:
    raise batch.errors[0]
  for p, compiled in zip(programs, batch.results):
    p.call = compiled

  out_avals, out_slots = [], []
  for t, (shape, dtype, dst) in enumerate(zip(shapes, dtypes, dsts)):
    out_avals.append((tuple(shape), dtype, dst))
    out_slots.append([result_index[(t, d.id)] for d in dst._addressable_device_assignment])
  return _EagerReshard(plan, programs, out_avals, out_slots, src_shard_index, platform,
                       site)


# Compiled per-device programs by (tree, shapes, dtypes, shardings, route, topology,
# timeout, chunk size). A model's refit is one entry; the bound only stops growth when
# layouts keep changing.
_EAGER_CACHE_SIZE = 256
_eager_cache: dict[Any, _EagerReshard] = {}
_eager_cache_lock = threading.Lock()


def _eager_key(treedef, leaves, dsts, src_shardings, route, topology, timeout_ms,
               chunk_bytes):
  """The cache key (None when it cannot be formed: then validation says why).

  A given src_sharding is part of the key: its agreement with x.sharding was checked
  when the entry was built.
  """
  parts = []
  for x, d, s in zip(leaves, dsts, src_shardings):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return None
    parts.append((x.shape, x.dtype, x.sharding, d, s))
  try:
    return (treedef, tuple(parts), route, _topology_key(topology), timeout_ms, chunk_bytes)
  except TypeError:  # unhashable topology or destination
    return None


def _check_topology(api: str, topology: Any) -> None:
  try:
    as_topology(topology, ())
  except ReshardError as e:
    raise ReshardValueError(f"{api}: {e}") from None


def _validate_eager(x, leaves, dsts, src_shardings, donate, topology,
                    names) -> list[Sharding]:
  """Every rule of the eager path; returns the destination shardings."""
  _check_topology(_API, topology)
  out = []
  seen: dict[int, str] = {}
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
      hint = (" Hint: put host data on devices first with jax.device_put."
              if isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool))
              else "")
      raise ReshardTypeError(
          f"{_API}: every leaf of x must be a jax.Array; got {type(leaf).__name__} at "
          f"{name}.{hint}")
    if leaf.is_deleted():
      raise ReshardValueError(
          f"{_API}: {name} must be a live array; got a deleted (or donated) array.")
    if not leaf.committed:
      raise ReshardValueError(
          f"{_API}: {name} must be committed to its devices (its sharding is then "
          f"what the source layout is); got an uncommitted array on {leaf.sharding}. "
          "Hint: jax.device_put(x, sharding) commits it.")
    _check_dtype(_API, name, leaf.dtype)
    dst_sharding = _dst_sharding_of(_API, name, dst, leaf.shape, leaf.dtype)
    src = leaf.sharding
    _check_holds(_API, name, dst_sharding, leaf.shape, "destination")
    _check_memory_kind(_API, name, src, "source")
    _check_memory_kind(_API, name, dst_sharding, "destination")
    src_platform = _platform_of(src.device_set)
    dst_platform = _platform_of(dst_sharding.device_set)
    if src_platform != dst_platform or any(
        d.platform != dst_platform for d in dst_sharding.device_set):
      raise ReshardValueError(
          f"{_API}: the destination devices of {name} must be on the source's platform "
          f"({src_platform}); got platform {dst_platform} ({dst_sharding}). Hint: "
          "jax.device_put moves data between platforms.")
    given = src_shardings[i]
    if given is not None and not _same_layout(given, src, leaf.shape):
      raise ReshardValueError(
          f"{_API}: src_sharding of {name} must describe the array's actual layout; got "
          f"{given} for an array sharded as {src}. Hint: outside jit, src_sharding can "
          "be left out.")
    if donate:
      if id(leaf) in seen:
        raise ReshardValueError(
            f"{_API}: with donate=True an array must appear once in x; got the same "
            f"array at {seen[id(leaf)]} and {name}.")
      seen[id(leaf)] = name
    out.append(dst_sharding)
  return out


def _reshard_eager(x, leaves, treedef, dsts, src_shardings, route, topology, donate,
                   timeout_ms, chunk_bytes, names) -> list[jax.Array]:
  key = _eager_key(treedef, leaves, dsts, src_shardings, route, topology, timeout_ms,
                   chunk_bytes)
  fn = _eager_cache.get(key) if key is not None else None
  if fn is not None:
    for i, leaf in enumerate(leaves):  # what may change between calls of one key
      if leaf.is_deleted() or not leaf.committed:
        _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
    if donate and len({id(v) for v in leaves}) != len(leaves):
      _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
    return fn(leaves, donate)
  dst_shardings = _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
  shapes = [tuple(v.shape) for v in leaves]
  dtypes = [v.dtype for v in leaves]
  srcs = [v.sharding for v in leaves]
  with _eager_cache_lock:
    fn = _eager_cache.get(key) if key is not None else None
    if fn is None:
      fn = _build_eager(shapes, dtypes, srcs, dst_shardings, route, topology, timeout_ms,
                        chunk_bytes)
      if key is not None:
        if len(_eager_cache) >= _EAGER_CACHE_SIZE:  # drop the oldest entry
          _eager_cache.pop(next(iter(_eager_cache)))
        _eager_cache[key] = fn
  return fn(leaves, donate)


# ---------------------------------------------------------------------------------------
# Inside jit: one SPMD program, shard_map over a common refinement of the meshes
# ---------------------------------------------------------------------------------------

_jit_sites = itertools.count(1)


def _outside_jit_hint() -> str:
  return " Hint: call jax_m2n.reshard outside jit (it accepts any layouts there)."


def _typed_sharding(aval) -> NamedSharding | None:
  """The sharding JAX's type system knows for an abstract value (explicit axes), if any."""
  s = getattr(aval, "sharding", None)
  if not isinstance(s, NamedSharding) or s.mesh.empty:
    return None
  types = getattr(s.mesh, "axis_types", ())
  if not types or not all(t == jax.sharding.AxisType.Explicit for t in types):
    return None
  return s


def _spec_entries(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
  """A PartitionSpec as one tuple of mesh axis names per dim (None -> ())."""
  out = []
  for e in tuple(spec) + (None,) * (ndim - len(spec)):
    out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
  return tuple(out)


def _has_type(v, abstract_mesh, spec: PartitionSpec) -> bool:
  s = jax.typeof(v).sharding
  return (s.mesh == abstract_mesh and
          _spec_entries(s.spec, v.ndim) == _spec_entries(spec, v.ndim))


def _concrete_mesh_for(abstract_mesh, candidates: Sequence[Sharding]):
  for s in candidates:
    if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh) and (
        s.mesh.abstract_mesh == abstract_mesh):
      return s.mesh
  try:  # the context mesh of jax.set_mesh; JAX refuses get_mesh inside jit
    mesh = jax.sharding.get_mesh()
  except Exception:  # noqa: BLE001
    mesh = None
  if isinstance(mesh, Mesh) and not mesh.empty and mesh.abstract_mesh == abstract_mesh:
    return mesh
  return None


def _as_named(api: str, name: str, s: Sharding, what: str) -> NamedSharding:
  if isinstance(s, NamedSharding):
    if not isinstance(s.mesh, Mesh):
      raise ReshardValueError(
          f"{api}: inside jit the {what} sharding of {name} must be on a concrete Mesh; "
          f"got {s}.{_outside_jit_hint()}")
    return s
  if isinstance(s, SingleDeviceSharding):
    (d,) = s.device_set
    return NamedSharding(Mesh(np.array([d]), ("m2n_single",)), PartitionSpec())
  raise ReshardValueError(
      f"{api}: inside jit the {what} sharding of {name} must be a NamedSharding (or "
      f"SingleDeviceSharding); got {type(s).__name__} {s}.{_outside_jit_hint()}")


@dataclasses.dataclass(frozen=True)
class _Refinement:
  mesh: Mesh
  axes: dict[tuple[int, str], tuple[str, ...]]  # (id(mesh), axis) -> refined axes

  def spec(self, s: NamedSharding, ndim: int) -> PartitionSpec:
    entries = []
    for names in _spec_entries(s.spec, ndim):
      refined = tuple(a for n in names for a in self.axes[(id(s.mesh), n)])
      entries.append(None if not refined else refined[0] if len(refined) == 1
                     else refined)
    return PartitionSpec(*entries)


def _refine(api: str, name: str, shardings: Sequence[NamedSharding],
            explicit: bool) -> _Refinement:
  """A mesh over the same devices whose axes refine every given mesh's axes.

  Both meshes must flatten to the same device order and their prefix products (major
  axis first) must form a divisor chain, e.g. (4,) and (2, 2), or (2, 4) and (4, 2).
  """
  meshes: list[Mesh] = []
  for s in shardings:
    if not any(s.mesh is m for m in meshes):
      meshes.append(s.mesh)
  first = meshes[0]
  types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto)
  if all(m == first for m in meshes) and all(
      t == types for t in first.axis_types):
    return _Refinement(first, {(id(m), a): (a,) for m in meshes for a in m.axis_names})
  order = tuple(d.id for d in first.devices.flat)
  cuts = {1}
  for m in meshes:
    if tuple(d.id for d in m.devices.flat) != order:
      raise ReshardValueError(
          f"{api}: inside jit the meshes of {name} must list the same devices in the "
          f"same order; got {tuple(d.id for d in m.devices.flat)} and {order}."
          f"{_outside_jit_hint()}")
    p = 1
    for size in m.devices.shape:
      p *= size
      cuts.add(p)
  chain = sorted(cuts)
  for a, b in zip(chain, chain[1:]):
    if b % a:
      raise ReshardValueError(
          f"{api}: inside jit the meshes of {name} must refine a common mesh (their "
          f"axis-size prefix products must divide one another); got mesh shapes "
          f"{[tuple(m.devices.shape) for m in meshes]}.{_outside_jit_hint()}")
  sizes = [b // a for a, b in zip(chain, chain[1:])] or [1]
  names = tuple(f"m2n_r{i}" for i in range(len(sizes)))  # no leading "_": Shardy drops such axes
  mesh = Mesh(np.array(first.devices.flat, dtype=object).reshape(sizes), names,
              axis_types=(types,) * len(names))
  axes: dict[tuple[int, str], tuple[str, ...]] = {}
  for m in meshes:
    p = 1
    for axis, size in zip(m.axis_names, m.devices.shape):
      lo, hi = p, p * size
      axes[(id(m), axis)] = tuple(
          names[i] for i in range(len(chain) - 1) if chain[i] >= lo and chain[i + 1] <= hi)
      p = hi
  return _Refinement(mesh, axes)


def _reshard_traced(leaves, dsts, src_shardings, route, topology, timeout_ms,
                    chunk_bytes, names) -> list:
  _check_topology(_API, topology)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and getattr(context, "manual_axes", ()):
    raise ReshardValueError(
        f"{_API}: reshard must be called outside shard_map (it lowers to its own SPMD "
        f"program over whole arrays); got a call under manual mesh axes "
        f"{tuple(context.manual_axes)}. Hint: call it on the global arrays, inside jit "
        "or eagerly.")
  shapes, dtypes, srcs, dst_named, typed_any = [], [], [], [], False
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    try:
      aval = jax.typeof(leaf)
    except TypeError:
      aval = None
    if aval is None or not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
      raise ReshardTypeError(
          f"{_API}: every leaf of x must be an array; got {type(leaf).__name__} at "
          f"{name}.")
    shape, dtype = tuple(aval.shape), aval.dtype
    _check_dtype(_API, name, dtype)
    dst_sharding = _dst_sharding_of(_API, name, dst, shape, dtype)
    _check_holds(_API, name, dst_sharding, shape, "destination")
    typed = _typed_sharding(aval)
    given = src_shardings[i]
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      given = given if given is not None else leaf.sharding
    if typed is not None:
      typed_any = True
      concrete = _concrete_mesh_for(typed.mesh, [given, dst_sharding])
      if given is not None:
        g = _as_named(_API, name, given, "source")
        if (g.mesh.abstract_mesh != typed.mesh or
            _spec_entries(g.spec, len(shape)) != _spec_entries(typed.spec, len(shape))):
          raise ReshardValueError(
              f"{_API}: src_sharding of {name} must match the sharding in its type; got "
              f"{given} for a value typed {typed}.")
        src = g
      elif concrete is None:
        raise ReshardValueError(
            f"{_API}: inside jit the devices of {name}'s mesh must be known; got a value "
            f"typed {typed} and no concrete mesh for it. Hint: pass src_sharding=, or "
            "use jax.set_mesh(mesh).")
      else:
        src = NamedSharding(concrete, typed.spec)
    elif given is not None:
      if not isinstance(given, Sharding):
        raise ReshardTypeError(
            f"{_API}: src_sharding of {name} must be a jax.sharding.Sharding; got "
            f"{type(given).__name__}.")
      src = given
    else:
      raise ReshardValueError(
          f"{_API}: inside jit the source sharding of {name} must be known; got a value "
          f"whose type carries no sharding ({aval.str_short() if hasattr(aval, 'str_short') else aval}). "
          "Hint: pass src_sharding= (the layout x has inside the jit), or use "
          "explicit-sharding meshes (jax.make_mesh(..., axis_types=Explicit)) so JAX "
          "knows it.")
    _check_holds(_API, name, src, shape, "source")
    src = _as_named(_API, name, src, "source")
    dnamed = _as_named(_API, name, dst_sharding, "destination")
    if src._device_assignment != dnamed._device_assignment:
      raise ReshardValueError(
          f"{_API}: inside jit the source and destination of {name} must be on the same "
          f"devices in the same order (jit's device assignment); got source devices "
          f"{[d.id for d in src._device_assignment]} and destination devices "
          f"{[d.id for d in dnamed._device_assignment]}. Hint: call jax_m2n.reshard "
          "outside jit to move arrays between device sets.")
    if srcs and src._device_assignment != srcs[0]._device_assignment:
      raise ReshardValueError(
          f"{_API}: inside jit every leaf must be on the same devices; got "
          f"{[d.id for d in src._device_assignment]} for {name} and "
          f"{[d.id for d in srcs[0]._device_assignment]} for {names()[0]}."
          f"{_outside_jit_hint()}")
    shapes.append(shape)
    dtypes.append(dtype)
    srcs.append(src)
    dst_named.append(dnamed)
  if not leaves:
    return []

  refinement = _refine(_API, names()[0] if len(leaves) == 1 else "x",
                       srcs + dst_named, typed_any)
  src_specs = [refinement.spec(s, len(shape)) for s, shape in zip(srcs, shapes)]
  dst_specs = [refinement.spec(s, len(shape)) for s, shape in zip(dst_named, shapes)]

  # Zero-size leaves move no bytes: they stay out of the call and are made empty in
  # place (XLA 0.11.2 crashes compiling a shard_map over empty and non-empty arrays).
  empty = [math.prod(shape) == 0 for shape in shapes]
  if any(empty):
    live = [i for i, e in enumerate(empty) if not e]
    live_outs = iter(_reshard_traced(
        [leaves[i] for i in live], [dsts[i] for i in live], [srcs[i] for i in live],
        route, topology, timeout_ms, chunk_bytes,
        lambda: [names()[i] for i in live]) if live else [])
    result = []
    for i, e in enumerate(empty):
      if not e:
        result.append(next(live_outs))
        continue
      y = jnp.zeros(shapes[i], dtypes[i])
      dst = dst_named[i]
      if any(t == jax.sharding.AxisType.Explicit for t in dst.mesh.axis_types):
        y = jax.sharding.reshard(y, dst)
      else:
        y = jax.lax.with_sharding_constraint(y, dst)
      result.append(y)
    return result

  devices = srcs[0]._device_assignment
  platform = _platform_of(devices)
  _check_in_process(_API, platform, devices)
  staging = platform != "cpu"
  m2n_ffi.ensure_registered(platform, timeout_ms)
  topo = as_topology(topology, devices)
  src_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(srcs, shapes)]
  dst_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(dst_named, shapes)]
  itemsizes = [np.dtype(dt).itemsize for dt in dtypes]
  plan = plan_reshard(src_layouts, dst_layouts, itemsizes, topo, route, chunk_bytes)
  sched = schedule.encode(plan, None, staging)
  site = _site(b"jit", sched, next(_jit_sites))
  workspace = max(1, schedule.workspace_bytes(plan, None, staging))
  out_types = [jax.ShapeDtypeStruct(s.shard_shape(shape), dt)
               for s, shape, dt in zip(dst_named, shapes, dtypes)]
  out_types.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
  call = jax.ffi.ffi_call(m2n_ffi.TARGET_NAME, out_types)

  def body(*shards):
    outs = call(*shards, schedule=sched, site=np.int64(site),
                timeout_ms=np.int64(timeout_ms))
    return tuple(outs[:-1])

  mesh = refinement.mesh
  if typed_any:  # a type-level cast onto the refined mesh: the same bytes, no copy
    leaves = [v if _has_type(v, mesh.abstract_mesh, sp)
              else jax.sharding.reshard(v, NamedSharding(mesh, sp))
              for v, sp in zip(leaves, src_specs)]
  smap = jax.shard_map(body, mesh=mesh, in_specs=tuple(src_specs),
                       out_specs=tuple(dst_specs), check_vma=False)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context != mesh.abstract_mesh:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      outs = smap(*leaves)
  else:
    outs = smap(*leaves)
  result = []
  for y, dst in zip(outs, dst_named):
    if any(t == jax.sharding.AxisType.Explicit for t in dst.mesh.axis_types) or typed_any:
      if not _has_type(y, dst.mesh.abstract_mesh, dst.spec):
        y = jax.sharding.reshard(y, dst)
    else:
      y = jax.lax.with_sharding_constraint(y, dst)
    result.append(y)
  return result


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------

def reshard(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
            topology: Topology | int | Sequence[Sequence[int]] | None = None,
            donate: bool = False, src_sharding: Any = None,
            timeout_s: float | None = None, chunk_bytes: int | None = None) -> Any:
  """Moves arrays into new layouts, possibly on other devices, with one transfer plan.

  The result is bitwise equal to `jax.device_put(x, dst_sharding)` and its leaves'
  `.sharding` is `dst_sharding` (same devices, same order), but only the bytes each
  destination device needs move, each source byte crosses the slow links once per
  destination domain, and replicas are filled by fan-out inside a domain.

  Outside jit, source and destination device sets may be disjoint (trainer ->
  generator), overlapping or identical: one small compiled program runs per
  participating device (cached). Inside `jax.jit`, both must be on the jit's devices; the
  reshard lowers to the `jax_m2n_reshard` custom call on every device, with no XLA
  collective.

  Collective contract: a reshard is collective over every participating device (a
  device holding a source or a destination shard of any leaf). Every process that owns
  a participating device must call `reshard` with identical layouts, route and topology,
  in the same order as its peers. A device whose peers never arrive fails after
  `timeout_s` with `ReshardTimeoutError` on every waiting device, never hangs.

  Args:
    x: a `jax.Array` or a pytree of them (committed, not deleted). Inside jit: traced
      arrays.
    dst_sharding: a `jax.sharding.Sharding`, or a pytree prefix of `x` of them (as for
      `jax.device_put`); a `jax.ShapeDtypeStruct` with a sharding is accepted too
      (its shape and dtype must equal the leaf's).
    route: `"hierarchical"` (default), `"flat"` (direct sends to every replica) or
      `"gather_bcast"` (the legacy refit baseline).
    topology: NVLink domains: a `jax_m2n.Topology`, a domain size (int) or lists of
      device ids. Default: the devices of one process form one domain.
    donate: outside jit, free the source arrays once the call has completed (they are
      deleted; the caller must not use them again). Without it, sources are never
      modified. Ignored inside jit (use jit's `donate_argnums`).
    src_sharding: the source layout (a Sharding or a pytree prefix of them). Needed
      inside jit when the type of `x` carries no sharding (non-explicit meshes);
      outside jit optional, and checked against `x.sharding`.
    timeout_s: how long a device waits for its peers (default 300 s).
    chunk_bytes: bound on one pipelined chunk of a transfer (a leader forwards chunk c
      while chunk c+1 arrives). Default: 16 MiB on CPU, 64 MiB on GPU (measured on
      H200: fewer, larger NCCL groups win; docs/cuda_transport.md).

  Returns:
    A pytree like `x` of arrays with the destination shardings.

  Raises:
    ReshardTypeError: a leaf is not an array, a destination is not a Sharding.
    ReshardValueError: structures do not match, shapes or dtypes would change, a
      sharding cannot hold the shape, devices are on another platform, arrays are
      uncommitted or deleted, an unknown route, devices of another process on CPU, or a
      layout inside jit that needs the eager path. Raised before any data moves; the
      message names the leaf.
    ReshardTimeoutError: a peer did not arrive within `timeout_s`.
    ReshardError: the native handler failed (its message included). No partial
      outputs are returned.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> trainer = jax.sharding.Mesh(devs[:4].reshape(1, 4), ("dp", "tp"))
    >>> generator = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    >>> w = jax.device_put(np.arange(32.0).reshape(4, 8),
    ...                    NamedSharding(trainer, P("tp", None)))
    >>> w2 = jax_m2n.reshard(w, NamedSharding(generator, P("tp", None)))
    >>> w2.sharding == NamedSharding(generator, P("tp", None))
    True
  """
  _check_route(_API, route)
  timeout_ms = _timeout_ms(_API, timeout_s)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  name_cache: list[list[str]] = []

  def names() -> list[str]:
    if not name_cache:
      name_cache.append(_leaf_names(x))
    return name_cache[0]

  dsts = _broadcast_prefix(_API, "dst_sharding", dst_sharding, x, treedef, n, names)
  srcs = ([None] * n if src_sharding is None else
          _broadcast_prefix(_API, "src_sharding", src_sharding, x, treedef, n, names))
  if not n:
    return jax.tree_util.tree_unflatten(treedef, [])
  traced = (not _trace_state_clean()) or any(
      isinstance(v, jax.core.Tracer) for v in leaves)
  if traced:
    outs = _reshard_traced(leaves, dsts, srcs, route, topology, timeout_ms,
                           _chunk_bytes(_API, chunk_bytes, dsts), names)
  else:
    outs = _reshard_eager(x, leaves, treedef, dsts, srcs, route, topology, bool(donate),
                          timeout_ms, _chunk_bytes(_API, chunk_bytes, dsts), names)
  return jax.tree_util.tree_unflatten(treedef, outs)


# Measured defaults (docs/cuda_transport.md: each NCCL step costs ~13 us on H200, and
# 64 MiB chunks came within 5-10% of the best in every case; CPU steps are barriers).
CPU_CHUNK_BYTES = DEFAULT_CHUNK_BYTES
GPU_CHUNK_BYTES = 64 << 20


def _chunk_bytes(api: str, chunk_bytes: int | None, dsts: Sequence[Any]) -> int:
  """The chunk size: the caller's, else the measured default of the platform."""
  if chunk_bytes is not None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
      raise ReshardValueError(
          f"{api}: chunk_bytes must be a positive int; got {chunk_bytes!r}.")
    return chunk_bytes
  for d in dsts:
    device_set = getattr(d, "device_set", None)
    if device_set:
      platform = next(iter(device_set)).platform
      return CPU_CHUNK_BYTES if platform == "cpu" else GPU_CHUNK_BYTES
  return CPU_CHUNK_BYTES


def plan(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
         topology: Topology | int | Sequence[Sequence[int]] | None = None,
         src_sharding: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Plan:
  """The plan `reshard(x, dst_sharding, ...)` would run, without moving anything.

  Args:
    x: arrays (or `jax.ShapeDtypeStruct`s with a sharding), a pytree.
    dst_sharding: as for `reshard`.
    route, topology: as for `reshard`.
    src_sharding: source layouts, when `x`'s leaves carry none.
    chunk_bytes: bound on one chunk of a transfer.

  Returns:
    The `Plan` (transfers, chunks, bytes per link, cost estimates, workspace).

  Example:
    >>> p = jax_m2n.plan(w, NamedSharding(generator, P("tp", None)))
    >>> p.bytes_by_link  # 128 bytes injected, 128 fanned out to the dp replicas
    {'local': 0, 'nvlink': 256, 'network': 0}
  """
  api = "plan"
  _check_route(api, route)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  names = lambda: _leaf_names(x)  # noqa: E731
  dsts = _broadcast_prefix(api, "dst_sharding", dst_sharding, x, treedef, n, names)
  given = ([None] * n if src_sharding is None else
           _broadcast_prefix(api, "src_sharding", src_sharding, x, treedef, n, names))
  src_layouts, dst_layouts, itemsizes, devices = [], [], [], {}
  for i, (leaf, dst, src) in enumerate(zip(leaves, dsts, given)):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise ReshardTypeError(
          f"{api}: every leaf of x must be an array or ShapeDtypeStruct; got "
          f"{type(leaf).__name__} at {names()[i]}.")
    shape = tuple(leaf.shape)
    src = src if src is not None else getattr(leaf, "sharding", None)
    if not isinstance(src, Sharding):
      raise ReshardValueError(
          f"{api}: the source sharding of {names()[i]} must be known; got "
          f"{src!r}. Hint: pass src_sharding=.")
    dst = _dst_sharding_of(api, names()[i], dst, shape, leaf.dtype)
    _check_holds(api, names()[i], src, shape, "source")
    _check_holds(api, names()[i], dst, shape, "destination")
    for d in itertools.chain(src.device_set, dst.device_set):
      devices[d.id] = d
    src_layouts.append(Layout.from_sharding(src, shape))
    dst_layouts.append(Layout.from_sharding(dst, shape))
    itemsizes.append(np.dtype(leaf.dtype).itemsize)
  topo = as_topology(topology, devices.values() if devices else None)
  return plan_reshard(src_layouts, dst_layouts, itemsizes, topo, route, chunk_bytes)
