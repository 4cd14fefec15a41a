"""One pull on a torch rank: its steps, and what a torch Subscriber holds between pulls.

Owns `Held` (the jobs layer's `pulling.State`, the mapped exports, the copies made per
plan and slot, the last pull's record) and `pull`: the version (the jobs layer's long
poll, `pulling.choose`; a steady local pull copies while the publisher confirms,
`pulling.Ahead`; a steady network pull names the newest in one message), the manifest,
the targets (targets.resolve: every check before any byte moves), the plan
(planning.plan_rank), then the data path: on the trainer's host its export mapped and
read with torch copies (copies.copy_local), elsewhere the jobs protocol's register /
pull / fetch (engine.request, the transport) and the packs copied in (copies.compose).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from typing import Any, Mapping

import jax
import torch

from jax_m2n._src.errors import (PlanUnknown, ReshardError, ReshardRuntimeError,
                                 ReshardTypeError, ReshardValueError, Unconfirmed,
                                 VersionGone)
from jax_m2n._src.jobs import engine, local
from jax_m2n._src.jobs import manifest as manifest_lib, pulling
from jax_m2n._src.jobs.pull import Pull, wait_arrived
from jax_m2n._src.torch import copies, planning, targets as targets_lib
from jax_m2n._src.torch.targets import TORCH_OF, dotted

API = "jax_m2n.torch.Subscriber"


def pieces_shape(pack) -> tuple[int, ...]:
  """What one pack arrives as (engine.pack_spec's rule): its one box's shape, or its
  boxes flattened and concatenated."""
  if len(pack) == 1:
    return tuple(hi - lo for lo, hi in pack[0].box)
  return (sum(math.prod(hi - lo for lo, hi in op.box) for op in pack),)


@dataclasses.dataclass(frozen=True)
class TorchPull:
  """What the last pull did on this rank: its version, data path ("local" or
  "network"), the bytes this rank received (wire dtype; the local path reads them out
  of the trainer's memory), the targets written, its seconds (wall) and their phases:
  `wait_s` (the version's long poll, where it was not overlapped) and `move_s` (the
  bytes' way in, with the answer's confirmation)."""
  version: int
  path: str
  nbytes: int
  targets: int
  seconds: float
  phases: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Request:
  manifest: manifest_lib.Manifest
  options: Any


@dataclasses.dataclass
class Held:
  """What a torch Subscriber keeps between pulls."""
  state: pulling.State
  rank: int
  world_size: int
  mapped: dict = dataclasses.field(default_factory=dict)   # (process, mid) -> Mapped
  sources: dict = dataclasses.field(default_factory=dict)  # the copies per plan, slots
  waited: float = 0.0
  last_pull: Any = None

  def close(self) -> None:
    self.sources.clear()
    self.mapped.clear()
    self.state.close()  # (closes the imports)


def pull(held, api, options, names, placements, dtypes, shapes, tensors_of) -> int:
  state = held.state
  deadline = time.monotonic() + options.timeout_s
  while True:
    started = time.monotonic()
    got = None
    ahead = pulling.Ahead.begin(state, options) if state.path == "local" else None
    if ahead is not None:  # the copy runs while the publisher confirms the version
      try:
        return attempt(held, api, options, names, placements, dtypes, shapes,
                             tensors_of, ahead.number, ahead.mid, started, ahead)
      except (Unconfirmed, VersionGone):
        got = ahead.answer()  # the publisher's word (raises where it closed or died)
      except BaseException:
        ahead.drain()
        raise
    elif (options.path != "local" and options.version is None
        and state.net_mid in state.manifests and state.path == "network"):
      # A steady network pull: the newest after the last one and its bytes in one
      # message (answered within 1.5 s: a dead publisher is named that fast).
      try:
        return attempt(held, api, options, names, placements, dtypes, shapes,
                             tensors_of, None, state.net_mid, started)
      except Unconfirmed as e:
        got = e.got  # a newer version of another layout set, or none yet
    if got is None:
      waited = time.monotonic()
      number, mid = pulling.choose(state, options, deadline)
      held.waited = time.monotonic() - waited
    else:
      number, mid = got
    try:
      return attempt(held, api, options, names, placements, dtypes, shapes,
                           tensors_of, number, mid, started)
    except VersionGone:
      if options.version is not None:
        raise
      # dropped while we read it: the next newest


def attempt(held, api, options, names, placements, dtypes, shapes, tensors_of,
             number: int | None, mid: str, started: float, ahead: Any = None) -> int:
  """Pulls version `number` of layout set `mid` (None: the newest after the last
  pull, named by the publisher's answer: the network path only)."""
  state = held.state
  m = manifest(held, mid)
  want = dtypes if isinstance(dtypes, dict) else dtypes_of(api, m, names, dtypes)
  ts = targets_lib.resolve(api, m, names, placements, want, shapes, held.rank,
                           held.world_size)
  rp = planning.plan_rank(api, m, ts, held.rank, held.world_size)
  tensors = tensors_of(ts)
  written: list[str] = []
  moved = time.monotonic()
  try:
    p = "network"
    if number is not None and pulling.local_path_of(api, options, m):
      cuda = {t.device.index if t.device.index is not None else
              torch.cuda.current_device() for t in tensors if t.is_cuda}
      on_cpu = all(not t.is_cuda for t in tensors)
      # A request is open while a snapshot's Ahead waits for its answer; a lent one's
      # Ahead has none (it is confirmed after the copy).
      open_request = ahead is not None and not ahead.lent
      mapped = (imports(held, api, options, m, rp, open_request,
                        None if on_cpu else next(iter(cuda)))
                if on_cpu or len(cuda) == 1 and all(t.is_cuda for t in tensors)
                else None)
      if mapped is not None:
        p = "local"
        run_local(held, api, options, m, rp, mapped, number, tensors, written,
                  open_request)
        if ahead is not None and not ahead.confirmed():
          raise Unconfirmed  # (a valid version, but not the one to return)
      elif ahead is not None:
        raise Unconfirmed
    if p == "network":
      number = run_network(held, api, options, m, rp, number, tensors, written)
  except (VersionGone, Unconfirmed):
    raise
  except ReshardError as e:
    msg = (f"{e} Tensors written before the failure: {written or 'none'} (the "
           "others hold what they held).")
    err = type(e)(msg)
    err.written = list(written)
    raise err from e
  state.version = max(state.version, number)
  state.path = p
  if p == "network":
    state.net_mid = m.id
  else:
    state.local_mid = m.id
  total = time.monotonic() - started
  held.last_pull = TorchPull(number, p, rp.nbytes, len(ts), total,
                             {"wait_s": held.waited,
                              "move_s": time.monotonic() - moved})
  held.waited = 0.0
  return number


def manifest(held, mid: str) -> manifest_lib.Manifest:
  m = held.state.manifests.get(mid)
  if m is None:
    reply = held.state.connections.root().call({"op": "manifest", "id": mid},
                                                pulling.REQUEST_S, "a manifest")
    m = manifest_lib.from_json(reply.get("manifest"))
    if m.id != mid:
      raise ReshardRuntimeError(f"{API}: the manifest must match its id; got another.")
    if len(held.state.manifests) >= pulling.MAX_MANIFESTS:
      held.state.manifests.pop(next(iter(held.state.manifests)))
    held.state.manifests[mid] = m
  return m


def imports(held, api, options, m, rp, ahead: bool = False, ordinal: int | None = None
            ) -> dict[int, Any] | None:
  """The exports this rank reads, mapped (once per layout set and publisher process,
  kept in `State.imports`): host memory (copies.Mapped), or where the targets are on
  CUDA device `ordinal` a GPU export of lent allocations (copies.DeviceMapped); None
  where one declines or cannot be read so (the network then)."""
  out = {}
  imports = held.state.imports
  procs = sorted({m.devices[k] for boxes in rp.boxes.values() for k, _ in boxes})
  for p in procs:
    mp = held.mapped.get((p, m.id))
    if mp is None or imports.get((p, m.id)) is not mp.imp:
      if ahead:
        raise Unconfirmed  # (mapping is a control call: not while one is open)
      link = held.state.connections.link(p, m)
      reply = link.client.call(local.describe_request(m.id),
                               max(pulling.REQUEST_S, options.timeout_s),
                               "the local export")
      gpu = reply.get("platform", "cpu") != "cpu"
      readable = reply.get("local") and (
          (not gpu and ordinal is None) or (gpu and ordinal is not None and bool(
              reply.get("rows")) and not reply.get("handles")))
      if not readable:  # (CUDA IPC slots, or memory on the other side of a copy)
        if options.path == "local":
          raise ReshardValueError(
              f"{api}: path='local' needs {link.name}'s export where the targets are "
              f"({'CUDA' if ordinal is not None else 'host'} memory); got "
              f"{reply.get('why') or reply.get('platform')}.")
        return None
      held.sources.clear()
      while len(imports) >= pulling.MAX_MANIFESTS:
        key = next(iter(imports))
        imports.pop(key).close()
        held.mapped.pop(key, None)
      args = ((reply, link.name, m.id) if "manifest_id" in inspect.signature(
          local.Import).parameters else (reply, link.name))
      imp = imports[(p, m.id)] = local.Import(*args)
      mp = held.mapped[(p, m.id)] = (copies.Mapped(imp) if not gpu else
                                     copies.DeviceMapped(imp, ordinal))
    out[p] = mp
  return out


def run_local(held, api, options, m, rp, mapped, number, tensors, written,
              ahead: bool = False) -> None:
  """Reads version `number` out of the mapped exports with torch copies, between the
  two reads of each slot's header; a lent version (the trainer's own arrays) is
  confirmed with its publisher processes after the copies (the jobs layer's confirm)."""
  deadline = time.monotonic() + min(local.COMMIT_WAIT_S, options.timeout_s)
  slots = {p: mp.imp.slot_of(number, deadline) for p, mp in mapped.items()}
  links = {p: held.state.connections.link(p, m) for p in mapped}
  gpu = any(isinstance(mp, copies.DeviceMapped) for mp in mapped.values())
  lent = any(getattr(mp.imp, "lent", lambda s: False)(slots[p])
             for p, mp in mapped.items())
  if lent and ahead:
    raise Unconfirmed  # (its confirmation is a control call: not while one is open)
  for p, mp in mapped.items():
    if not mp.imp.alive():
      if gpu:
        mp.imp.unmap()  # (a mapping would keep the dead trainer's GPU memory)
      raise ReshardRuntimeError(f"{api}: {mp.imp.name} must be alive to be read from; "
                                "it exited.")
    if gpu:
      ids = mp.imp.missing(slots[p])
      if ids:
        mp.imp.map(links[p].client, ids, mp.ordinal, min(options.timeout_s, local.MAP_S))
  key = (id(rp), tuple(sorted((p, id(mp), s) for (p, mp), s in
                              zip(mapped.items(), slots.values()))))
  sources = None if gpu else held.sources.get(key)  # (GPU: a version's allocations)
  if sources is None:
    if len(held.sources) > 64:
      held.sources.clear()
    sources = (rp, copies.local_sources(rp, m, mapped, slots))
    if not gpu:
      held.sources[key] = sources
  copies.copy_local(sources[1], tensors, [t.name for t in rp.targets], written)
  if gpu:
    torch.cuda.current_stream().synchronize()
  for p, mp in mapped.items():  # the seqlock's second read
    if int(mp.imp.header[slots[p]]) != number:
      raise VersionGone(f"{api}: version {number} was overwritten on {mp.imp.name} "
                        "while it was copied.")
  if lent:
    local.confirm(Pull(Request(m, options), rp, number, links, None),
                  {p: mp.imp for p, mp in mapped.items()}, slots,
                  min(options.timeout_s, local.CONFIRM_S))
  if gpu:
    for mp in mapped.values():
      mp.imp.trim()


def run_network(held, api, options, m, rp, number, tensors, written) -> int:
  conn = held.state.connections
  transport = conn.transport(m)
  links = {k: conn.link(k, m) for k in rp.requests}
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  where = copies.where_leaves(rp)
  touched: set[int] = set()
  for attempt in range(2):
    pull = Pull(Request(m, options), rp, number, links, transport,
                after=held.state.version)
    if number is None and (len(rp.requests) != 1 or not transport.early_fetch or
                           engine.plan_key(rp) not in links[next(iter(links))].plans):
      raise Unconfirmed  # (a first pull of this plan, or from several processes)
    try:
      tickets, opened = engine.request(pull, max(pulling.REQUEST_S, options.timeout_s))
      if not transport.early_fetch:
        engine.confirm(pull, opened, max(pulling.REQUEST_S, options.timeout_s))
      pending = []
      for k, groups in rp.packed_requests.items():
        for ticket, packs in zip(tickets[k], groups):
          specs = [jax.ShapeDtypeStruct(
              pieces_shape(pack), rp.wire[pack[0].tensor], sharding=cpu)
              for pack in packs]
          pending.append((links[k].name, packs, transport.fetch(
              links[k].address, ticket, specs, timeout_s=options.timeout_s)))
      if transport.early_fetch:  # (a pull of the newest: bounded by 1.5 s)
        engine.confirm(pull, opened, max(pulling.REQUEST_S, options.timeout_s))
      for name, packs, fetch in pending:
        [arrays] = wait_arrived(pull, [(name, fetch)], "the pieces")
        copies.compose(packs, arrays, where, tensors, touched)
        written[:] = [rp.targets[i].name for i in sorted(touched)]
      return pull.number
    except PlanUnknown:
      if attempt:
        raise


def dtypes_of(api: str, m: manifest_lib.Manifest, names, dtype) -> dict[str, torch.dtype]:
  """Per torch name the mapping gives, the dtype delivered: `dtype` (one, or per name),
  else the published dtype of its first part."""
  out: dict[str, torch.dtype] = {}
  for leaf in m.leaves:
    into = names(dotted(leaf.path))
    name = into if isinstance(into, str) else getattr(into, "name", None)
    if name is None or name in out:
      continue
    d = dtype.get(name) if isinstance(dtype, Mapping) else dtype
    if d is None:
      d = TORCH_OF.get(manifest_lib.dtype_of(leaf.dtype))
    if not isinstance(d, torch.dtype):
      raise ReshardTypeError(f"{api}: dtype must be None, a torch.dtype or a mapping of "
                             f"them; got {d!r} for {name!r}.")
    out[name] = d
  return out
