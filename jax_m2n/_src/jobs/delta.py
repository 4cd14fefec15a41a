"""Delta sync: a version crosses as only the elements that changed since the
subscriber's last one.

Owns the change test (bitwise, in the wire dtype), the per-chunk encoding (nothing,
bitmap + values, index runs + values or the dense chunk, whichever is smallest) and its
decoding, the publisher's side of a delta request (compare, encode, offer) and the
subscriber's (ask, pull, apply to its last result: in place where donated, with
numpy on CPU), and the record of that last result. Knows no sockets but the engine's,
plans nothing (a delta pull runs the flat plan's pieces), and never decides by itself
that bytes are equal: what it cannot prove the subscriber holds crosses dense.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import secrets
import time
import weakref
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)
from jax_m2n._src.jobs import engine, manifest as manifest_lib, messages, pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.messages import ProtocolError
from jax_m2n._src.layout import Box

# Elements per chunk: the unit that crosses as nothing, sparse or dense. A bitmap costs
# CHUNK / 8 bytes (a smaller last chunk's: its size / 8), so a chunk goes sparse while
# fewer than about 15/16 of its elements changed; 16 Ki elements keeps the per-chunk
# mode list (one int in the reply) at 1/16 Ki of the elements and a bitmap at 2 KiB.
CHUNK = 1 << 14
NOTHING, BITMAP, RUNS, DENSE = 0, 1, 2, 3
MODES = ("nothing", "bitmap", "runs", "dense")
# A run is two int32s (its start in the piece, its length): pieces of at most 2**31
# elements take runs; larger ones cross as bitmaps or dense.
MAX_RUN_PIECE = (1 << 31) - 1
# A delta request may ask for at most this many times the bytes a version holds on the
# publisher's process, plus 1 MiB (as a pieces request).
MAX_REQUEST_FACTOR = 64

# Counters for the bench and the tests: the publisher's ("publisher_*": elements
# compared, changed, bytes encoded against the dense bytes, seconds converting to the
# wire dtype and fetching to the host, seconds comparing and encoding, chunks per
# mode) and the subscriber's ("subscriber_*": bytes pulled against the dense bytes of
# the same pieces, the control reply's bytes, seconds decoding and applying, pulls by
# kind).
stats: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------
# The change test and the encoding (numpy, host memory)
# ---------------------------------------------------------------------------------------

def _bits(x: np.ndarray) -> np.ndarray:
  """`x` (1-D) as unsigned ints of its width, or as rows of bytes for wider types:
  what the change test compares (NaN payloads and -0.0 are bits like any other)."""
  kind = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(x.dtype.itemsize)
  if kind is not None:
    return x.view(kind)
  return x.view(np.uint8).reshape(x.size, x.dtype.itemsize)


def changed(new: np.ndarray, old: np.ndarray) -> np.ndarray:
  """The change test: a bool per element of two flat arrays of one dtype, True where
  their bits differ (so NaN == NaN of the same payload, and 0.0 != -0.0)."""
  a, b = _bits(new), _bits(old)
  diff = a != b
  return diff if diff.ndim == 1 else diff.any(axis=1)


@dataclasses.dataclass
class Encoded:
  """One piece's delta: per chunk a mode (NOTHING, BITMAP, RUNS, DENSE), the bitmaps of
  BITMAP chunks (CHUNK / 8 bytes each, a partial last chunk's its size / 8 rounded
  up; little bit order), the runs of RUNS chunks (int32
  pairs: start in the piece, length) and the values, in element order: every element
  of a DENSE chunk and the changed ones of the sparse chunks, in the wire dtype."""

  modes: np.ndarray
  bitmaps: np.ndarray
  runs: np.ndarray
  values: np.ndarray
  changed: int

  @property
  def nbytes(self) -> int:
    return self.bitmaps.nbytes + self.runs.nbytes + self.values.nbytes


def encode(new: np.ndarray, old: np.ndarray | None, chunk: int = CHUNK) -> Encoded:
  """The smallest per-chunk encoding of `new` (flat, the wire dtype) against `old` (its
  base, the same dtype and size), or every chunk dense when there is no base.

  Example:
    >>> e = encode(np.array([1, 2, 3], np.float32), np.array([1, 5, 3], np.float32), 8)
    >>> e.modes.tolist(), e.values.tolist(), e.changed
    ([2], [2.0], 1)
  """
  if old is None:
    return encode_changes(new, None, chunk)
  if old.shape != new.shape or old.dtype != new.dtype:
    raise ValueError(f"delta.encode: old must be new's shape and dtype; got {old.shape} "
                     f"{old.dtype} against {new.shape} {new.dtype}.")
  return encode_changes(new, changed(new, old), chunk)


def encode_changes(new: np.ndarray, mask: np.ndarray | None, chunk: int = CHUNK
                   ) -> Encoded:
  """`encode` from the change test's result (`mask`, a bool per element; None: every
  element changed)."""
  n = new.size
  nchunks = -(-n // chunk)
  itemsize = new.dtype.itemsize
  if mask is None:
    return Encoded(np.full(nchunks, DENSE, np.int8), np.zeros(0, np.uint8),
                   np.zeros(0, np.int32), new, n)
  grid = np.zeros(nchunks * chunk, bool)
  grid[:n] = mask
  rows = grid.reshape(nchunks, chunk)
  count = rows.sum(axis=1)
  starts = rows.copy()
  starts[:, 1:] &= ~rows[:, :-1]
  nruns = starts.sum(axis=1)
  sizes = np.full(nchunks, chunk, np.int64)
  sizes[-1] = n - (nchunks - 1) * chunk
  cost = np.stack([-(-sizes // 8) + count * itemsize,             # BITMAP
                   np.where(n <= MAX_RUN_PIECE, 8 * nruns + count * itemsize,
                            np.iinfo(np.int64).max),            # RUNS
                   sizes * itemsize])                             # DENSE
  modes = (np.argmin(cost, axis=0) + 1).astype(np.int8)
  modes[count == 0] = NOTHING
  dense = np.repeat(modes == DENSE, chunk)[:n]
  values = new[grid[:n] | dense]
  bitmaps = np.packbits(rows[modes == BITMAP], axis=1, bitorder="little").reshape(-1)
  if modes[-1] == BITMAP:  # a partial last chunk's bitmap ends with the piece
    bitmaps = bitmaps[:bitmaps.size - chunk // 8 + -(-int(sizes[-1]) // 8)]
  in_runs = np.repeat(modes == RUNS, chunk)
  ends = rows.copy()
  ends[:, :-1] &= ~rows[:, 1:]
  first = np.flatnonzero(starts.reshape(-1) & in_runs)
  last = np.flatnonzero(ends.reshape(-1) & in_runs)
  runs = np.stack([first, last - first + 1], axis=1).astype(np.int32).reshape(-1)
  return Encoded(modes, bitmaps, runs, values, int(count.sum()))


def bitmap_bytes(modes: Sequence[int], n: int, chunk: int = CHUNK) -> int:
  """The bytes of a piece's bitmaps: CHUNK / 8 per BITMAP chunk, the last chunk's
  rounded up from its own size."""
  nbitmaps = sum(1 for m in modes if m == BITMAP)
  if not nbitmaps:
    return 0
  last = n - (len(modes) - 1) * chunk
  return nbitmaps * (chunk // 8) - (chunk // 8 - -(-last // 8) if modes[-1] == BITMAP
                                    else 0)


def decode(modes: np.ndarray, bitmaps: np.ndarray, runs: np.ndarray, n: int,
           chunk: int = CHUNK) -> np.ndarray:
  """The positions (ascending, in the flat piece of `n` elements) that `values` of an
  `Encoded` fill, in their order.

  Raises:
    ReshardRuntimeError: a malformed delta (wrong sizes, positions outside the piece
      or their chunk's mode).
  """
  nchunks = -(-n // chunk)
  modes = np.asarray(modes, np.int8)
  if modes.shape != (nchunks,) or ((modes < NOTHING) | (modes > DENSE)).any():
    raise ReshardRuntimeError(f"Subscriber.pull: a delta must have one mode per chunk; "
                              f"got {modes.size} for {nchunks}.")
  rows = np.zeros((nchunks, chunk), bool)
  rows[modes == DENSE] = True
  nbitmaps = int((modes == BITMAP).sum())
  if bitmaps.size != bitmap_bytes(modes.tolist(), n, chunk) or runs.size % 2:
    raise ReshardRuntimeError("Subscriber.pull: a delta's bitmaps and runs must match "
                              "its modes; got other sizes.")
  if nbitmaps:
    padded = np.zeros(nbitmaps * (chunk // 8), np.uint8)
    padded[:bitmaps.size] = bitmaps
    rows[modes == BITMAP] = np.unpackbits(padded.reshape(nbitmaps, chunk // 8), axis=1,
                                          bitorder="little").astype(bool)
  if runs.size:
    first, length = runs[0::2].astype(np.int64), runs[1::2].astype(np.int64)
    if (length < 1).any() or (first < 0).any() or (first + length > n).any() or (
        (first // chunk) != (first + length - 1) // chunk).any() or (
        modes[first // chunk] != RUNS).any():
      raise ReshardRuntimeError("Subscriber.pull: a delta's runs must lie inside their "
                                "RUNS chunks; got others.")
    total = int(length.sum())
    at = np.repeat(first - np.cumsum(length) + length, length) + np.arange(total)
    rows.reshape(-1)[at] = True
  flat = rows.reshape(-1)
  if nchunks and modes[-1] == DENSE:
    flat[n:] = False  # a dense last chunk ends with the piece
  if flat[n:].any():
    raise ReshardRuntimeError("Subscriber.pull: a delta must mark no position past its "
                              "piece; got some.")
  return np.flatnonzero(flat[:n])


# ---------------------------------------------------------------------------------------
# The publisher's side
# ---------------------------------------------------------------------------------------

def serve(version: Any, base: Any, body: dict[str, Any], transfer: Any) -> dict[str, Any]:
  """Answers a delta request: the asked pieces of `version`, per wire dtype one stream
  (the pieces concatenated in request order) encoded against the same boxes of `base`
  (a held version of the same manifest, or None: every chunk dense); the arrays (per
  stream bitmaps, runs and values, the empty ones left out) offered under one random
  uuid; the reply's header lists per stream [dtype, values, runs, modes]. `version`
  and `base` are the publisher's held versions (`_Version`: shards, per wire dtype,
  by (leaf, device))."""
  m = version.manifest
  wire = manifest_lib.wire_field(body, "delta", len(m.leaves))
  asked = body.get("pieces")
  if not isinstance(asked, list) or not asked or len(asked) > 1 << 20:
    raise ProtocolError("delta: pieces must be a non-empty list of pieces.")
  budget = MAX_REQUEST_FACTOR * version.nbytes + (1 << 20)
  boxes = []
  for piece in asked:
    t, k, box, nbytes = manifest_lib.piece_field(piece, "delta", m.leaves,
                                                 version.shards, wire)
    budget -= nbytes
    if budget < 0:
      raise ProtocolError(f"delta: a request must ask for at most {MAX_REQUEST_FACTOR} x "
                          "the version's bytes here.")
    boxes.append((t, k, box))
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
      mask = changed(new, np.ascontiguousarray(host(base, t, k)[1][cut]).reshape(-1))
    news, masks = streams.setdefault(wire[t].name, ([], []))
    news.append(new)
    masks.append(mask)
  heads, arrays = [], []
  for name in sorted(streams):
    news, masks = streams[name]
    new = np.concatenate(news)
    e = encode_changes(new, np.concatenate(
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
  uuid = None
  if offered:
    device = next(iter(version.shard(*boxes[0][:2], wire[boxes[0][0]])[1].devices()))
    uuid = secrets.randbits(64)
    transfer.await_pull(uuid, [jax.device_put(a, device) for a in offered],
                        timeout=engine.offer_deadline(body["timeout_ms"] / 1000))
  return {"uuid": uuid, "streams": heads, "base": base.number if base is not None else 0}


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
        f"Subscriber.pull: every process must pull against the same previous version "
        f"(delta=True applies to each process's last result); got base {base} here and "
        f"{bad} elsewhere (a process whose previous arrays were deleted, or that skipped "
        "a pull). Hint: pull with delta=False once on every process. No data moved.")


# On CPU the shards are host memory: numpy updates copies of them (nothing to compile;
# XLA compiles per program and per device: a program updating a 26-leaf model's shards
# on 4 devices took 13 s to compile on this 2-core machine, as pieces.Batch found for
# composing). Elsewhere compiled programs of at most pieces.PROGRAM_BOXES shards update
# the donated shards in place. (Tests flip this to run the compiled path on CPU.)
HOST_APPLY = True


@functools.lru_cache(maxsize=256)
def _program(sig: tuple[tuple[int, str], ...], names: tuple[str, ...], donate: bool
             ) -> Any:
  """The program that updates a few shards of one device: per shard (scatter size,
  wire dtype), its positions from one int32 array and its values from its wire dtype's
  array (both concatenated in shard order), converted to the shard's dtype as a full
  pull converts (XLA's convert, elementwise)."""
  def apply(prevs, at, values):
    outs, i, v = [], 0, dict.fromkeys(names, 0)
    for p, (size, name) in zip(prevs, sig):
      vals = values[names.index(name)][v[name]:v[name] + size]
      flat = p.reshape(-1).at[at[i:i + size]].set(vals.astype(p.dtype), mode="drop",
                                                  unique_indices=True)
      outs.append(flat.reshape(p.shape))
      i += size
      v[name] += size
    return outs
  return jax.jit(apply, donate_argnums=(0,) if donate else ())


def _apply_compiled(pp: Any, device: Any, group, parts, donate: bool) -> list[jax.Array]:
  """Updates `group`'s shards (leaf, index, shard) on `device` with one compiled
  program, in place where `donate`."""
  sig, at, values = [], [], {}
  for (t, _, p), updates in zip(group, parts):
    n = sum(a.size for a, _ in updates)
    size = _bucket((p.shape, p.dtype, pp.wire[t], device.id), n)
    idx = np.full(size, p.size, np.int32)  # past the end: dropped
    vals = np.zeros(size, pp.wire[t])
    if updates:
      idx[:n] = np.concatenate([a for a, _ in updates])
      vals[:n] = np.concatenate([v for _, v in updates])
    sig.append((size, pp.wire[t].name))
    at.append(idx)
    values.setdefault(pp.wire[t].name, []).append(vals)
  names = tuple(sorted(values))
  return _program(tuple(sig), names, donate)(
      [p for _, _, p in group], jax.device_put(np.concatenate(at), device),
      [jax.device_put(np.concatenate(values[k]), device) for k in names])


def _apply_host(pp: Any, device: Any, group, parts, donate: bool) -> list[jax.Array]:
  """Updates `group`'s shards on a CPU `device` with numpy: each shard copied, its
  changed elements set, put back (the donated shards are deleted by the pull). The
  values are converted to the shard's dtype by XLA, as a full pull converts them."""
  del donate  # the copies replace the donated shards, which the pull then deletes
  out = []
  for (t, _, p), updates in zip(group, parts):
    if not updates:
      out.append(jax.device_put(p, device, may_alias=False))
      continue
    at = np.concatenate([a for a, _ in updates])
    vals = np.concatenate([v for _, v in updates])
    if vals.dtype != p.dtype:
      convert = pieces._converter(np.dtype(p.dtype))
      vals = np.asarray(convert(jax.device_put(vals, device)))
    host = np.array(p)
    host.reshape(-1)[at] = vals
    out.append(jax.device_put(host, device))
  return out


# Per destination shard (shape, dtype, device): the scatter size it last used.
_buckets: dict[tuple[Any, ...], int] = {}


def _bucket(key: tuple[Any, ...], n: int) -> int:
  """The scatter size for `n` updates of one shard: a power of two (at least 256),
  kept while n stays between 1/8 of it and it. Each size is one compilation per shard
  shape and device, and a training run's change counts drift around a level: without
  the hysteresis a count wandering across a power of two recompiled (~50 ms a shard)."""
  last = _buckets.get(key)
  if last is not None and last // 8 <= n <= last:
    return last
  size = _buckets[key] = max(256, 1 << max(0, n - 1).bit_length())
  if len(_buckets) > 1 << 16:
    _buckets.clear()
  return size


def run(pp: Any, links: dict[int, Any], number: int, base_version: int,
        base: list[jax.Array], donate: bool, timeout_s: float,
        answer_s: float) -> list[list[jax.Array]]:
  """This process's delta pull: asks each publisher process for its pieces of the flat
  plan `pp` (each box once, however many local replicas hold it) encoded against
  `base_version`, pulls them, and applies them to `base` (the previous result, in the
  same dst layouts and dtypes): in place where `donate`, else to copies. Returns per
  leaf its local destination shards (in `pp.local_dst` order)."""
  devices = {d.id: d for d in jax.local_devices()}
  deadline = time.monotonic() + timeout_s
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
            "timeout_ms": int(timeout_s * 1000)}
    reply = links[k].client.call(body, answer_s, f"the delta of version {number}")
    stats["subscriber_reply_bytes"] += len(messages.encode(reply))
    streams = _streams(pp, pieces_, reply.get("streams"), links[k].name)
    specs = [(d, n) for _, _, sizes in streams for d, n in sizes]
    uuid = reply.get("uuid")
    arrays = []
    if any(n for _, n in specs):
      if type(uuid) is not int:
        raise ReshardRuntimeError(f"Subscriber.pull: {links[k].name} must offer the "
                                  "delta's arrays; got no uuid.")
      sharding = jax.sharding.SingleDeviceSharding(landing)
      arrays = links[k].connection.pull(uuid, [
          jax.ShapeDtypeStruct((n,), d, sharding=sharding) for d, n in specs if n])
      pulled.extend((links[k].name, a) for a in arrays)
    replies[k] = (streams, arrays)
  _wait(pulled, deadline, timeout_s)
  stats["subscriber_pulled_bytes"] += sum(a.nbytes for _, a in pulled)
  start = time.perf_counter()
  updates: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
  for k, (streams, arrays) in replies.items():
    host = iter(np.asarray(a) for a in arrays)
    for members, modes, ((_, nbitmap), (_, nruns), (dtype, nvalues)) in streams:
      bitmaps, runs, values = (next(host) if n else np.zeros(0, d) for d, n in (
          (np.uint8, nbitmap), (np.int32, nruns), (dtype, nvalues)))
      sizes = [math.prod(hi - lo for lo, hi in box) for _, _, box, _ in members]
      offsets = np.cumsum([0] + sizes)
      positions = decode(np.asarray(modes), bitmaps, runs, int(offsets[-1]))
      if positions.size != nvalues:
        raise ReshardRuntimeError(f"Subscriber.pull: a delta from {links[k].name} must "
                                  f"carry one value per marked position; got {nvalues} "
                                  f"for {positions.size}.")
      cuts = np.searchsorted(positions, offsets)
      for (t, _, box, dsts), lo, a, b in zip(members, offsets, cuts, cuts[1:]):
        if a == b:
          continue
        shape = tuple(hi - lo_ for lo_, hi in box)
        for d in set(dsts):
          dbox = pp.plan.tensors[t].dst.box_of(d)
          at = _in_shard(positions[a:b] - lo, shape, box, dbox)
          updates.setdefault((t, d), []).append((at, values[a:b]))
  prevs = [jax_compat.single_device_arrays(base[t]) for t in range(len(pp.local_dst))]
  per_device: dict[int, list[tuple[int, int, jax.Array]]] = {}
  for t, local in enumerate(pp.local_dst):
    for j, (d, p) in enumerate(zip(local, prevs[t])):
      per_device.setdefault(d.id, []).append((t, j, p))
  out = [[None] * len(local) for local in pp.local_dst]
  for d, shards in per_device.items():
    on_host = HOST_APPLY and devices[d].platform == "cpu"
    for start_ in range(0, len(shards), len(shards) if on_host else pieces.PROGRAM_BOXES):
      group = shards[start_:start_ + (len(shards) if on_host else pieces.PROGRAM_BOXES)]
      parts = [updates.get((t, d), []) for t, _, _ in group]
      new = (_apply_host if on_host else _apply_compiled)(
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
    raise ReshardRuntimeError(f"Subscriber.pull: {name} answered the delta request with "
                              "a malformed header.")
  out = []
  for wire_name, head in zip(names, heads):
    if not (isinstance(head, list) and len(head) == 4 and head[0] == wire_name
            and type(head[1]) is int and type(head[2]) is int
            and isinstance(head[3], list) and all(type(m) is int for m in head[3])):
      raise ReshardRuntimeError(f"Subscriber.pull: {name} answered the delta request "
                                "with a malformed stream header.")
    members = [p for p in pieces_ if pp.wire[p[0]].name == wire_name]
    n = sum(math.prod(hi - lo for lo, hi in box) for _, _, box, _ in members)
    _, nvalues, nruns, modes = head
    if not (0 <= nvalues <= n and 0 <= nruns <= n and len(modes) == -(-n // CHUNK)):
      raise ReshardRuntimeError(f"Subscriber.pull: {name} must send at most one value per "
                                f"element and one mode per chunk of a stream of {n}; got "
                                f"{nvalues} values, {len(modes)} modes.")
    out.append((members, modes, [(np.dtype(np.uint8), bitmap_bytes(modes, n)),
                                 (np.dtype(np.int32), 2 * nruns),
                                 (np.dtype(manifest_lib.dtype_of(wire_name)), nvalues)]))
  return out


def _in_shard(positions: np.ndarray, shape: tuple[int, ...], box: Box, dbox: Box
              ) -> np.ndarray:
  """Flat positions in a piece of `shape` at `box` -> flat positions in the destination
  shard at `dbox` (which contains the box)."""
  if not shape:
    return positions
  dshape = tuple(hi - lo for lo, hi in dbox)
  if tuple(box[1:]) == tuple(dbox[1:]):  # whole rows of the shard: one offset
    return positions + (box[0][0] - dbox[0][0]) * math.prod(dshape[1:])
  index = np.unravel_index(positions, shape)
  return np.ravel_multi_index(
      tuple(i + (lo - dlo) for i, (lo, _), (dlo, _) in zip(index, box, dbox)), dshape)


def _wait(pulled: Sequence[tuple[str, jax.Array]], deadline: float, timeout_s: float
          ) -> None:
  """Waits (bounded) until every pulled array has arrived; a failed pull names its
  sender."""
  delay = 1e-4
  while not all(a.is_ready() for _, a in pulled):
    if time.monotonic() > deadline:
      raise ReshardTimeoutError(
          f"Subscriber.pull: a delta must arrive within timeout_s={timeout_s:g}; got "
          f"{sum(not a.is_ready() for _, a in pulled)} array(s) still missing.")
    time.sleep(delay)
    delay = min(2 * delay, 2e-3)
  for name, a in pulled:
    try:
      a.block_until_ready()
    except Exception as e:  # noqa: BLE001 - the engine's failure, named
      raise ReshardRuntimeError(f"Subscriber.pull: the delta from {name} failed (it "
                                f"died or closed mid-transfer): {type(e).__name__}: "
                                f"{e}") from e
