"""Delta sync: a version crosses as only the elements that changed since the
subscriber's last one.

Owns both sides of a delta request: the publisher's (`serve`: compare the asked boxes
of the new version with the base version's, encode per stream, offer the arrays; or,
asked to `measure`, count the changes only) and the subscriber's (`choose`: delta or
full, with delta_auto.py's estimates for delta="auto"; `run`: ask, fetch, decode and
apply to its last result: in place where donated, with numpy on CPU), and the record of
that last result (`Last`, `_base`). The encoding itself is codec.py's (numpy, on CPU)
and delta_device.py's (compiled programs, on accelerators). Plans nothing (a delta pull
runs the flat plan's pieces) and never decides by itself that bytes are equal: what it
cannot prove the subscriber holds crosses dense. Threads: `serve` may run on several
worker threads at once (its one shared state, `stats`, under `_lock`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import weakref
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.errors import ReshardError, ReshardRuntimeError, ReshardValueError
from jax_m2n._src.jobs import codec, delta_auto, delta_device
from jax_m2n._src.jobs import manifest as manifest_lib, messages, pieces
from jax_m2n._src.jobs.codec import CHUNK, MODES
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.pull import API, Pull, wait_arrived
from jax_m2n._src.layout import Box

logger = logging.getLogger("jax_m2n")

# Counters for the bench and the tests: the publisher's ("publisher_*": elements
# compared, changed, bytes encoded against the dense bytes, seconds converting to the
# wire dtype and fetching to the host, seconds comparing and encoding, streams encoded
# on the device, chunks per mode, measure requests) and the subscriber's
# ("subscriber_*": bytes pulled against the dense bytes of the same pieces, the control
# reply's bytes, seconds decoding and applying, pulls by kind, auto's choices). Read it
# with `snapshot()` while pulls run on other threads.
stats: collections.Counter = collections.Counter()
_lock = threading.Lock()

# Where the publisher compares and encodes: None: on the device holding the shards
# except on CPU, where numpy on the shards' own host memory is 2-4x faster than XLA's
# CPU code for this bit-level work (1 GiB float32, 2% changed: numpy 1.0 s, XLA 2.6 s,
# measured on 2 cores); True / False force the device / numpy (tests run both).
DEVICE_ENCODE: bool | None = None


def snapshot() -> dict[str, Any]:
  """A copy of `stats`, consistent while `serve` runs on other threads."""
  with _lock:
    return dict(stats)


def _add(counts: collections.Counter) -> None:
  with _lock:
    stats.update(counts)


def _on_device(device: Any) -> bool:
  return device.platform != "cpu" if DEVICE_ENCODE is None else DEVICE_ENCODE


# ---------------------------------------------------------------------------------------
# The publisher's side
# ---------------------------------------------------------------------------------------

class _Member(NamedTuple):
  """A piece of a stream: leaf t's box `starts`..`limits` of `new` (a held shard in the
  wire dtype), compared with the base's same shard `old` (None: crosses dense)."""

  t: int
  new: jax.Array
  old: jax.Array | None
  starts: tuple[int, ...]
  limits: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(hi - lo for lo, hi in zip(self.starts, self.limits))


def serve(version: Any, base: Any, body: dict[str, Any], transport: Any) -> dict[str, Any]:
  """Answers a delta request: the asked pieces of `version`, per wire dtype one stream
  (the pieces concatenated in request order) encoded against the same boxes of `base`
  (a held version of the same manifest, or None: every chunk dense; the leaves in the
  request's `dense` cross dense too, not compared); the arrays (per stream bitmaps, runs
  and values, the empty ones left out) offered under one ticket (`transport.offer`).
  The reply's header lists per stream [dtype, values, runs, modes]; `changed` lists per
  compared leaf [leaf, changed, compared] and `encode_s` this request's compare +
  encode seconds per element (None where a program was compiled for it), what
  delta="auto" chooses by. A request with `measure` (a list of leaves) offers nothing:
  it counts the changes of those leaves' shards held here (`measured`; `_measure`). `version` and `base` are the publisher's held versions
  (versions.Version). Safe on several threads at once.
  """
  m = version.manifest
  wire = manifest_lib.wire_field(body, "delta", len(m.leaves))
  if base is not None and base.manifest.id != m.id:
    base = None  # another layout set: its shards are other boxes
  if "measure" in body:
    return _measure(version, base, body, wire)
  boxes = manifest_lib.pieces_field(body.get("pieces"), "delta", m.leaves,
                                    version.shards, wire,
                                    manifest_lib.request_budget(version.nbytes))
  dense = set(messages.int_list(body.get("dense", []), "delta: dense", 0,
                                len(m.leaves) - 1, len(m.leaves)))
  counts: collections.Counter = collections.Counter()
  # The held shards in the wire dtype (converted once per version on the first request
  # for it, as for full pulls), one stream per wire dtype: its pieces concatenated in
  # request order (the pieces of a model are many and often small: one encoding of the
  # stream, whose chunks span pieces).
  start = time.perf_counter()
  streams: dict[str, list[_Member]] = {}
  for t, k, box in boxes:
    held, new = version.shard(t, k, wire[t])
    old = None
    if (base is not None and t not in dense and (t, k) in base.shards
        and base.shards[(t, k)][0] == held):
      old = base.shard(t, k, wire[t])[1]
    streams.setdefault(wire[t].name, []).append(_Member(
        t, new, old, tuple(lo - h for (lo, _), (h, _) in zip(box, held)),
        tuple(hi - h for (_, hi), (h, _) in zip(box, held))))
  counts["publisher_convert_s"] += time.perf_counter() - start
  start = time.perf_counter()
  heads, arrays, changed = [], [], collections.Counter()
  compared, compiled = collections.Counter(), False
  for name in sorted(streams):
    members = streams[name]
    e, by_leaf, built = _encode(members, counts)
    compiled = compiled or built
    heads.append([name, int(e.values.size), int(e.runs.size // 2), e.modes.tolist()])
    arrays += [e.bitmaps, e.runs, e.values]
    for t, (c, n) in by_leaf.items():
      changed[t] += c
      compared[t] += n
    counts["publisher_elements"] += sum(p.size for p in members)
    counts["publisher_changed"] += e.changed
    counts["publisher_encoded_bytes"] += e.nbytes
    counts["publisher_dense_bytes"] += sum(p.size for p in members) * np.dtype(
        manifest_lib.dtype_of(name)).itemsize
    for mode, n in zip(*np.unique(e.modes, return_counts=True)):
      counts[f"publisher_chunks_{MODES[mode]}"] += int(n)
  seconds = time.perf_counter() - start
  per_element = (seconds / counts["publisher_elements"]
                 if not compiled and counts["publisher_elements"] else None)
  counts["publisher_encode_s"] += seconds
  counts["publisher_requests"] += 1
  _add(counts)
  offered = [a for a in arrays if a.size]
  ticket = None
  if offered:
    device = next(iter(version.shard(*boxes[0][:2], wire[boxes[0][0]])[1].devices()))
    ticket = transport.offer([jax.device_put(a, device) for a in offered],
                             body["timeout_ms"] / 1000)
  return {"ticket": ticket, "streams": heads,
          "base": base.number if base is not None else 0,
          "changed": [[t, changed[t], compared[t]] for t in sorted(compared)],
          "encode_s": per_element}


def _encode(members: list[_Member], counts: collections.Counter
            ) -> tuple[codec.Encoded, dict[int, tuple[int, int]], bool]:
  """One stream encoded (on the device holding its first piece, or with numpy), per
  compared leaf its (changed, compared) elements, and whether a program was compiled
  for it."""
  device = next(iter(members[0].new.devices()))
  n = sum(p.size for p in members)
  by_leaf: dict[int, list[int]] = {}
  if _on_device(device) and delta_device.supported(members[0].new.dtype, n):
    s = delta_device.encode([delta_device.Piece(
        p.new, p.old, p.starts, p.limits,
        delta_device.ALL if p.old is None else delta_device.COMPARE) for p in members],
        device)
    counts["publisher_device_streams"] += 1
    for p, c in zip(members, s.changed):
      if p.old is not None:
        got = by_leaf.setdefault(p.t, [0, 0])
        got[0] += c
        got[1] += p.size
    return s.encoded, {t: tuple(v) for t, v in by_leaf.items()}, s.compiled
  # numpy: on CPU np.asarray is the shard's own buffer; elsewhere a device-to-host copy
  news, masks = [], []
  for p in members:
    cut = tuple(slice(lo, hi) for lo, hi in zip(p.starts, p.limits))
    new = np.ascontiguousarray(np.asarray(p.new)[cut]).reshape(-1)
    mask = None
    if p.old is not None:
      mask = codec.changed(new, np.ascontiguousarray(np.asarray(p.old)[cut]).reshape(-1))
      got = by_leaf.setdefault(p.t, [0, 0])
      got[0] += int(mask.sum())
      got[1] += p.size
    news.append(new)
    masks.append(np.ones(new.size, bool) if mask is None else mask)
  e = codec.encode_changes(np.concatenate(news), np.concatenate(masks))
  return e, {t: tuple(v) for t, v in by_leaf.items()}, False


def _measure(version: Any, base: Any, body: dict[str, Any], wire: dict[int, Any]
             ) -> dict[str, Any]:
  """Counts, per asked leaf, the elements of its shards held here (each box once) whose
  wire bits differ from the base's: a full pull's fraction for delta="auto". With
  `calibrate` it encodes them (nothing offered) and reports the seconds per element
  (None where a program was compiled for it), for a subscriber that has no delta of
  its own to learn them from."""
  m = version.manifest
  leaves = set(messages.int_list(body["measure"], "delta: measure", 0,
                                 len(m.leaves) - 1, len(m.leaves)))
  if base is None:
    return {"measured": [], "base": 0}
  counts: collections.Counter = collections.Counter({"publisher_measures": 1})
  seen, members = set(), []
  for (t, k), (box, _) in sorted(version.shards.items()):
    if (t in leaves and (t, box) not in seen
        and base.shards.get((t, k), (None,))[0] == box):
      seen.add((t, box))
      dtype = wire.get(t, manifest_lib.dtype_of(m.leaves[t].dtype))
      new, old = version.shard(t, k, dtype)[1], base.shard(t, k, dtype)[1]
      members.append(_Member(t, new, old, (0,) * new.ndim, tuple(new.shape)))
  measured: dict[int, list[int]] = {}
  per_element = None
  if members and body.get("calibrate") is True:
    start, compiled = time.perf_counter(), False
    streams: dict[Any, list[_Member]] = {}
    for p in members:
      streams.setdefault(p.new.dtype, []).append(p)
    for group in streams.values():
      _, by_leaf, built = _encode(group, counts)
      compiled = compiled or built
      for t, (c, n) in by_leaf.items():
        got = measured.setdefault(t, [0, 0])
        got[0] += c
        got[1] += n
    if not compiled:
      per_element = (time.perf_counter() - start) / sum(p.size for p in members)
  elif members:
    for p, c in zip(members, _count(members)):
      got = measured.setdefault(p.t, [0, 0])
      got[0] += c
      got[1] += p.size
  _add(counts)
  return {"measured": [[t, c, n] for t, (c, n) in sorted(measured.items())],
          "base": base.number, "encode_s": per_element}


def _count(members: list[_Member]) -> list[int]:
  """Per member (whole shards), its changed elements: on the device or with numpy."""
  out: list[Any] = []
  for p in members:
    device = next(iter(p.new.devices()))
    if _on_device(device) and delta_device.supported(p.new.dtype, p.size):
      out.append(delta_device.count_changed(p.new, p.old))
    else:
      out.append(int(codec.changed(np.asarray(p.new).reshape(-1),
                                   np.asarray(p.old).reshape(-1)).sum()))
  return [int(c) for c in jax.device_get(out)]


# ---------------------------------------------------------------------------------------
# The subscriber's side
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Last:
  """A subscriber's last delta-enabled pull: what a delta applies to."""

  version: int
  manifest_id: str
  dsts: tuple[Any, ...]
  outs: tuple[np.dtype, ...]
  arrays: list[weakref.ref]


def record(number: int, manifest_id: str, dsts: Sequence[Any], outs: Sequence[Any],
           arrays: Sequence[jax.Array]) -> Last:
  return Last(number, manifest_id, tuple(dsts), tuple(np.dtype(o) for o in outs),
              [weakref.ref(a) for a in arrays])


@dataclasses.dataclass(frozen=True)
class Choice:
  """How one pull crosses (`choose`).

  Attributes:
    base: the previous result a delta applies to; None: a full pull.
    version: base's version (0: a full pull).
    compare: in a delta pull, the leaves the publisher compares (None: every leaf);
      the others cross dense.
    measure: after a full pull, the leaves whose change fraction to ask for
      (delta="auto"), against version `measure_base`.
    measure_base: the version they are measured against (0: none).
    estimates: delta="auto"'s estimates (None for delta=True / False).
    why: the reason, for logs.
  """

  base: list[jax.Array] | None
  version: int
  compare: frozenset[int] | None = None
  measure: frozenset[int] = frozenset()
  measure_base: int = 0
  estimates: delta_auto.Estimates | None = None
  why: str = ""


def choose(last: Last | None, estimates: delta_auto.Estimates, request: Any,
           local_path: bool, waits: Any) -> Choice:
  """Delta or full for this pull, before it is planned: delta=False, a local pull and a
  pull without a usable base (`_base`) are full; delta=True is a delta of every leaf;
  delta="auto" asks `estimates` (delta_auto.py) which leaves pay. In a multi-process
  generator job the processes agree first (`agree`)."""
  options, m = request.options, request.manifest
  base, why = None, "delta=False"
  if options.delta and not local_path:
    base, why = _base(last, m.id, request.dsts, request.outs, request.quantized)
  choice = Choice(base, last.version if base is not None else 0, why=why)
  if options.delta == "auto" and not local_path:
    estimates.layout(m.id)
  if options.delta == "auto" and base is not None:
    d = estimates.decide([
        (t, math.prod(leaf.shape), schedule.source_dtype(
            manifest_lib.dtype_of(leaf.dtype), out).itemsize)
        for t, (leaf, out) in enumerate(zip(m.leaves, request.outs))])
    choice = (Choice(base, last.version, d.compare, estimates=estimates, why=d.why)
              if d.delta else
              Choice(None, 0, None, d.measure, last.version, estimates, d.why))
  elif options.delta == "auto" and not local_path:
    choice = dataclasses.replace(choice, estimates=estimates)
  if waits is not None:
    choice = agree(waits, choice, len(m.leaves), options.delta == "auto")
  counts = collections.Counter()
  if options.delta and choice.base is None:
    counts["subscriber_full_pulls"] += 1
  if options.delta == "auto":
    counts[f"subscriber_auto_{'full' if choice.base is None else 'delta'}"] += 1
  _add(counts)
  logger.debug("Subscriber.pull: %s (%s)", f"as a delta against {choice.version}"
               if choice.base is not None else "in full", choice.why)
  return choice


def _base(last, manifest_id, dsts, outs, quantized):
  """The previous result a delta pull applies to, or None and why not: no earlier
  pull, another layout set, dst layouts or dtypes, Quantize leaves (they cross full:
  their values are quantized on arrival, so no earlier raw values are held), or arrays
  that were dropped, deleted or donated elsewhere (never assumed to hold old bytes)."""
  if quantized:
    return None, "a Quantize leaf (crosses full)"
  if last is None:
    return None, "no earlier pull"
  if last.manifest_id != manifest_id:
    return None, "another published layout set"
  if last.dsts != tuple(dsts) or last.outs != tuple(np.dtype(o) for o in outs):
    return None, "other dst layouts or dtypes"
  arrays = [r() for r in last.arrays]
  if any(a is None or a.is_deleted() for a in arrays):
    return None, "the previous arrays were dropped, deleted or donated elsewhere"
  if any(a.size >= 1 << 31 for a in arrays):
    return None, "a shard of 2**31 elements or more (positions are int32)"
  return arrays, ""


def agree(waits: Any, choice: Choice, leaves: int, auto: bool) -> Choice:
  """In a multi-process generator job, every process must pull against the same base
  (a delta on one, a full copy on another would leave them without a common plan).
  With delta=True a mismatch is an error; with delta="auto" the job pulls in full
  unless every process chose a delta, then compares the leaves any of them chose."""
  mine = str(choice.version)
  if auto and choice.base is not None:
    mask = np.zeros(leaves, bool)
    mask[sorted(choice.compare if choice.compare is not None else range(leaves))] = True
    mine += " " + np.packbits(mask).tobytes().hex()
  waits.post("delta", mine)
  theirs = waits.gather("delta", waits.peers, "the delta base of every process")
  if auto:
    parts = [v.split(" ") for v in theirs]
    if choice.base is None or any(len(p) != 2 or p[0] != str(choice.version)
                                  for p in parts):
      return dataclasses.replace(choice, base=None, version=0, compare=None,
                                 why=choice.why if choice.base is None else
                                 "another process of the job pulls in full")
    union = np.zeros(leaves, bool)
    for _, bits in parts:
      union |= np.unpackbits(np.frombuffer(bytes.fromhex(bits), np.uint8),
                             count=leaves).astype(bool)
    return dataclasses.replace(choice, compare=frozenset(np.flatnonzero(union).tolist()))
  bad = {p: v for p, v in zip(waits.peers, theirs) if v != mine}
  if bad:
    raise ReshardValueError(
        f"{API}: every process must pull against the same previous version "
        f"(delta=True applies to each process's last result); got base {mine} here and "
        f"{bad} elsewhere (a process whose previous arrays were deleted, or that skipped "
        "a pull). Hint: pull with delta=False once on every process. No data moved.")
  return choice


def run(pull: Pull, choice: Choice, donate: bool, answer_s: float
        ) -> list[list[jax.Array]]:
  """This process's delta pull: asks each publisher process for its pieces of the flat
  plan (each box once, however many local replicas hold it) encoded against
  `choice.version` (the leaves outside `choice.compare` dense), fetches them, and
  applies them to `choice.base` (the previous result, in the same dst layouts and
  dtypes): in place where `donate`, else to copies. Returns per leaf its local
  destination shards (in the order of the plan's `local_dst`). What it measured (change
  fractions, encode and apply costs) goes to `choice.estimates`."""
  pp, number, links = pull.plan, pull.number, pull.links
  began, programs = time.perf_counter(), codec.programs_built()
  devices = {d.id: d for d in jax.local_devices()}
  counts: collections.Counter = collections.Counter({"subscriber_delta_pulls": 1})
  # Each box once per process, from the first publisher device the flat plan reads it
  # from (its local replicas all apply the same delta).
  unique: dict[tuple[int, Box], tuple[int, int, list[int]]] = {}
  for k, groups in sorted(pp.requests.items()):
    for ops in groups:
      for op in ops:
        unique.setdefault((op.tensor, op.box), (k, op.src, []))[2].append(op.dst)
  asked: dict[int, list[tuple[int, int, Box, list[int]]]] = {}
  for (t, box), (k, s, dsts) in unique.items():
    asked.setdefault(k, []).append((t, s, box, dsts))
  counts["subscriber_dense_bytes"] += sum(
      math.prod(hi - lo for lo, hi in box) * pp.wire[t].itemsize
      for (t, box) in unique)
  landing = devices[asked[min(asked)][0][3][0]] if asked else None
  replies, pulled, changed, encode_s, compiled = {}, [], {}, [], False
  for k, pieces_ in asked.items():
    wire = sorted({t for t, *_ in pieces_})
    body = {"op": "delta", "version": number, "base": choice.version,
            "wire": [[t, pp.wire[t].name] for t in wire],
            "pieces": [[t, s - PUBLISHER_DEVICE_BASE, *[lo for lo, _ in box],
                        *[hi for _, hi in box]] for t, s, box, _ in pieces_],
            "timeout_ms": pull.options.timeout_ms}
    if choice.compare is not None:
      body["dense"] = [t for t in wire if t not in choice.compare]
    reply = links[k].client.call(body, answer_s, f"the delta of version {number}")
    counts["subscriber_reply_bytes"] += len(messages.encode(reply))
    streams = _streams(pp, pieces_, reply.get("streams"), links[k].name)
    _changes(reply, "changed", len(pp.wire), links[k].name, changed, encode_s)
    compiled = compiled or (bool(reply.get("changed")) and reply.get("encode_s") is None)
    specs = [(d, n) for _, _, sizes in streams for d, n in sizes]
    ticket = reply.get("ticket")
    fetched = any(n for _, n in specs)
    if fetched:
      if type(ticket) is not int or not 0 <= ticket < 1 << 64:
        raise ReshardRuntimeError(f"{API}: {links[k].name} must offer the delta's "
                                  "arrays; got no ticket.")
      sharding = jax.sharding.SingleDeviceSharding(landing)
      pulled.append((links[k].name, pull.transport.fetch(links[k].address, ticket, [
          jax.ShapeDtypeStruct((n,), d, sharding=sharding) for d, n in specs if n],
          timeout_s=pull.timeout_s)))
    replies[k] = (streams, fetched)
  got = iter(wait_arrived(pull, pulled, f"the delta of version {number}"))
  replies = {k: (streams, next(got) if fetched else [])
             for k, (streams, fetched) in replies.items()}
  counts["subscriber_pulled_bytes"] += sum(a.nbytes for _, arrays in replies.values()
                                           for a in arrays)
  start = time.perf_counter()
  updates: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
  for k, (streams, arrays) in replies.items():
    host = iter(np.asarray(a) for a in arrays)
    for members, modes, ((_, nbitmap), (_, nruns), (dtype, nvalues)) in streams:
      bitmaps, runs, values = (next(host) if n else np.zeros(0, d) for d, n in (
          (np.uint8, nbitmap), (np.int32, nruns), (dtype, nvalues)))
      sizes = [math.prod(hi - lo for lo, hi in box) for _, _, box, _ in members]
      offsets = np.cumsum([0] + sizes)
      positions = codec.decode(np.asarray(modes), bitmaps, runs, int(offsets[-1]))
      if positions.size != nvalues:
        raise ReshardRuntimeError(f"{API}: a delta from {links[k].name} must "
                                  f"carry one value per marked position; got {nvalues} "
                                  f"for {positions.size}.")
      cuts = np.searchsorted(positions, offsets)
      for (t, _, box, dsts), lo, a, b in zip(members, offsets, cuts, cuts[1:]):
        if a == b:
          continue
        shape = tuple(hi - lo_ for lo_, hi in box)
        for d in set(dsts):
          dbox = pp.plan.tensors[t].dst.box_of(d)
          at = codec.in_shard(positions[a:b] - lo, shape, box, dbox)
          updates.setdefault((t, d), []).append((at, values[a:b]))
  prevs = [jax_compat.single_device_arrays(choice.base[t])
           for t in range(len(pp.local_dst))]
  per_device: dict[int, list[tuple[int, int, jax.Array]]] = {}
  for t, local in enumerate(pp.local_dst):
    for j, (d, p) in enumerate(zip(local, prevs[t])):
      per_device.setdefault(d.id, []).append((t, j, p))
  out = [[None] * len(local) for local in pp.local_dst]
  for d, shards in per_device.items():
    on_host = codec.HOST_APPLY and devices[d].platform == "cpu"
    for start_ in range(0, len(shards), len(shards) if on_host else pieces.PROGRAM_BOXES):
      group = shards[start_:start_ + (len(shards) if on_host else pieces.PROGRAM_BOXES)]
      parts = [updates.get((t, d), []) for t, _, _ in group]
      new = (codec.apply_host if on_host else codec.apply_compiled)(
          pp, devices[d], group, parts, donate)
      for (t, j, _), a in zip(group, new):
        out[t][j] = a
  seconds = time.perf_counter() - start
  counts["subscriber_apply_s"] += seconds
  _add(counts)
  est = choice.estimates
  if est is not None:  # what delta="auto" learns (not from a pull that compiled)
    est.learn_changed(changed, full=False)
    if encode_s:
      est.learn_encode(sum(encode_s) / len(encode_s))
    if not compiled and codec.programs_built() == programs:
      est.learn_apply(seconds, sum(p.size for shards in per_device.values()
                                   for _, _, p in shards))
      est.learn_delta(time.perf_counter() - began)
  return out


def _changes(reply: dict[str, Any], field: str, leaves: int, name: str,
             into: dict[int, tuple[int, int]], encode_s: list[float]) -> None:
  """Adds a reply's per-leaf [leaf, changed, compared] counts to `into`, and its
  publisher's encode seconds per element to `encode_s`."""
  rows = reply.get(field, [])
  if not isinstance(rows, list) or not all(
      isinstance(r, list) and len(r) == 3 and all(type(v) is int for v in r)
      and 0 <= r[0] < leaves and 0 <= r[1] <= r[2] for r in rows):
    raise ReshardRuntimeError(f"{API}: {name} must count the changes as [leaf, "
                              "changed, compared] rows; got a malformed list.")
  for t, c, n in rows:
    have = into.get(t, (0, 0))
    into[t] = (have[0] + c, have[1] + n)
  rate = reply.get("encode_s")
  if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate < 1:
    encode_s.append(float(rate))


def after_full(pull: Pull, choice: Choice, seconds: float, answer_s: float) -> None:
  """After a full network pull with delta="auto": the link's rate learned from it,
  and the change fractions of `choice.measure` asked of the publisher processes this
  pull read from (a failed ask is logged: the pull itself succeeded)."""
  est = choice.estimates
  if est is None:
    return
  pp = pull.plan
  est.learn_full(sum(math.prod(hi - lo for lo, hi in op.box) * pp.wire[op.tensor].itemsize
                     for groups in pp.requests.values() for ops in groups for op in ops),
                 seconds)
  if not choice.measure or not choice.measure_base:
    return
  leaves = sorted(choice.measure)
  changed: dict[int, tuple[int, int]] = {}
  encode_s: list[float] = []
  for link in pull.links.values():
    body = {"op": "delta", "version": pull.number, "base": choice.measure_base,
            "wire": [[t, pp.wire[t].name] for t in leaves], "measure": leaves,
            "calibrate": est.encode_s is None, "timeout_ms": pull.options.timeout_ms}
    try:
      reply = link.client.call(body, answer_s,
                               f"the change counts of version {pull.number}")
      _changes(reply, "measured", len(pp.wire), link.name, changed, encode_s)
    except ReshardError as e:
      logger.info("Subscriber.pull: delta='auto' could not measure the changes of "
                  "version %d (%s); it keeps its estimates", pull.number, e)
      return
  est.learn_changed(changed, full=True)
  if encode_s:
    est.learn_encode(sum(encode_s) / len(encode_s))


def _streams(pp: Any, pieces_, heads: Any, name: str) -> list[tuple[list, Any, list]]:
  """The streams a delta reply announces, checked against the request: per wire dtype
  (by name) of the asked pieces, (its pieces in request order, its modes, the sizes of
  its bitmaps (uint8), runs (int32) and values: the arrays offered, empty ones left
  out)."""
  names = sorted({pp.wire[t].name for t, *_ in pieces_})
  if not isinstance(heads, list) or len(heads) != len(names):
    raise ReshardRuntimeError(f"{API}: {name} answered the delta request with "
                              "a malformed header.")
  out = []
  for wire_name, head in zip(names, heads):
    if not (isinstance(head, list) and len(head) == 4 and head[0] == wire_name
            and type(head[1]) is int and type(head[2]) is int
            and isinstance(head[3], list) and all(type(m) is int for m in head[3])):
      raise ReshardRuntimeError(f"{API}: {name} answered the delta request "
                                "with a malformed stream header.")
    members = [p for p in pieces_ if pp.wire[p[0]].name == wire_name]
    n = sum(math.prod(hi - lo for lo, hi in box) for _, _, box, _ in members)
    _, nvalues, nruns, modes = head
    if not (0 <= nvalues <= n and 0 <= nruns <= n and len(modes) == -(-n // CHUNK)):
      raise ReshardRuntimeError(f"{API}: {name} must send at most one value per "
                                f"element and one mode per chunk of a stream of {n}; got "
                                f"{nvalues} values, {len(modes)} modes.")
    out.append((members, modes, [(np.dtype(np.uint8), codec.bitmap_bytes(modes, n)),
                                 (np.dtype(np.int32), 2 * nruns),
                                 (np.dtype(manifest_lib.dtype_of(wire_name)), nvalues)]))
  return out
