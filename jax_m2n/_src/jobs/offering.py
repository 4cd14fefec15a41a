"""What a publisher process serves off its server thread (on the Service's worker
thread): the plans subscribers registered, the pieces of a held version cut in their
wire dtypes (straight out of the export on CPU) and offered through the transport,
the offers withdrawn when their version is dropped, and the local exports described.

Owns the offers' tickets and their bound (OFFER_TTL_S), the registered plans (MAX_PLANS)
and how a plan's packs are cut. Every field of a request is checked before use. Never
runs on the server thread; plans nothing; holds no version itself (versions.py does).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jax_m2n._src import local_copy as local_copy_lib
from jax_m2n._src import schedule
from jax_m2n._src.errors import ProtocolError, ReshardError, VersionGone
from jax_m2n._src.jobs import channel, delta, engine, exports
from jax_m2n._src.jobs import manifest as manifest_lib, messages, pieces, relay
from jax_m2n._src.jobs.counters import Counters
from jax_m2n._src.jobs.versions import Version, Versions
from jax_m2n._src.layout import Box, box_size
from jax_m2n._src.planner import DST_SHARD, SRC_SHARD
from jax_m2n._src.processes import transfer_engine

logger = logging.getLogger("jax_m2n")

# The answer to a pull naming a plan this process does not hold (the subscriber
# registers it again).
_UNKNOWN_PLAN = {"error": "pull: the plan must be registered with this process; it is "
                 "not (dropped, or this process restarted).", "kind": "unknown_plan"}
# Registered plans a publisher process keeps (a plan is its piece list: kilobytes to
# megabytes), least recently used dropped.
MAX_PLANS = 256
# An offer not fetched within this is dropped (a subscriber fetches at once; one that
# failed or went away leaves nothing behind for longer), whatever the pull's timeout.
OFFER_TTL_S = 60.0
# A plan's packs of at most this many bytes in all, each piece in its published dtype,
# are cut from a CPU export with numpy where the transport takes host arrays: a copy of
# a few microseconds where one XLA copy program per device costs ~0.25 ms of dispatch
# (issue 43: small pulls). Larger ones keep the compiled copies (parallel per device).
HOST_CUT_BYTES = 1 << 20


class Offers:
  """A publisher process's offers and registered plans (worker thread only, but for
  `offered`).

  Args:
    pid: this process's index in the trainer job.
    versions: its held versions.
    transport: its transport (counted: counters.py).
    counters: what it counts as it serves.
  """

  def __init__(self, pid: int, versions: Versions, transport: Any, counters: Counters):
    self._pid = pid
    self.counters = counters
    self._versions = versions
    self._transport = transport
    self._host = transport.host_offers  # small plans cut with numpy (HOST_CUT_BYTES)
    # The plans subscribers registered (`register`; a `pull` then names one), least
    # recently used dropped.
    self._plans: collections.OrderedDict[tuple[bytes, str], _Plan] = (
        collections.OrderedDict())
    self._offers: dict[int, list[int]] = {}  # version -> tickets offered

  def offered(self) -> list[int]:
    """The versions with offers out (any thread: a snapshot of the keys)."""
    return list(self._offers)

  def register(self, caller: channel.Caller, body: dict[str, Any]) -> dict[str, Any]:
    """Keeps a subscriber's plan (the groups of pieces it pulls from this process, its
    wire dtypes and a random salt for the tickets) under its key: a `pull` then names
    the plan, so a pull that recurs sends no piece list."""
    key = messages.field(body, "plan", str, max_len=64)
    want = messages.field(body, "manifest", str, max_len=64)
    try:
      salt = bytes.fromhex(messages.field(body, "salt", str, max_len=64))
    except ValueError:
      salt = b""
    if len(salt) < 16:
      raise ProtocolError("register: salt must be at least 16 bytes of hex.")
    version = self._versions.newest_of(want)
    if version is None:
      return {"error": f"manifest {messages._short(want)} must belong to a held version; "
              "got an unknown one (dropped: pull again).", "kind": "gone"}
    wire = manifest_lib.wire_field(body, "register", len(version.manifest.leaves))
    groups = _groups(version, body.get("groups"), wire)
    cutters: list[dict] = [{} for _ in groups]
    if _from_export(version):  # prepared now: a pull of the plan only runs them
      for ops, made in zip(groups, cutters):
        made[version.manifest.id] = _cutter(version, ops, wire, self._host)
    self._plans[(caller.peer, key)] = _Plan(want, wire, groups, salt, [], cutters)
    self._plans.move_to_end((caller.peer, key))
    while len(self._plans) > MAX_PLANS:
      self._plans.popitem(last=False)
    return {"registered": key}

  def local(self, body: dict[str, Any]) -> dict[str, Any]:
    """A subscriber on this host asks for the export of a layout set (to read its
    versions straight from memory): where it is, and a one-use ticket for its fd."""
    want = messages.field(body, "manifest", str, max_len=64)
    host = messages.field(body, "host", str, max_len=300)
    if not host or host != exports.host_identity():
      return {"local": False, "why": "another host (or namespace, or user)"}
    try:
      export = self._versions.export_for(want)
    except ReshardError as e:
      return {"local": False, "why": str(e)}
    if export is None:
      return {"error": f"manifest {messages._short(want)} must belong to a held version; "
              "got an unknown one (dropped: pull again).", "kind": "runtime"}
    return {"local": True, **export.describe()}

  def answer(self, caller: channel.Caller, body: dict[str, Any]) -> dict[str, Any]:
    """A pieces, pull or delta request for a published version: gone, or served."""
    version = self._versions.get(body["version"])
    if version is None:
      return {"error": f"version {body['version']} must be held to be pulled; trainer "
              f"process {self._pid} holds {self._versions.numbers()} "
              f"(keep={self._versions.keep}).", "kind": "gone"}
    self.counters.serving(version.number)  # the offers below count to it
    if body["op"] == "delta":
      return delta.serve(version, self._versions.get(body["base"]), body,
                         self._transport)
    if body["op"] == "pull":
      return self._pull(caller, version, body)
    if body["op"] == "digests":  # a relay member's check of what members send it
      wire = manifest_lib.wire_field(body, "digests", len(version.manifest.leaves))
      return relay.chunk_digests([cut(version, ops, wire) for ops in _groups(
          version, body.get("groups"), wire)], body)
    return self._pieces(version, body)

  def _pull(self, caller: channel.Caller, version: Version, body: dict[str, Any]
            ) -> dict[str, Any]:
    """Offers a registered plan's groups of `version` under the tickets both sides
    derive from the plan's salt and the pull's number (the subscriber fetches them
    before this answer arrives: one round trip before the bytes flow)."""
    plan = self._plans.get((caller.peer, body["plan"]))
    if plan is None:
      return dict(_UNKNOWN_PLAN)
    if plan.manifest != version.manifest.id:
      return {"error": f"pull: version {version.number} must have the plan's layout set; "
              "it has another (register the new one).", "kind": "unknown_plan"}
    self._plans.move_to_end((caller.peer, body["plan"]))
    timeout_s = body["timeout_ms"] / 1000
    for ticket in plan.last:  # the subscriber's previous pull of this plan is over
      self._transport.cancel(ticket)
    plan.last[:] = [self._offer(version.number, cut(version, ops, plan.wire,
                                                    plan.cutters[g], self._host), timeout_s,
                                engine.pull_ticket(plan.salt, body["seq"], g))
                    for g, ops in enumerate(plan.offers)]
    return {"offered": len(plan.offers)}

  def newest(self, caller: channel.Caller, body: dict[str, Any]
             ) -> tuple[dict[str, Any], Callable[[], Any] | None]:
    """A pull of the newest version after body["after"] (or of body["want"]), answered
    at once from the server thread: (the answer: the version, {"newer": [version,
    manifest id]} of another layout set, {"newer": None}, or an error; the work that
    offers it on the worker thread, or None)."""
    numbers = self._versions.numbers()
    if "want" in body:  # a version named by number (published: the caller checked)
      version = self._versions.get(body["want"])
      if version is None:
        return {"error": f"version {body['want']} must be held to be pulled; trainer "
                f"process {self._pid} holds {numbers} (keep={self._versions.keep}).",
                "kind": "gone"}, None
    else:
      version = self._versions.get(max(numbers)) if numbers else None
    if version is None or version.number <= body["after"]:
      return {"newer": None}, None  # dropped meanwhile (a close): it asks the usual way
    plan = self._plans.get((caller.peer, body["plan"]))
    if plan is None:
      return dict(_UNKNOWN_PLAN), None
    if plan.manifest != version.manifest.id:
      return {"newer": [version.number, version.manifest.id]}, None

    def offer() -> None:
      self.counters.serving(version.number)
      got = self._pull(caller, version, body)
      if "error" in got:  # (the plan was dropped since: the subscriber's fetch times out)
        logger.warning("jax_m2n Publisher: offering version %d failed: %s",
                       version.number, got["error"])
    return {"version": version.number}, offer

  def _pieces(self, version: Version, body: dict[str, Any]) -> dict[str, Any]:
    """Cuts the asked boxes of a held version (in their wire dtypes), offers each
    group through the transport, and returns the tickets."""
    wire = manifest_lib.wire_field(body, "pieces", len(version.manifest.leaves))
    offers = _groups(version, body.get("groups"), wire)
    timeout_s = body["timeout_ms"] / 1000
    if "chunk_bytes" in body:  # a relay's head (or a re-route): chunks, one offer each
      return relay.offer_chunks(
          lambda arrays: self._offer(version.number, arrays, timeout_s),
          [cut(version, ops, wire) for ops in offers], body)
    return {"tickets": [self._offer(version.number, cut(version, ops, wire), timeout_s)
                        for ops in offers]}

  def _offer(self, version: int, arrays: list[Any], timeout_s: float,
             ticket: int | None = None) -> int:
    """Offers through the transport for at most OFFER_TTL_S, remembering the ticket
    under its version (withdrawn when the version is dropped)."""
    ticket = self._transport.offer(arrays, min(timeout_s, OFFER_TTL_S), ticket=ticket)
    self._offers.setdefault(version, []).append(ticket)
    return ticket

  def withdraw(self, versions: list[int]) -> None:
    for v in versions:
      for ticket in self._offers.pop(v, []):
        self._transport.cancel(ticket)


def _groups(version: Version, groups: Any, wire: dict[int, Any]) -> list:
  """A request's groups of packs of pieces, each checked (inside this process's
  shards, one device and wire dtype per pack, the byte budget)."""
  m = version.manifest
  if not isinstance(groups, list) or not groups or len(groups) > 1 << 16:
    raise ProtocolError("pieces: groups must be a non-empty list of piece lists.")
  budget = manifest_lib.request_budget(version.nbytes)
  offers = []
  for group in groups:
    if not isinstance(group, list) or not group:
      raise ProtocolError("pieces: every group must be a non-empty list of packs.")
    packs = []
    for pack in group:
      ops = [transfer_engine.Op(t, k, -1, SRC_SHARD, DST_SHARD, box, "inject")
             for t, k, box in manifest_lib.pieces_field(pack, "pieces", m.leaves,
                                                        version.shards, wire, budget)]
      if len({op.src for op in ops}) != 1 or len({wire[op.tensor] for op in ops}) != 1:
        raise ProtocolError("pieces: the pieces of a pack must share a device and a "
                            "wire dtype.")
      packs.append(ops)
    offers.append(packs)
  return offers


class _Plan(NamedTuple):
  """A plan a subscriber registered with this process."""
  manifest: str
  wire: dict[int, Any]
  offers: list  # per group, its packs of ops
  salt: bytes
  last: list[int]  # the tickets of its last pull's offers
  cutters: list[dict]  # per group, how `cut` cuts it out of an export (made once)


def cut(version: Version, packs: list[list[transfer_engine.Op]],
        wire: dict[int, np.dtype], cutters: dict[str, _Cutter] | None = None,
        host: bool = False) -> list[Any]:
  """One array per pack: its one box in the wire dtype (the snapshot itself where that
  is a whole shard in its own dtype), or its boxes flattened and concatenated; one
  compiled program per source device. A version that lives only in its export (CPU)
  is cut straight out of it: new arrays, never views of the slot, so a slot reused for
  a newer version cannot change what an offer serves; with `host` (the transport takes
  host arrays) a small plan's are numpy arrays (HOST_CUT_BYTES)."""
  if _from_export(version):
    if cutters is None:
      return _cut_export(version, _cutter(version, packs, wire, host))
    if version.manifest.id not in cutters:
      cutters[version.manifest.id] = _cutter(version, packs, wire, host)
    return _cut_export(version, cutters[version.manifest.id])
  batches: dict[int, pieces.Batch] = {}
  slots = []
  for ops in packs:
    k, dtype = ops[0].src, wire[ops[0].tensor]
    batch = batches.setdefault(k, pieces.Batch())
    boxes = []
    for op in ops:
      held, array = version.shard(op.tensor, k, dtype)
      starts = tuple(lo - h for (lo, _), (h, _) in zip(op.box, held))
      limits = tuple(hi - h for (_, hi), (h, _) in zip(op.box, held))
      shape = pieces.shape_of(op.box)
      boxes.append(([((array, -1, pieces.shape_of(held)), starts, limits,
                      (0,) * len(shape))], shape))
    if len(ops) == 1:
      slots.append((k, batch.box(boxes[0][0], boxes[0][1], dtype, dtype)))
    else:
      slots.append((k, batch.pack(boxes, dtype)))
  results = {k: b.run() for k, b in batches.items()}
  return [results[k][j] for k, j in slots]


def _from_export(version: Version) -> bool:
  """Whether the version lives only in its export (CPU: the export is the snapshot)."""
  return version.export is not None and version.slot >= 0 and any(
      a is None for _, a in version.shards.values())


class _Cutter(NamedTuple):
  """How `_cut_export` cuts one list of packs out of an export slot: per source device,
  its prepared local_copy, its sources' offsets in a slot and, per output, (pack,
  wire dtype). The same for every version of a layout set: made once per plan."""
  devices: dict[int, tuple[Callable, np.ndarray, list[tuple[int, Any]]]]
  parts: list[int]  # per pack, the outputs it is concatenated from
  # Or, for a small plan in its published dtypes: per pack, its boxes as (leaf, device,
  # held shape, dtype, slices) read with numpy (HOST_CUT_BYTES); else None.
  host: list[list[tuple[int, int, tuple[int, ...], np.dtype, tuple[slice, ...]]]] | None


def _contiguous(box: Box, held: Box) -> int | None:
  """Where `box` starts in its held shard, flattened, if its elements lie there in one
  run (row-major); else None."""
  inner = True  # every dimension after this one is whole
  for (lo, hi), (h_lo, h_hi) in reversed(list(zip(box, held))):
    if not inner and hi - lo != 1:
      return None
    inner = inner and (lo, hi) == (h_lo, h_hi)
  flat, stride = 0, 1
  for (lo, _), (h_lo, h_hi) in reversed(list(zip(box, held))):
    flat += (lo - h_lo) * stride
    stride *= h_hi - h_lo
  return flat


def _cutter(version: Version, packs: list[list[transfer_engine.Op]],
            wire: dict[int, np.dtype], host: bool = False) -> _Cutter:
  """A pack of several boxes that each lie in one run of their shard is one flat
  output (its boxes copied as runs); any other box is an output of its own (a pack of
  those is concatenated after the copy). With `host`, a small plan whose pieces are all
  in their published dtype is read with numpy instead (`_Cutter.host`)."""
  m, export = version.manifest, version.export
  ops_all = [op for ops in packs for op in ops]
  if host and export.platform == "cpu" and all(
      manifest_lib.dtype_of(m.leaves[op.tensor].dtype) == wire[op.tensor]
      for op in ops_all) and sum(box_size(op.box) * np.dtype(wire[op.tensor]).itemsize
                                 for op in ops_all) <= HOST_CUT_BYTES:
    reads = []
    for ops in packs:
      reads.append([])
      for op in ops:
        held = version.shards[(op.tensor, op.src)][0]
        reads[-1].append((op.tensor, op.src, pieces.shape_of(held), wire[op.tensor],
                          tuple(slice(lo - h, hi - h)
                                for (lo, hi), (h, _) in zip(op.box, held))))
    return _Cutter({}, [len(ops) for ops in packs], reads)
  per_device: dict[int, tuple[list, list, list, list, dict]] = {}
  parts = []
  for j, ops in enumerate(packs):
    boxes, outs, sources, where, slot_of = per_device.setdefault(
        ops[0].src, ([], [], [], [], {}))
    to = wire[ops[0].tensor]  # one wire dtype per pack (checked)
    published = {manifest_lib.dtype_of(m.leaves[op.tensor].dtype) for op in ops}
    converts = all(d == to or schedule.fused_conversion(d, to) for d in published)
    held = [version.shards[(op.tensor, op.src)][0] for op in ops]
    runs = [_contiguous(op.box, h) for op, h in zip(ops, held)]
    flat = len(ops) > 1 and converts and None not in runs
    if flat:
      outs.append(local_copy_lib.Out((sum(box_size(op.box) for op in ops),), to))
      where.append((j, to))
    for op, h, run, at in zip(ops, held, runs, pieces.run_offsets([op.box for op in ops])):
      if (op.tensor, op.src) not in slot_of:
        slot_of[(op.tensor, op.src)] = len(sources)
        sources.append(export.offsets[(op.tensor, op.src)])
      slot, published = slot_of[(op.tensor, op.src)], manifest_lib.dtype_of(
          m.leaves[op.tensor].dtype)
      if flat:
        boxes.append(local_copy_lib.Box(len(outs) - 1, slot, (box_size(h),), published,
                                        (run,), (at,), (box_size(op.box),)))
        continue
      shape = pieces.shape_of(op.box)
      boxes.append(local_copy_lib.Box(
          len(outs), slot, pieces.shape_of(h), published,
          tuple(lo - h_lo for (lo, _), (h_lo, _) in zip(op.box, h)), (0,) * len(shape),
          shape))
      outs.append(local_copy_lib.Out(shape, to if to == published or (
          schedule.fused_conversion(published, to)) else published))
      where.append((j, to))
    parts.append(1 if flat else len(ops))
  return _Cutter({k: (local_copy_lib.copier(version.devices[k], boxes, outs,
                                            len(sources)),
                      np.array(sources, np.int64), where)
                  for k, (boxes, outs, sources, where, _) in per_device.items()}, parts,
                 None)


def _cut_export(version: Version, cutter: _Cutter) -> list[jax.Array]:
  """`cut` out of the version's export slot: one local_copy per source device (its
  boxes into arrays of their own, converted where the copies convert), concatenated
  per pack of several boxes; the slot checked to still hold the version."""
  export = version.export
  got: list[list[jax.Array]] = [[] for _ in cutter.parts]
  with export.lock:
    if export.slot_of(version.number) != version.slot:
      raise VersionGone(f"Publisher: version {version.number} must still be held to be "
                        "served; it was dropped meanwhile.")
    if cutter.host is not None:  # copies (never views: the slot is written again)
      out = []
      for reads in cutter.host:
        boxes = [export.host_shard(t, k, version.slot, shape, dtype)[box]
                 for t, k, shape, dtype, box in reads]
        out.append(np.array(boxes[0]) if len(boxes) == 1 else
                   np.concatenate([b.reshape(-1) for b in boxes]))
      return out
    for k, (copy, offsets, where) in cutter.devices.items():
      arrays = copy(export.base(k, version.slot) + offsets)
      jax.block_until_ready(arrays)  # before the slot may be written again
      for (j, to), a in zip(where, arrays):
        got[j].append(a if a.dtype == to else pieces.converter(to)(a))
  return [parts[0] if n == 1 else pieces.flat_concatenate(n)(*parts)
          for n, parts in zip(cutter.parts, got)]
