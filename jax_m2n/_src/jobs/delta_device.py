"""The delta codec's change test and encoding as compiled programs on the device that
holds the shards (on CUDA on XLA's stream), producing codec.py's wire format bit for bit.

Owns two programs per stream (a wire dtype's pieces, concatenated in request order): the
summary (the bitwise change test, the changed elements packed 32 to a word, per chunk
its count, runs and mode: only this small summary goes to the host) and the gather (the
values, bitmaps and runs, sized to powers of two; the host keeps the prefix). Decides
nothing about what to send (delta.py) and touches no sockets or versions.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_m2n._src.jobs import codec
from jax_m2n._src.jobs.codec import BITMAP, CHUNK, DENSE, NOTHING, RUNS

# Positions are int32 on the device (64-bit ints need jax_enable_x64): a stream of more
# elements than this (its chunks padded) is encoded by codec.py on the host instead.
MAX_ELEMENTS = (1 << 31) - CHUNK
# The values are compacted one of two ways (both exact, the same bytes): searching each
# output slot's position (~28 dependent lookups per slot, and as many slot-sized
# temporaries) or scattering every element to its rank (one pass over the stream, a
# few int ops per element). The search is taken while at most this fraction of the
# stream is sent: below ~1/30 it is fewer operations, and at 1/64 its temporaries stay
# under ~2 bytes per element of the stream. (XLA's CPU code, 256 MiB float32: search
# 0.35 s at 0.1%, 1.0 s at 2%, 6 s at 30%; scatter 1.1-2.1 s at any fraction.)
SEARCH_BELOW = 1 / 64
# A piece's change test: against the base's same box, a precomputed mask (pieces cut and
# compared on another device first), or none (no base: every element sent).
COMPARE, MASK, ALL = 0, 1, 2


class Piece(NamedTuple):
  """One piece of a stream: the box `starts`..`limits` of `new` (a held shard in the
  wire dtype; for MASK its flat bits, moved from another device), and what it is
  compared with (`old`: the base's shard for COMPARE, a flat bool array for MASK, None
  for ALL)."""

  new: jax.Array
  old: jax.Array | None
  starts: tuple[int, ...]
  limits: tuple[int, ...]
  kind: int


class Stream(NamedTuple):
  """A stream encoded: codec's `Encoded` (host arrays, the wire format), per piece how
  many of its elements changed (what `delta="auto"` learns the density from), and
  whether a program was compiled for it (its time is then no measure of the encode)."""

  encoded: codec.Encoded
  changed: list[int]
  compiled: bool


def supported(dtype: Any, n: int) -> bool:
  """Whether a stream of `n` elements of `dtype` can be encoded on the device."""
  dtype = np.dtype(dtype)
  return 0 < n <= MAX_ELEMENTS and (dtype == np.bool_ or dtype.itemsize in (1, 2, 4) or (
      dtype.itemsize == 8 and (dtype.kind == "c" or jax.config.jax_enable_x64)) or (
      dtype.itemsize == 16 and dtype.kind == "c" and jax.config.jax_enable_x64))


def encode(pieces: Sequence[Piece], device: Any, chunk: int = CHUNK) -> Stream:
  """The stream of `pieces` encoded as `codec.encode_changes` encodes it, computed on
  `device` (pieces held on other devices are cut and compared there first, then moved:
  their elements and a byte per element).

  Example:
    >>> new = jnp.array([1, 2, 3], jnp.float32)
    >>> s = encode([Piece(new, new.at[1].set(5), (0,), (3,), COMPARE)],
    ...            new.devices().pop())
    >>> s.encoded.modes.tolist(), s.encoded.bitmaps.tolist(), s.encoded.values.tolist()
    ([1], [2], [2.0])
  """
  compiles = _compiles()
  padded, (modes, counts, nvalues, nruns, changed) = run(pieces, device, chunk)
  values, bitmaps, runs = jax.device_get(padded)
  values = values.view(np.dtype(pieces[0].new.dtype)).reshape(-1)  # from its bits
  n = sum(_elements(p) for p in pieces)
  bitmaps = bitmaps[:codec.bitmap_bytes(modes.tolist(), n, chunk)]
  return Stream(codec.Encoded(modes, bitmaps, runs[:2 * nruns], values[:nvalues],
                              int(counts.sum())), [int(c) for c in changed],
                _compiles() != compiles)


def run(pieces: Sequence[Piece], device: Any, chunk: int = CHUNK
        ) -> tuple[tuple[jax.Array, ...], tuple[Any, ...]]:
  """`encode`'s work on the device: the summary program, its summary to the host, the
  gather program launched. Returns ((the values' bits, bitmaps' bytes, runs) on
  `device`, padded to powers of two), (per chunk its mode and changed count, the values and runs kept,
  per piece its changed count) (host)."""
  dtype = np.dtype(pieces[0].new.dtype).name  # a moved piece holds its bits
  pieces = [_moved(p, device) for p in pieces]
  sig = tuple((p.new.shape, np.dtype(p.new.dtype).name, p.starts, p.limits, p.kind)
              for p in pieces)
  news = [p.new for p in pieces]
  olds = [p.old for p in pieces]
  words, modes, counts, runs, changed = _summary(sig, dtype, chunk)(news, olds)
  modes_h, counts_h, runs_h, changed_h = jax.device_get((modes, counts, runs, changed))
  n = sum(_elements(p) for p in pieces)
  nchunks = modes_h.size
  sizes = np.full(nchunks, chunk, np.int64)
  sizes[-1] = n - (nchunks - 1) * chunk
  sparse = (modes_h == BITMAP) | (modes_h == RUNS)
  nvalues = int(counts_h[sparse].sum() + sizes[modes_h == DENSE].sum())
  nbitmaps = int((modes_h == BITMAP).sum())
  nruns = int(runs_h[modes_h == RUNS].sum())
  search = nvalues <= SEARCH_BELOW * n
  padded = _gather(sig, dtype, chunk, _size(nvalues), _size(nbitmaps), _size(nruns),
                   search)(news, words, modes, counts)
  return padded, (modes_h, counts_h, nvalues, nruns, changed_h)


def _compiles() -> int:
  """Programs built so far (each is compiled on its first call; another thread's count
  too: a compiling call is one whose time tells nothing)."""
  return sum(f.cache_info().misses for f in (_cut, _summary, _gather))


def _elements(p: Piece) -> int:
  return int(np.prod([hi - lo for lo, hi in zip(p.starts, p.limits)], dtype=np.int64))


def _size(n: int) -> int:
  """The slots of an output of `n` elements: 0 for none, else the power of two >= n (at
  least 256). Each size is one compilation of the gather program, cached: a training
  run's change counts drift around a level and compile a few sizes once each; the host
  copies at most twice the bytes it keeps."""
  return 0 if n == 0 else max(256, 1 << (n - 1).bit_length())


# ---------------------------------------------------------------------------------------
# Pieces held on another device than the stream's
# ---------------------------------------------------------------------------------------

def _moved(p: Piece, device: Any) -> Piece:
  """`p` as a piece on `device`: itself where it is there; else cut (and compared)
  on its own device, its flat elements and change mask moved."""
  if p.new.devices() == {device}:
    return p
  new, mask = _cut(p.new.shape, np.dtype(p.new.dtype).name, p.starts, p.limits,
                   p.kind)(p.new, p.old)
  return Piece(jax.device_put(new, device),
               None if mask is None else jax.device_put(mask, device), (0,),
               (_elements(p),), ALL if mask is None else MASK)


@functools.lru_cache(maxsize=256)
def _cut(shape, dtype, starts, limits, kind) -> Any:
  del shape, dtype  # part of the cache key: one compilation per signature

  def cut(new, old):
    flat = _cut_bits(new, starts, limits)
    if kind == COMPARE:
      return flat, _differ(flat, _cut_bits(old, starts, limits))
    return flat, (old if kind == MASK else None)
  return jax.jit(cut)


# ---------------------------------------------------------------------------------------
# The programs
# ---------------------------------------------------------------------------------------

def _bits(x: jax.Array) -> jax.Array:
  """x's bits as unsigned ints of its width (complex: its two parts side by side;
  bool as it is): NaN payloads and -0.0 are bits like any other."""
  if x.dtype == jnp.bool_:
    return x
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.stack([_bits(lax.real(x)), _bits(lax.imag(x))], axis=-1)
  kind = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
  return lax.bitcast_convert_type(x, kind)


def _cut_bits(x: jax.Array, starts, limits) -> jax.Array:
  """The bits (`_bits`) of x's box `starts`..`limits`, flattened: one row per element.
  Every program moves bits, never float values (XLA's CPU computes in bfloat16 through
  float32, quieting NaN payloads, even for a copy or a scatter)."""
  bits = _bits(x)
  extra = bits.shape[len(starts):]  # a complex element's two parts
  box = lax.slice(bits, tuple(starts) + (0,) * len(extra), tuple(limits) + extra)
  return box.reshape((-1,) + extra)


def _differ(new: jax.Array, old: jax.Array) -> jax.Array:
  """The change test (codec.changed) on two `_cut_bits`: True where the bits differ."""
  diff = new != old
  return diff if diff.ndim == 1 else diff.any(axis=-1)


def _popcount(x: jax.Array) -> jax.Array:
  return lax.population_count(x).astype(jnp.int32)


def _stream(sig, news) -> jax.Array:
  """The stream's elements' bits: each piece cut and flattened, concatenated in
  order."""
  flats = [_cut_bits(a, starts, limits) for a, (_, _, starts, limits, _) in zip(news, sig)]
  return flats[0] if len(flats) == 1 else jnp.concatenate(flats)


def _run_bits(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per word of `rows` (chunks x words, bit b of a word = element 32w + b), the
  elements that start a run and those that end one, within their chunk."""
  prev = jnp.pad(rows[:, :-1], ((0, 0), (1, 0)))
  nxt = jnp.pad(rows[:, 1:], ((0, 0), (0, 1)))
  starts = rows & ~((rows << 1) | (prev >> 31))
  ends = rows & ~((rows >> 1) | (nxt << 31))
  return starts, ends


@functools.lru_cache(maxsize=64)
def _summary(sig: tuple[Any, ...], dtype: str, chunk: int) -> Any:
  """The summary program of a stream of `dtype`: (the changed elements as words of 32
  bits, per chunk its mode (int8), changed count and run count, per piece its changed
  count)."""
  itemsize = np.dtype(jnp.dtype(dtype)).itemsize
  sizes = [int(np.prod([hi - lo for lo, hi in zip(s, l)], dtype=np.int64))
           for _, _, s, l, _ in sig]
  n = sum(sizes)
  nchunks = -(-n // chunk)
  allow_runs = n <= codec.MAX_RUN_PIECE

  def summary(news, olds):
    masks = []
    for (_, _, starts, limits, kind), new, old, size in zip(sig, news, olds, sizes):
      if kind == COMPARE:
        masks.append(_differ(_cut_bits(new, starts, limits),
                             _cut_bits(old, starts, limits)))
      elif kind == MASK:
        masks.append(old)
      else:
        masks.append(jnp.ones(size, jnp.bool_))
    changed = jnp.stack([m.sum(dtype=jnp.int32) for m in masks])
    mask = jnp.pad(jnp.concatenate(masks) if len(masks) > 1 else masks[0],
                   (0, nchunks * chunk - n))
    words = (mask.reshape(-1, 32).astype(jnp.uint32)
             << jnp.arange(32, dtype=jnp.uint32)).sum(axis=1, dtype=jnp.uint32)
    rows = words.reshape(nchunks, chunk // 32)
    starts, _ = _run_bits(rows)
    count = _popcount(rows).sum(axis=1)
    nruns = _popcount(starts).sum(axis=1)
    size = jnp.full(nchunks, chunk, jnp.int32).at[-1].set(n - (nchunks - 1) * chunk)
    big = jnp.iinfo(jnp.int32).max
    cost = jnp.stack([(size + 7) // 8 + count * itemsize,                  # BITMAP
                      (8 * nruns + count * itemsize) if allow_runs
                      else jnp.full(nchunks, big, jnp.int32),               # RUNS
                      size * itemsize])                                     # DENSE
    modes = (jnp.argmin(cost, axis=0) + 1).astype(jnp.int8)
    modes = jnp.where(count == 0, jnp.int8(NOTHING), modes)
    return words, modes, count, nruns, changed
  return jax.jit(summary)


def _search(table: jax.Array, queries: jax.Array, lo: jax.Array, steps: int
            ) -> jax.Array:
  """Per query q, the first index i >= lo with table[i] > q, searching `steps` halvings
  of a window of 2**steps from lo (table ascending there; the answer inside it)."""
  for s in reversed(range(steps)):
    mid = lo + (1 << s) - 1
    go = table[jnp.clip(mid, 0, table.size - 1)] <= queries
    lo = jnp.where(go & (mid < table.size), mid + 1, lo)
  return lo


def _select_bit(word: jax.Array, k: jax.Array) -> jax.Array:
  """The position of the k-th (from 0) set bit of each uint32 `word`."""
  pos = jnp.zeros(k.shape, jnp.int32)
  for width in (16, 8, 4, 2, 1):
    low = _popcount((word >> pos.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1))
    go = k >= low
    k = jnp.where(go, k - low, k)
    pos = jnp.where(go, pos + width, pos)
  return pos


@functools.lru_cache(maxsize=256)
def _gather(sig: tuple[Any, ...], dtype: str, chunk: int, sv: int, sb: int, sr: int,
            search: bool) -> Any:
  """The gather program: (the values' bits (sv slots: `_bits`, never the float values:
  XLA's CPU moves bfloat16 through float32 and quiets NaN payloads), the bitmaps' bytes
  (sb chunks), the runs (sr int32 pairs)), each in element order, the slots past the
  real counts unspecified."""
  wpc = chunk // 32  # words per chunk
  empty = jax.eval_shape(_bits, jax.ShapeDtypeStruct((0,), jnp.dtype(dtype)))

  def gather(news, words, modes, counts):
    nchunks = modes.size
    n = sum(int(np.prod([hi - lo for lo, hi in zip(s, l)])) for _, _, s, l, _ in sig)
    rows = words.reshape(nchunks, wpc)
    values = jnp.zeros(empty.shape, empty.dtype)
    if sv:
      new = _stream(sig, news)
      # The sent elements: every element of a DENSE chunk, the changed ones elsewhere.
      first = jnp.arange(nchunks * wpc, dtype=jnp.int32).reshape(nchunks, wpc) * 32
      valid = jnp.where(first + 32 <= n, jnp.uint32(0xFFFFFFFF), (
          jnp.uint32(1) << jnp.clip(n - first, 0, 31).astype(jnp.uint32)) - 1)
      valid = jnp.where(first >= n, jnp.uint32(0), valid)
      take = jnp.where((modes == DENSE)[:, None], valid, rows).reshape(-1)
      values = (_values_by_search if search else _values_by_scatter)(
          new, take, modes, counts, chunk, sv)
    bitmaps = jnp.zeros(0, jnp.uint8)
    if sb:
      which = jnp.nonzero(modes == BITMAP, size=sb, fill_value=0)[0]
      picked = rows[which]
      bitmaps = jnp.stack([(picked >> s) & 0xFF for s in (0, 8, 16, 24)],
                          axis=-1).astype(jnp.uint8).reshape(-1)
    runs = jnp.zeros(0, jnp.int32)
    if sr:
      in_runs = (modes == RUNS)[:, None]
      starts, ends = _run_bits(rows)
      r = jnp.arange(sr, dtype=jnp.int32)
      first_, last = (_nth_bits(jnp.where(in_runs, b, 0).reshape(-1), r)
                      for b in (starts, ends))
      runs = jnp.stack([first_, last - first_ + 1], axis=1).reshape(-1)
    return values, bitmaps, runs
  return jax.jit(gather)


def _nth_bits(words: jax.Array, r: jax.Array) -> jax.Array:
  """The element position of each r-th (from 0) set bit of `words`."""
  pc = _popcount(words)
  incl = jnp.cumsum(pc)
  w = _search(incl, r, jnp.zeros(r.shape, jnp.int32), max(1, words.size.bit_length()))
  w = jnp.clip(w, 0, words.size - 1)
  return w * 32 + _select_bit(words[w], r - (incl[w] - pc[w]))


def _values_by_search(new, take, modes, counts, chunk, sv):
  """Each output slot's element found by search: its chunk among the chunks' sent
  counts, then (unless the chunk is DENSE: slot order is element order) its word
  among the chunk's words and its bit in the word."""
  wpc = chunk // 32
  nchunks = modes.size
  n = new.shape[0]
  sizes = jnp.full(nchunks, chunk, jnp.int32).at[-1].set(n - (nchunks - 1) * chunk)
  sent = jnp.where(modes == DENSE, sizes, jnp.where(modes == NOTHING, 0, counts))
  chunk_end = jnp.cumsum(sent)
  j = jnp.arange(sv, dtype=jnp.int32)
  c = jnp.clip(_search(chunk_end, j, jnp.zeros(sv, jnp.int32),
                       max(1, nchunks.bit_length())), 0, nchunks - 1)
  k = j - (chunk_end[c] - sent[c])  # the slot's rank in its chunk
  pc = _popcount(take).reshape(nchunks, wpc)
  word_end = jnp.cumsum(pc, axis=1).reshape(-1)  # within each chunk
  w = jnp.clip(_search(word_end, k, c * wpc, max(1, wpc.bit_length()) - 1),
               0, take.size - 1)
  bit = _select_bit(take[w], k - (word_end[w] - pc.reshape(-1)[w]))
  at = jnp.where(modes[c] == DENSE, c * chunk + k, w * 32 + bit)
  return new[jnp.clip(at, 0, n - 1)]


def _values_by_scatter(new, take, modes, counts, chunk, sv):
  """Each sent element scattered to its rank (the sent elements before it)."""
  del modes, counts, chunk
  pc = _popcount(take)
  before = jnp.cumsum(pc) - pc
  b = jnp.arange(32, dtype=jnp.uint32)
  tw = take[:, None]
  rank = before[:, None] + _popcount(tw & ((jnp.uint32(1) << b) - 1))
  at = jnp.where(((tw >> b) & 1).astype(jnp.bool_), rank, sv).reshape(-1)[:new.shape[0]]
  return jnp.zeros((sv,) + new.shape[1:], new.dtype).at[at].set(
      new, mode="drop", unique_indices=True)


def count_changed(new: jax.Array, old: jax.Array) -> jax.Array:
  """How many elements of two arrays of one shape and dtype differ in their bits (an
  int32 on their device; fewer than 2**31 elements)."""
  return _counter(new.shape, np.dtype(new.dtype).name)(new, old)


@functools.lru_cache(maxsize=256)
def _counter(shape, dtype) -> Any:
  del dtype  # part of the cache key: one compilation per signature
  whole = (0,) * len(shape), tuple(shape)
  return jax.jit(lambda a, b: _differ(_cut_bits(a, *whole), _cut_bits(b, *whole)).sum(
      dtype=jnp.int32))
