"""Delta sync: a version crosses as only the elements that changed since the
subscriber's last one.

Owns both sides of a delta request: the publisher's (`serve`: compare the asked boxes
of the new version with the base version's, encode per stream, offer the arrays) and
the subscriber's (`run`: ask, fetch, decode and apply to its last result: in place
where donated, with numpy on CPU), and the record of that last result (`Last`,
`base_of`). The encoding itself is codec.py. Plans nothing (a delta pull runs the flat
plan's pieces) and never decides by itself that bytes are equal: what it cannot prove
the subscriber holds crosses dense.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
import weakref
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError
from jax_m2n._src.jobs import codec, manifest as manifest_lib, messages, pieces
from jax_m2n._src.jobs.codec import CHUNK, MODES
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.pull import API, Pull, wait_arrived
from jax_m2n._src.layout import Box


# Counters for the bench and the tests: the publisher's ("publisher_*": elements
# compared, changed, bytes encoded against the dense bytes, seconds converting to the
# wire dtype and fetching to the host, seconds comparing and encoding, chunks per
# mode) and the subscriber's ("subscriber_*": bytes pulled against the dense bytes of
# the same pieces, the control reply's bytes, seconds decoding and applying, pulls by
# kind).
stats: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------
# The publisher's side
# ---------------------------------------------------------------------------------------

def serve(version: Any, base: Any, body: dict[str, Any], transport: Any) -> dict[str, Any]:
  """Answers a delta request: the asked pieces of `version`, per wire dtype one stream
  (the pieces concatenated in request order) encoded against the same boxes of `base`
  (a held version of the same manifest, or None: every chunk dense); the arrays (per
  stream bitmaps, runs and values, the empty ones left out) offered under one ticket
  (`transport.offer`); the reply's header lists per stream [dtype, values, runs, modes]. `version`
  and `base` are the publisher's held versions (`_Version`: shards, per wire dtype,
  by (leaf, device))."""
  m = version.manifest
  wire = manifest_lib.wire_field(body, "delta", len(m.leaves))
  boxes = manifest_lib.pieces_field(body.get("pieces"), "delta", m.leaves,
                                    version.shards, wire,
                                    manifest_lib.request_budget(version.nbytes))
  if base is not None and base.manifest.id != m.id:
    base = None  # another layout set: its shards are other boxes
  # The held shards in the wire dtype, on the host (converted once per version on the
  # first request for it, as for full pulls; on CPU np.asarray is the buffer itself).
  start = time.perf_counter()
  hosts: dict[tuple[int, int, int], tuple[Box, np.ndarray]] = {}
  for t, k, _ in boxes:
    for v in (version, base):
      if v is not None and (id(v), t, k) not in hosts and (t, k) in v.shards:
        held, array = v.shard(t, k, wire[t])
        hosts[(id(v), t, k)] = (held, np.asarray(array))
  stats["publisher_convert_s"] += time.perf_counter() - start
  start = time.perf_counter()

  def host(v: Any, t: int, k: int) -> tuple[Box, np.ndarray]:
    return hosts[(id(v), t, k)]

  # One stream per wire dtype: its pieces concatenated in request order (the pieces of
  # a model are many and often small: one encoding of the stream, whose chunks span
  # pieces, costs a few numpy passes instead of a few per piece).
  streams: dict[str, tuple[list[np.ndarray], list[np.ndarray | None]]] = {}
  for t, k, box in boxes:
    held, new = host(version, t, k)
    cut = tuple(slice(lo - h, hi - h) for (lo, hi), (h, _) in zip(box, held))
    new = np.ascontiguousarray(new[cut]).reshape(-1)
    mask = None
    if base is not None and (t, k) in base.shards and base.shards[(t, k)][0] == held:
      mask = codec.changed(new, np.ascontiguousarray(host(base, t, k)[1][cut]).reshape(-1))
    news, masks = streams.setdefault(wire[t].name, ([], []))
    news.append(new)
    masks.append(mask)
  heads, arrays = [], []
  for name in sorted(streams):
    news, masks = streams[name]
    new = np.concatenate(news)
    e = codec.encode_changes(new, np.concatenate(
        [np.ones(a.size, bool) if m is None else m for a, m in zip(news, masks)]))
    heads.append([name, int(e.values.size), int(e.runs.size // 2), e.modes.tolist()])
    arrays += [e.bitmaps, e.runs, e.values]
    stats["publisher_elements"] += new.size
    stats["publisher_changed"] += e.changed
    stats["publisher_encoded_bytes"] += e.nbytes
    stats["publisher_dense_bytes"] += new.nbytes
    for mode, n in zip(*np.unique(e.modes, return_counts=True)):
      stats[f"publisher_chunks_{MODES[mode]}"] += int(n)
  stats["publisher_encode_s"] += time.perf_counter() - start
  stats["publisher_requests"] += 1
  offered = [a for a in arrays if a.size]
  ticket = None
  if offered:
    device = next(iter(version.shard(*boxes[0][:2], wire[boxes[0][0]])[1].devices()))
    ticket = transport.offer([jax.device_put(a, device) for a in offered],
                             body["timeout_ms"] / 1000)
  return {"ticket": ticket, "streams": heads,
          "base": base.number if base is not None else 0}


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


def base_of(last: Last | None, manifest_id: str, dsts: Sequence[Any],
            outs: Sequence[Any], quantized: bool) -> tuple[list[jax.Array] | None, str]:
  """The previous result a delta pull applies to, or None and why not: no earlier
  pull, another layout set, dst layouts or dtypes, Quantize leaves (they cross full:
  their values are quantized on arrival, so no earlier raw values are held), or arrays
  that were dropped, deleted or donated elsewhere (never assumed to hold old bytes)."""
  arrays, why = _base(last, manifest_id, dsts, outs, quantized)
  if arrays is None:
    stats["subscriber_full_pulls"] += 1
  return arrays, why


def _base(last, manifest_id, dsts, outs, quantized):
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


def agree(waits: Any, base: int) -> None:
  """In a multi-process generator job, every process must pull against the same base
  (a delta on one, a full copy on another would leave them without a common plan)."""
  waits.post("delta", str(base))
  theirs = waits.gather("delta", waits.peers, "the delta base of every process")
  bad = {p: v for p, v in zip(waits.peers, theirs) if v != str(base)}
  if bad:
    raise ReshardValueError(
        f"{API}: every process must pull against the same previous version "
        f"(delta=True applies to each process's last result); got base {base} here and "
        f"{bad} elsewhere (a process whose previous arrays were deleted, or that skipped "
        "a pull). Hint: pull with delta=False once on every process. No data moved.")


def run(pull: Pull, base_version: int, base: list[jax.Array], donate: bool,
        answer_s: float) -> list[list[jax.Array]]:
  """This process's delta pull: asks each publisher process for its pieces of the flat
  plan (each box once, however many local replicas hold it) encoded against
  `base_version`, fetches them, and applies them to `base` (the previous result, in the
  same dst layouts and dtypes): in place where `donate`, else to copies. Returns per
  leaf its local destination shards (in the plan's `local_dst` order)."""
  pp, number, links = pull.plan, pull.number, pull.links
  devices = {d.id: d for d in jax.local_devices()}
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
  stats["subscriber_delta_pulls"] += 1
  stats["subscriber_dense_bytes"] += sum(
      math.prod(hi - lo for lo, hi in box) * pp.wire[t].itemsize
      for (t, box) in unique)
  landing = devices[asked[min(asked)][0][3][0]] if asked else None
  replies, pulled = {}, []
  for k, pieces_ in asked.items():
    wire = sorted({t for t, *_ in pieces_})
    body = {"op": "delta", "version": number, "base": base_version,
            "wire": [[t, pp.wire[t].name] for t in wire],
            "pieces": [[t, s - PUBLISHER_DEVICE_BASE, *[lo for lo, _ in box],
                        *[hi for _, hi in box]] for t, s, box, _ in pieces_],
            "timeout_ms": pull.options.timeout_ms}
    reply = links[k].client.call(body, answer_s, f"the delta of version {number}")
    stats["subscriber_reply_bytes"] += len(messages.encode(reply))
    streams = _streams(pp, pieces_, reply.get("streams"), links[k].name)
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
  stats["subscriber_pulled_bytes"] += sum(a.nbytes for _, arrays in replies.values()
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
  prevs = [jax_compat.single_device_arrays(base[t]) for t in range(len(pp.local_dst))]
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
  stats["subscriber_apply_s"] += time.perf_counter() - start
  return out


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
