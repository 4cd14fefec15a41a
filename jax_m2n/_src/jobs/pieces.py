"""Pieces of a pull on one device, and the compiled programs that cut, pack and compose
them.

Owns the store of what arrived where (a piece: a box of a leaf, held as an array of its
own or as a run of a packed flat array) and `Batch`, which turns pieces into outputs
with one compiled program per device and step: boxes (composed from the parts covering
them, then converted) or packs (several boxes flattened and concatenated: one array for
the transfer server, whose cost is per array). Programs are cached by signature; a pull
recurs every version, so each compiles once. Knows no sockets, plans or versions.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box, box_size, intersect

# Where a piece's elements are: (array, offset of its run in a flat array or -1 for an
# array of the piece's own shape, the piece's shape).
Source = tuple[jax.Array, int, tuple[int, ...]]
# A part of an output box: (source, starts and limits inside the piece, offset in the
# box).
Part = tuple[Source, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def shape_of(box: Box) -> tuple[int, ...]:
  return tuple(hi - lo for lo, hi in box)


def _rel(box: Box, origin: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
  return (tuple(lo - o for (lo, _), (o, _) in zip(box, origin)),
          tuple(hi - o for (_, hi), (o, _) in zip(box, origin)))


class Store:
  """The pieces delivered into each (leaf, device, buffer kind)."""

  def __init__(self):
    self.pieces: dict[tuple[int, int, int], list[tuple[Box, Source]]] = {}

  def add(self, t: int, device: int, kind: int, box: Box, array: jax.Array,
          offset: int = -1) -> None:
    self.pieces.setdefault((t, device, kind), []).append(
        (box, (array, offset, shape_of(box))))

  def parts(self, t: int, device: int, kind: int, box: Box) -> list[Part]:
    """The parts of the pieces held in (t, device, kind) that cover `box`.

    Raises:
      ReshardRuntimeError: the pieces do not cover the box (an internal error).
    """
    out, covered = [], 0
    for pbox, source in self.pieces.get((t, device, kind), []):
      part = intersect(pbox, box) if box else ()
      if part is None:
        continue
      starts, limits = _rel(part, pbox)
      out.append((source, starts, limits, _rel(part, box)[0]))
      covered += box_size(part)
      if covered == box_size(box) and len(out) == 1:
        break  # the common case: one piece holds the whole box
    if covered < box_size(box):
      raise ReshardRuntimeError(
          f"Subscriber.pull: internal error: device {device} holds {covered} of the "
          f"{box_size(box)} elements of leaf {t}'s box {box} it must read.")
    return out


# A compiled program serves at most this many boxes: XLA's CPU compile time grows
# faster than linearly with a program's outputs (64 boxes: 3.4 s, 16: 0.6 s, measured),
# and programs of equal shapes share one compilation (offsets are arguments).
PROGRAM_BOXES = 4


def _read(inputs, offsets, at: int, part):
  """One part's block: its piece (a run of a flat input, reshaped, or the input
  itself), cut at dynamic starts. Returns (block, the next offset position)."""
  i, flat, pshape, sub = part
  x = inputs[i]
  if flat:
    n = int(np.prod(pshape))
    x = lax.dynamic_slice(x, (offsets[at],), (n,)).reshape(pshape)
    at += 1
  rank = len(pshape)
  starts = tuple(offsets[at + d] for d in range(rank))
  return lax.dynamic_slice(x, starts, sub) if rank else x, at + rank


@functools.lru_cache(maxsize=1024)
def _program(atoms: tuple) -> Any:
  """The compiled program of a chunk of atoms: per atom (flat?, dtype, segments), each
  segment (shape, dtype, parts), each part (input, flat input?, piece shape, block
  shape); every offset (runs, starts, placements) is read from the `offsets` argument,
  in order, so programs of equal shapes are one compilation."""
  def f(offsets, *inputs):
    outs, at = [], 0
    for flat, dtype, segments in atoms:
      blocks = []
      for shape, sdtype, parts in segments:
        if len(parts) == 1 and parts[0][3] == shape:
          block, at = _read(inputs, offsets, at, parts[0])
          at += len(shape)  # its placement (zeros): read past
          blocks.append(block.astype(dtype))
          continue
        out = jnp.zeros(shape, sdtype)
        for part in parts:
          block, at = _read(inputs, offsets, at, part)
          place = tuple(offsets[at + d] for d in range(len(shape)))
          at += len(shape)
          out = lax.dynamic_update_slice(out, block.astype(sdtype), place)
        blocks.append(out.astype(dtype))
      outs.append(jnp.concatenate([b.reshape(-1) for b in blocks]) if flat else blocks[0])
    return tuple(outs)
  return jax.jit(f)


@functools.lru_cache(maxsize=64)
def converter(dtype: np.dtype) -> Any:
  """The compiled `astype(dtype)` (XLA's convert: what every path converts with)."""
  return jax.jit(lambda a: a.astype(dtype))


@functools.lru_cache(maxsize=256)
def _concatenate(n: int) -> Any:
  return jax.jit(lambda *xs: jnp.concatenate(xs))


@functools.lru_cache(maxsize=256)
def flat_concatenate(n: int) -> Any:
  """The compiled concatenation of `n` arrays flattened (a pack of several boxes)."""
  return jax.jit(lambda *xs: jnp.concatenate([x.reshape(-1) for x in xs]))


class Batch:
  """Outputs on one device, computed by a few compiled programs (`run`)."""

  def __init__(self):
    self._outputs: list[Any] = []  # per output: an array (passed through) or atoms

  def box(self, parts: Sequence[Part], shape: tuple[int, ...], dtype: Any,
          out_dtype: Any) -> int:
    """An output box of `shape`, assembled in `dtype` from `parts`, delivered as
    `out_dtype`; returns its index. A part that is a whole array of its own in the
    output dtype is passed through, not copied."""
    if len(parts) == 1:
      (array, offset, pshape), starts, limits, _ = parts[0]
      if (offset < 0 and pshape == tuple(shape) and not any(starts)
          and tuple(limits) == tuple(shape) and array.dtype == out_dtype):
        self._outputs.append(array)
        return len(self._outputs) - 1
    self._outputs.append([(False, np.dtype(out_dtype),
                           [(tuple(shape), np.dtype(dtype), list(parts))])])
    return len(self._outputs) - 1

  def pack(self, boxes: Sequence[tuple[Sequence[Part], tuple[int, ...]]],
           dtype: Any) -> int:
    """A flat output: each box (its parts, its shape) flattened, concatenated, in
    `dtype`; returns its index."""
    dtype = np.dtype(dtype)
    segments = [(tuple(shape), dtype, list(parts)) for parts, shape in boxes]
    self._outputs.append([(True, dtype, segments[i:i + PROGRAM_BOXES])
                          for i in range(0, len(segments), PROGRAM_BOXES)])
    return len(self._outputs) - 1

  def run(self, device: Any = None) -> list[jax.Array]:
    """Every output, by index, on `device` (default: where the inputs are).

    Compiled programs (at most PROGRAM_BOXES boxes each, offsets as data) run the
    batch, except on CPU when it holds more boxes than one program: there the arrays
    are host memory and numpy cuts, packs and composes them (views, one copy each,
    nothing to compile; XLA compiles per program and per device, which made the first
    pull of a 26-leaf model take 9-13 s), only dtype conversions being compiled. A
    batch of few boxes (large tensors) keeps the compiled path: one dispatch, and its
    compilation is small."""
    arrays = [a for o in self._outputs if isinstance(o, list) for atom in o
              for _, _, parts in atom[2] for (a, _, _), *_ in parts]
    if arrays and all(next(iter(a.devices())).platform == "cpu" for a in arrays):
      boxes = sum(len(atom[2]) for o in self._outputs if isinstance(o, list)
                  for atom in o)
      if boxes > PROGRAM_BOXES:
        return self._run_host(device or next(iter(arrays[0].devices())))
    out = self._run_compiled()
    if device is not None:
      out = [a if next(iter(a.devices())) == device else jax.device_put(a, device)
             for a in out]
    return out

  def _run_host(self, device: Any) -> list[jax.Array]:
    views: dict[int, np.ndarray] = {}

    def block(source, starts, limits):
      array, run, pshape = source
      v = views.get(id(array))
      if v is None:
        v = views[id(array)] = np.asarray(array)  # CPU: the buffer itself, no copy
      if run >= 0:
        v = v[run:run + int(np.prod(pshape))].reshape(pshape)
      return v[tuple(slice(lo, hi) for lo, hi in zip(starts, limits))]

    out = []
    for o in self._outputs:
      if not isinstance(o, list):
        out.append(o if next(iter(o.devices())) == device else jax.device_put(o, device))
        continue
      pieces_ = []
      for flat, dtype, segments in o:
        for shape, sdtype, parts in segments:
          if len(parts) == 1 and shape_of(tuple(zip(parts[0][1], parts[0][2]))) == shape:
            b = block(*parts[0][:3])
          else:
            b = np.empty(shape, sdtype)
            for source, starts, limits, at in parts:
              b[tuple(slice(a, a + n) for a, n in zip(at, np.subtract(limits, starts)))] = (
                  block(source, starts, limits))
          pieces_.append((b, dtype, flat))
      flat, dtype = o[0][0], o[0][1]
      if flat:
        host = np.concatenate([b.reshape(-1) for b, _, _ in pieces_])
      else:
        b = pieces_[0][0]
        host = np.ascontiguousarray(b).reshape(b.shape)  # (keeps rank 0 at rank 0)
      if host.dtype != dtype:  # a conversion: XLA's, bit for bit astype
        out.append(converter(np.dtype(dtype))(jax.device_put(host, device)))
      else:
        out.append(jax.device_put(host, device))
    return out

  def _run_compiled(self) -> list[jax.Array]:
    atoms = [(j, k, atom) for j, o in enumerate(self._outputs) if isinstance(o, list)
             for k, atom in enumerate(o)]
    done: dict[tuple[int, int], jax.Array] = {}
    chunk: list[tuple[int, int, Any]] = []
    size = 0
    for item in atoms + [None]:
      boxes = len(item[2][2]) if item is not None else 0
      if chunk and (item is None or size + boxes > PROGRAM_BOXES):
        for (j, k, _), a in zip(chunk, _run_chunk([atom for _, _, atom in chunk])):
          done[(j, k)] = a
        chunk, size = [], 0
      if item is not None:
        chunk.append(item)
        size += boxes
    out = []
    for j, o in enumerate(self._outputs):
      if not isinstance(o, list):
        out.append(o)
      elif len(o) == 1:
        out.append(done[(j, 0)])
      else:
        out.append(_concatenate(len(o))(*[done[(j, k)] for k in range(len(o))]))
    return out


def _signature(atoms) -> tuple[tuple, list[jax.Array], np.ndarray]:
  """(signature, inputs, offsets) of one program over `atoms`: the signature holds
  shapes only; the offsets are data."""
  inputs, ids, offsets, sig = [], {}, [], []
  for flat, dtype, segments in atoms:
    ssig = []
    for shape, sdtype, parts in segments:
      psig = []
      whole = len(parts) == 1 and shape_of(tuple(zip(parts[0][1], parts[0][2]))) == shape
      for (array, run, pshape), starts, limits, at in parts:
        i = ids.setdefault(id(array), len(inputs))
        if i == len(inputs):
          inputs.append(array)
        block = shape_of(tuple(zip(starts, limits)))
        psig.append((i, run >= 0, pshape, block if not whole else shape))
        if run >= 0:
          offsets.append(run)
        offsets.extend(starts)
        offsets.extend(at)
      ssig.append((shape, sdtype, tuple(psig)))
    sig.append((flat, dtype, tuple(ssig)))
  return tuple(sig), inputs, np.asarray(offsets if offsets else [0], np.int64)


def _run_chunk(atoms) -> list[jax.Array]:
  sig, inputs, table = _signature(atoms)
  return list(_program(sig)(table, *inputs))


def run_offsets(boxes: Sequence[Box]) -> list[int]:
  """Where each of `boxes` starts in a pack of them (in order)."""
  offsets, at = [], 0
  for box in boxes:
    offsets.append(at)
    at += box_size(box)
  return offsets
