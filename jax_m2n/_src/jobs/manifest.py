"""The manifest of a published version: what a subscriber must know to plan a pull.

Owns the description of one published pytree (per leaf: its key path, shape, dtype and
layout over the publisher's devices; the publisher's devices by process; each publisher
process's addresses; the pytree's skeleton where it is made of dicts, lists, tuples and
None), its JSON form with every field checked on the way in, and the publisher's device
ids as the subscriber plans with them (offset so they never collide with its own).
Knows no sockets; reads shardings only through `Layout.from_sharding`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src import collector
from jax_m2n._src.layout import MAX_DIM, MAX_RANK, Box, Layout
from jax_m2n._src.jobs import messages
from jax_m2n._src.jobs.messages import ProtocolError

# The publisher's devices in a pull's plan: ids PUBLISHER_DEVICE_BASE + k (k: the
# device's position in the manifest), above any id a subscriber's devices have (XLA's
# ids: process p's CPU devices start at p * 2048; GPUs are numbered from 0).
PUBLISHER_DEVICE_BASE = 1 << 30
MAX_LEAVES = 1 << 20
MAX_DEVICES = 1 << 16

# The dtypes a manifest and a pull may name (numbers and bool; what reshard moves).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn",
          "float8_e5m2", "complex64", "complex128")


def dtype_of(name: str) -> np.dtype:
  """A dtype named in a message; refuses names outside DTYPES."""
  got = _DTYPE_OF.get(name) if isinstance(name, str) else None
  if got is not None:
    return got
  if name not in DTYPES:
    raise ProtocolError(f"manifest: dtype must be one of {DTYPES}; got "
                        f"{messages._short(name)}.")
  got = _DTYPE_OF[name] = np.dtype(jax.numpy.dtype(name))
  return got


_DTYPE_OF: dict[str, np.dtype] = {}  # a 20,000-leaf manifest names a few dtypes


def wire_field(body: dict[str, Any], op: str, leaves: int) -> dict[int, np.dtype]:
  """A request's `wire` field (`[[leaf, dtype name], ...]`, the leaves pulled in
  another dtype than published) as {leaf: dtype}; refuses anything else."""
  pairs = body.get("wire")
  if not isinstance(pairs, list) or len(pairs) > leaves:
    raise ProtocolError(f"{op}: wire must be a list of [leaf, dtype] pairs.")
  wire: dict[int, np.dtype] = {}
  for pair in pairs:
    if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
            and 0 <= pair[0] < leaves and isinstance(pair[1], str)):
      raise ProtocolError(f"{op}: wire must be a list of [leaf, dtype] pairs.")
    wire[pair[0]] = dtype_of(pair[1])
  return wire


def piece_field(piece: Any, op: str, leaves: Sequence[Any], shards: dict,
                wire: dict[int, np.dtype]) -> tuple[int, int, Box, int]:
  """A request's piece (`[leaf, device, lo..., hi...]`) as (leaf, device, box, wire
  bytes), refused unless its leaf is listed in `wire` and its box lies inside the shard
  this process holds (`shards`: (leaf, device) -> (box, array))."""
  messages.int_list(piece, f"{op}: a piece", 0, 1 << 62, 2 + 2 * MAX_RANK)
  if len(piece) < 2 or piece[0] not in wire:
    raise ProtocolError(f"{op}: a piece must be [leaf, device, lo..., hi...] of a leaf "
                        "listed in wire.")
  t, k = piece[0], piece[1]
  rank = len(leaves[t].shape)
  held = shards.get((t, k))
  if len(piece) != 2 + 2 * rank or held is None:
    raise ProtocolError(f"{op}: leaf {t} must be held on device {k} by this process, "
                        f"with a box of rank {rank}.")
  box = tuple(zip(piece[2:2 + rank], piece[2 + rank:]))
  if any(lo > hi or lo < hlo or hi > hhi for (lo, hi), (hlo, hhi) in zip(box, held[0])):
    raise ProtocolError(f"{op}: box {box} of leaf {t} must lie inside device {k}'s "
                        f"box {held[0]}.")
  return t, k, box, math.prod(hi - lo for lo, hi in box) * wire[t].itemsize


# A request may ask for at most this many times the bytes a version holds on the
# publisher's process (flat routes send a box once per destination replica), + 1 MiB.
MAX_REQUEST_FACTOR = 64


def request_budget(nbytes: int) -> list[int]:
  """The wire bytes one request for a version of `nbytes` here may ask for (a mutable
  cell `pieces_field` draws on)."""
  return [MAX_REQUEST_FACTOR * nbytes + (1 << 20)]


def pieces_field(asked: Any, op: str, leaves: Sequence[Any], shards: dict,
                 wire: dict[int, np.dtype], budget: list[int]) -> list[tuple[int, int, Box]]:
  """A request's non-empty list of pieces, each checked (`piece_field`), as (leaf,
  device, box); their wire bytes are drawn from `budget` (`request_budget`)."""
  if not isinstance(asked, list) or not asked or len(asked) > 1 << 20:
    raise ProtocolError(f"{op}: pieces must be a non-empty list of pieces.")
  out = []
  for piece in asked:
    t, k, box, nbytes = piece_field(piece, op, leaves, shards, wire)
    budget[0] -= nbytes
    if budget[0] < 0:
      raise ProtocolError(f"{op}: a request must ask for at most {MAX_REQUEST_FACTOR} x "
                          "the version's bytes here.")
    out.append((t, k, box))
  return out


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One published leaf: key path (jax.tree_util key strings), shape, dtype (as
  published), and its layout's index in `Manifest.layouts`."""

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str
  layout: int


@dataclasses.dataclass(frozen=True, eq=False)
class Manifest:
  """What one version is made of. Equal (and hashed) by `id`, a digest of its JSON.

  Attributes:
    leaves: per leaf, in jax.tree_util flattening order.
    layouts: distinct layouts: per layout, its devices (positions in `devices`) and
      the box each holds.
    devices: per publisher device (sorted by its global id in the trainer job), the
      trainer process that holds it.
    processes: per trainer process, (control address, transport address, host
      identity: exports.host_identity, which says whether a subscriber shares its host,
      transport spec: transports.SPECS).
    skeleton: the pytree's structure (JSON) where it is only dicts (str/int keys),
      lists, tuples and None; else None (the subscriber's dst gives the structure).
  """

  leaves: tuple[Leaf, ...]
  layouts: tuple[tuple[tuple[int, ...], tuple[Box, ...]], ...]
  devices: tuple[int, ...]
  processes: tuple[tuple[str, str, str, str], ...]
  skeleton: Any
  id: str = ""

  def __hash__(self) -> int:
    return hash(self.id)

  def __eq__(self, other) -> bool:
    return isinstance(other, Manifest) and self.id == other.id

  def to_json(self) -> dict[str, Any]:
    return {"leaves": [[list(l.path), list(l.shape), l.dtype, l.layout]
                       for l in self.leaves],
            "layouts": [[list(ds), [[v for lo_hi in b for v in lo_hi] for b in boxes]]
                        for ds, boxes in self.layouts],
            "devices": list(self.devices),
            "processes": [list(p) for p in self.processes],
            "skeleton": self.skeleton}

  def names(self) -> list[str]:
    """Per leaf, how messages name it (its key path: `['layers'][0]`)."""
    return self._names

  @functools.cached_property
  def _names(self) -> list[str]:
    return ["".join(l.path) or "the root" for l in self.leaves]

  @functools.cached_property
  def plan_layouts(self) -> tuple[Layout, ...]:
    """Per leaf, its layout over the publisher's devices as plan ids."""
    by_index = {}
    out = []
    for leaf in self.leaves:
      key = (leaf.layout, leaf.shape)
      layout = by_index.get(key)
      if layout is None:
        devices, boxes = self.layouts[leaf.layout]
        layout = by_index[key] = Layout(
            leaf.shape, tuple(PUBLISHER_DEVICE_BASE + d for d in devices), boxes)
      out.append(layout)
    return tuple(out)

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(l.shape)) * np.dtype(dtype_of(l.dtype)).itemsize
               for l in self.leaves)


def digest(body: dict[str, Any]) -> str:
  return hashlib.blake2b(messages.encode(body), digest_size=16).hexdigest()


def build(leaves: Sequence[jax.Array], paths: Sequence[tuple[str, ...]],
          dtypes: Sequence[np.dtype], skeleton: Any,
          processes: Sequence[tuple[str, str, str, str]]) -> Manifest:
  """The manifest of published arrays (global jax.Arrays) as snapshotted in `dtypes`."""
  ids = sorted({d.id: d for leaf in leaves for d in leaf.sharding.device_set}.items())
  index = {i: k for k, (i, _) in enumerate(ids)}
  layouts: dict[tuple, int] = {}
  out = []
  for leaf, path, dtype in zip(leaves, paths, dtypes):
    layout = Layout.from_sharding(leaf.sharding, leaf.shape)
    key = (tuple(index[d] for d in layout.devices), layout.boxes)
    k = layouts.setdefault(key, len(layouts))
    out.append(Leaf(tuple(path), tuple(int(s) for s in leaf.shape),
                    np.dtype(dtype).name, k))
  m = Manifest(tuple(out), tuple(layouts), tuple(d.process_index for _, d in ids),
               tuple(tuple(p) for p in processes), skeleton)
  return dataclasses.replace(m, id=digest(m.to_json()))


def _entries(body: dict[str, Any], key: str, what: str, fields: str) -> list[list]:
  """body[key]: a list (at most MAX_LEAVES) of lists of len(fields) entries each."""
  raw = body.get(key)
  width = fields.count(",") + 1
  if not isinstance(raw, list) or len(raw) > MAX_LEAVES:
    raise ProtocolError(f"manifest: {key} must be a list.")
  for entry in raw:
    if not isinstance(entry, list) or len(entry) != width:
      raise ProtocolError(f"manifest: {what} must be {fields}.")
  return raw


def from_json(body: Any) -> Manifest:
  """A manifest received from a publisher, every field checked.

  Raises:
    ProtocolError: a field missing, of the wrong type or out of range, a box outside
      its leaf's shape, a layout naming an unknown device.
  """
  with collector.paused():  # a leaf, its path and shape per published leaf: no cycles
    return _from_json(body)


def _from_json(body: Any) -> Manifest:
  """from_json's work."""
  if not isinstance(body, dict):
    raise ProtocolError("manifest: must be an object.")
  devices = messages.int_list(body.get("devices"), "manifest devices", 0, 1 << 20,
                              MAX_DEVICES)
  processes = body.get("processes")
  if (not isinstance(processes, list) or not processes or len(processes) > MAX_DEVICES
      or not all(isinstance(p, list) and len(p) == 4 and all(
          isinstance(a, str) and len(a) <= 300 for a in p) and p[0] and p[1]
          and p[3] in ("net", "net+curve", "transfer_server") for p in processes)):
    raise ProtocolError("manifest: processes must be a list of [control address, "
                        "transport address, host, transport spec].")
  if any(p >= len(processes) for p in devices):
    raise ProtocolError("manifest: every device must belong to a listed process.")
  layouts = []
  for entry in _entries(body, "layouts", "a layout", "[devices, boxes]"):
    ds = messages.int_list(entry[0], "manifest layout devices", 0, len(devices) - 1,
                           MAX_DEVICES)
    boxes = entry[1]
    if not isinstance(boxes, list) or len(boxes) != len(ds) or len(set(ds)) != len(ds):
      raise ProtocolError("manifest: a layout must list one box per distinct device.")
    parsed = []
    for b in boxes:
      b = messages.int_list(b, "manifest box", 0, MAX_DIM, 2 * MAX_RANK)
      if len(b) % 2:
        raise ProtocolError("manifest: a box must be [lo, hi] per dim.")
      parsed.append(tuple((b[i], b[i + 1]) for i in range(0, len(b), 2)))
    layouts.append((tuple(ds), tuple(parsed)))
  leaves = []
  inside: set[tuple[int, tuple[int, ...]]] = set()
  shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # equal shapes as one tuple
  raw = _entries(body, "leaves", "a leaf", "[path, shape, dtype, layout]")
  for entry in raw:
    path, shape, dtype, k = entry
    if not isinstance(path, list) or len(path) > 64 or not all(
        isinstance(p, str) and len(p) <= 1000 for p in path):
      raise ProtocolError("manifest: a leaf's path must be a list of key strings.")
    shape = tuple(messages.int_list(shape, "manifest shape", 0, MAX_DIM - 1, MAX_RANK))
    shape = shapes.setdefault(shape, shape)
    dtype_of(dtype)
    if type(k) is not int or not 0 <= k < len(layouts):
      raise ProtocolError("manifest: a leaf must name a listed layout.")
    if (k, shape) not in inside:  # leaves of one layout and shape: checked once
      for box in layouts[k][1]:
        if len(box) != len(shape) or any(not 0 <= lo <= hi <= s
                                          for (lo, hi), s in zip(box, shape)):
          raise ProtocolError(f"manifest: every box must lie inside its leaf's shape "
                              f"{shape}; got {box}.")
      inside.add((k, shape))
    leaves.append(Leaf(tuple(path), shape, dtype, k))
  # The id is the digest of the manifest's JSON (`to_json`), and the checked fields
  # as received are that JSON: lists of the same ints and strings, in the same order.
  checked = {"leaves": raw, "layouts": body["layouts"], "devices": devices,
             "processes": processes, "skeleton": body.get("skeleton")}
  return Manifest(tuple(leaves), tuple(layouts), tuple(devices),
                  tuple(tuple(p) for p in processes), body.get("skeleton"),
                  digest(checked))


# ---------------------------------------------------------------------------------------
# The pytree's skeleton (built-in containers only) and key paths
# ---------------------------------------------------------------------------------------

class _Custom(Exception):
  pass


def skeleton_of(tree: Any) -> Any:
  """A JSON description of `tree`'s structure, or None where it holds a node other
  than dict (str/int keys), list, tuple or None (its class cannot travel as JSON)."""
  def walk(node):
    if node is None:
      return {"n": 0}
    if type(node) is dict:
      if not all(type(k) in (str, int) for k in node):
        raise _Custom
      return {"d": [[k, walk(node[k])] for k in sorted(node)]}
    if type(node) is list:
      return {"l": [walk(v) for v in node]}
    if type(node) is tuple:
      return {"t": [walk(v) for v in node]}
    if isinstance(node, jax.Array):
      return {"x": 0}
    raise _Custom
  try:
    return walk(tree)
  except (_Custom, TypeError):
    return None


def rebuild(skeleton: Any, leaves: Sequence[Any]) -> Any:
  """The pytree `skeleton` describes, with `leaves` in flattening order.

  Raises:
    ProtocolError: a skeleton that is not one `skeleton_of` makes, or that holds
      another number of leaves.
  """
  it = iter(leaves)
  count = [0]

  def walk(node, depth):
    if depth > 64 or not isinstance(node, dict) or len(node) != 1:
      raise ProtocolError("manifest: malformed skeleton.")
    (kind, value), = node.items()
    if kind == "n":
      return None
    if kind == "x":
      count[0] += 1
      try:
        return next(it)
      except StopIteration:
        raise ProtocolError("manifest: the skeleton holds more leaves than the manifest.") from None
    if kind == "d" and isinstance(value, list):
      out = {}
      for item in value:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
          raise ProtocolError("manifest: malformed skeleton.")
        out[item[0]] = walk(item[1], depth + 1)
      return out
    if kind in ("l", "t") and isinstance(value, list):
      items = [walk(v, depth + 1) for v in value]
      return items if kind == "l" else tuple(items)
    raise ProtocolError("manifest: malformed skeleton.")

  out = walk(skeleton, 0)
  if count[0] != len(leaves):
    raise ProtocolError("manifest: the skeleton holds fewer leaves than the manifest.")
  return out


def key_path(path: Sequence[Any]) -> tuple[str, ...]:
  """A jax.tree_util key path as strings (`['w']`, `[0]`, `.x`): equal on both sides
  for equal pytrees."""
  return tuple(map(str, path))
