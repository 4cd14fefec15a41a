"""Schedule encoding against a per-chunk reference, on random plans.

`schedule.encode` and `chunks.schedule_chunks` work on per-TensorPlan arrays; the
reference below is the straightforward per-chunk loop they replaced (kept here, not in
the library). Encodings must be equal element for element, SPMD and per device.
"""

import dataclasses

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from jax_m2n._src import planner
from jax_m2n._src.planner import chunks as chunks_lib
from jax_m2n._src import schedule as schedule_lib
from jax_m2n._src.layout import MAX_RANK, box_size, intersect, parse_layout
from jax_m2n._src.planner import FULL_TMP, SRC_SHARD, ROUTES, plan_reshard
from jax_m2n._src.topology import Topology
from plan_strategies import reshard_cases

# --------------------------------------------------------------------------------------
# Reference: one Python iteration per chunk
# --------------------------------------------------------------------------------------


def _tensor_chunks_reference(transfers, itemsize, limit):
  out = []
  read = {p for x in transfers for p in x.parents}
  for i, x in enumerate(transfers):
    if not x.parents:
      size = limit if i in read else chunks_lib.LEAF_CHUNK_FACTOR * limit
      out.append([(b, k) for k, b in enumerate(chunks_lib.chunk_box(x.box, itemsize, size))])
      continue
    parent = transfers[x.parents[0]]
    if len(x.parents) == 1 and intersect(parent.box, x.box) == x.box:
      mine = []
      for pbox, pstep in out[x.parents[0]]:
        piece = intersect(pbox, x.box)
        if piece is not None:
          mine.append((piece, pstep + 1))
      out.append(mine)
      continue
    mine = []
    for b in chunks_lib.chunk_box(x.box, itemsize, limit):
      step = 0
      for p in x.parents:
        for pbox, pstep in out[p]:
          if intersect(pbox, b) is not None:
            step = max(step, pstep + 1)
      mine.append((b, step))
    out.append(mine)
  return out


def _schedule_chunks_reference(plan):
  """(transfer, box, step) of every chunk, sorted by step (stable)."""
  limit = plan.chunk_bytes
  cap = chunks_lib.STEP_CHUNKS * limit
  usage, chunks = {}, []
  base = offset = 0
  for tp in plan.tensors:
    per_transfer = _tensor_chunks_reference(tp.transfers, tp.itemsize, limit)
    load, length = {}, 0
    for x, cs in zip(tp.transfers, per_transfer):
      for b, s in cs:
        length = max(length, s + 1)
        if x.src != x.dst:
          n = box_size(b) * tp.itemsize
          load[(x.src, s)] = load.get((x.src, s), 0) + n
          load[(x.dst, s)] = load.get((x.dst, s), 0) + n
    peak = max(load.values(), default=0)
    if peak:
      while any(usage.get(s, 0) and usage[s] + peak > cap
                for s in range(offset, offset + length)):
        offset += 1
      for s in range(offset, offset + length):
        usage[s] = usage.get(s, 0) + peak
    for i, cs in enumerate(per_transfer):
      for b, s in cs:
        chunks.append((base + i, b, offset + s))
    base += len(tp.transfers)
  chunks.sort(key=lambda c: c[2])
  return chunks


def _contiguous(extent, dims):
  k = 0
  while k < len(dims) and extent[k] == 1:
    k += 1
  return all(e == d for e, d in zip(extent[k + 1:], dims[k + 1:]))


def _buffer(plan, bufs, device, tensor, kind):
  tp = plan.tensors[tensor]
  if kind == FULL_TMP:
    return bufs.tmp[device][tensor], (0,) * len(tp.src.shape), tp.src.shape
  layout, slots = ((tp.src, bufs.operands) if kind == SRC_SHARD else (tp.dst, bufs.results))
  box = layout.box_of(device)
  return (slots[device][tensor], tuple(lo for lo, _ in box),
          tuple(hi - lo for lo, hi in box))


def _buffers_reference(plan):
  def slots(side):  # per device, its tensors numbered in tensor order
    devices = {d for tp in plan.tensors for d in getattr(tp, side).devices}
    return {d: {t: i for i, t in enumerate(
        t for t, tp in enumerate(plan.tensors) if d in getattr(tp, side).devices)}
        for d in devices}

  operands, results = slots("src"), slots("dst")
  tmp, tmp_bytes = {}, {}
  for x in plan.transfers:
    for dev, kind in ((x.src, x.src_kind), (x.dst, x.dst_kind)):
      if kind == FULL_TMP and x.tensor not in tmp.get(dev, {}):
        offset = tmp_bytes.get(dev, 0)
        tmp.setdefault(dev, {})[x.tensor] = offset
        tmp_bytes[dev] = offset + schedule_lib._align(plan.tensors[x.tensor].nbytes)
  return schedule_lib.Buffers(operands, results, tmp, tmp_bytes)


def _ops_reference(plan, staging):
  """All ops (n_ops x OP_WIDTH), workspace bytes per device, step count."""
  bufs = _buffers_reference(plan)
  chunks = _schedule_chunks_reference(plan)
  transfers = plan.transfers
  rows = np.zeros((len(chunks), schedule_lib.OP_WIDTH), np.int64)
  ws = dict(bufs.tmp_bytes)
  stage_use, stage_peak = {}, {}
  for i, (transfer, box, step) in enumerate(chunks):
    x = transfers[transfer]
    tp = plan.tensors[x.tensor]
    s_slot, s_origin, s_dims = _buffer(plan, bufs, x.src, x.tensor, x.src_kind)
    d_slot, d_origin, d_dims = _buffer(plan, bufs, x.dst, x.tensor, x.dst_kind)
    extent = tuple(hi - lo for lo, hi in box)
    packs = [-1, -1]
    if staging and x.src != x.dst:
      nbytes = schedule_lib._align(box_size(box) * tp.itemsize)
      for side, (dev, dims) in enumerate(((x.src, s_dims), (x.dst, d_dims))):
        if not _contiguous(extent, dims):
          used = stage_use.get((dev, step), 0)
          packs[side] = used
          stage_use[(dev, step)] = used + nbytes
          stage_peak[dev] = max(stage_peak.get(dev, 0), used + nbytes)
    row = rows[i]
    row[:schedule_lib.OP_FIXED] = (step, schedule_lib.STAGE_CODES[x.stage], x.tensor, x.src,
                                   x.src_kind, s_slot, x.dst, x.dst_kind, d_slot, *packs)
    for d in range(MAX_RANK):
      base = schedule_lib.OP_FIXED + 3 * d
      if d < len(extent):
        lo = box[d][0]
        row[base:base + 3] = (extent[d], lo - s_origin[d], lo - d_origin[d])
      else:
        row[base:base + 3] = (1, 0, 0)
  if staging:
    for col, devcol in ((9, 3), (10, 6)):
      mask = rows[:, col] >= 0
      if mask.any():
        rows[mask, col] += [bufs.tmp_bytes.get(int(d), 0) for d in rows[mask, devcol]]
    for dev, peak in stage_peak.items():
      ws[dev] = ws.get(dev, 0) + peak
  n_steps = (max(c[2] for c in chunks) + 1) if chunks else 0
  return rows, ws, n_steps, chunks, bufs


def _encode_reference(plan, device, staging):
  rows, ws, n_steps, _, _ = _ops_reference(plan, staging)
  if device is not None:
    rows = rows[(rows[:, 3] == device) | (rows[:, 6] == device)]
  tensors = np.zeros((len(plan.tensors), schedule_lib.TENSOR_WIDTH), np.int64)
  for t, tp in enumerate(plan.tensors):
    shape = tp.src.shape
    tensors[t, :2] = (tp.itemsize, len(shape))
    tensors[t, 2:2 + len(shape)] = shape
  header = [schedule_lib.MAGIC, schedule_lib.SCHEDULE_VERSION, len(plan.tensors),
            len(plan.devices), n_steps, len(rows), schedule_lib.OP_FIXED, MAX_RANK]
  # Version 3: each op's record holds the dims of its tensor's rank only.
  records = [row[:schedule_lib.OP_FIXED + 3 * len(plan.tensors[row[2]].src.shape)]
             for row in rows]
  return np.concatenate([np.array(header, np.int64), np.array(plan.devices, np.int64),
                         np.array([ws.get(d, 0) for d in plan.devices], np.int64),
                         tensors.reshape(-1), *records]).astype(np.int64)


# --------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------


def _varint_bytes(values) -> int:
  """The bytes of `values` as zigzag LEB128 varints, counted one by one."""
  total = 0
  for v in (int(x) for x in values):
    z = ((v << 1) ^ (v >> 63)) & ((1 << 64) - 1)
    total += max(1, -(-z.bit_length() // 7))
  return total


def _check_packed(have, want):
  """`have` is `want` (version 3) packed: its element count after the header, then
  their varints in whole words."""
  body = want[schedule_lib.HEADER_WIDTH:]
  assert have[1] == schedule_lib.PACKED_VERSION
  np.testing.assert_array_equal(have[:schedule_lib.HEADER_WIDTH][[0, *range(2, 8)]],
                                want[:schedule_lib.HEADER_WIDTH][[0, *range(2, 8)]])
  assert have[schedule_lib.HEADER_WIDTH] == len(body)
  assert len(have) == schedule_lib.HEADER_WIDTH + 1 + -(-_varint_bytes(body) // 8)


def _check_against_reference(plan):
  for staging in (False, True):
    _, ws, _, chunks, bufs = _ops_reference(plan, staging)
    got = plan.chunks
    assert len(got) == len(chunks)
    assert [dataclasses.astuple(c) for c in got] == chunks
    assert got.n_steps == (chunks[-1][2] + 1 if chunks else 0)
    new_bufs = schedule_lib.buffers(plan)
    assert new_bufs == bufs
    for device in (None, *plan.devices):
      want = _encode_reference(plan, device, staging)
      have = schedule_lib.encode(plan, device, staging)
      assert have.dtype == np.int64 and not have.flags.writeable
      _check_packed(have, want)
      np.testing.assert_array_equal(schedule_lib.widen(have), want,
                                    err_msg=f"device={device}, {staging=}")
      decoded = schedule_lib.decode(have)["ops"]
      full, _, _, _, _ = _ops_reference(plan, staging)
      if device is not None:
        full = full[(full[:, 3] == device) | (full[:, 6] == device)]
      np.testing.assert_array_equal(decoded, full)
      if device is not None:
        assert schedule_lib.workspace_bytes(plan, device, staging) == ws.get(device, 0)
        # A process encoding its own devices finds only their ops: the same encoding.
        for local in ((device,), (device, *plan.devices[1::2])):
          np.testing.assert_array_equal(
              schedule_lib.encode(plan, device, staging, local=local), have,
              err_msg=f"device={device}, {local=}, {staging=}")
    assert schedule_lib.workspace_bytes(plan, None, staging) == max(ws.values(), default=0)


def _plan_of(cases, route, chunk, domain):
  srcs = [parse_layout(src, shape) for shape, src, *_ in cases]
  dsts = [parse_layout(dst, shape) for shape, _, dst, *_ in cases]
  sizes = [case[-1] for case in cases]
  return plan_reshard(srcs, dsts, sizes, Topology(domain_size=domain), route, chunk)


def test_an_encoding_with_values_past_int32_packs_and_decodes():
  """A 1-D tensor of 2^32 one-byte elements, split over 2 devices -> 4: its dim (in every
  encoding's tensor table) and its starts pass 2^31 (5-byte varints), and the decoder
  reads the ops back; every magnitude of an int64 packs and unpacks."""
  big = _plan_of([((1 << 32,), "mesh(a0=2) P('a0') @0", "mesh(a0=4) P('a0') @2", 1)],
                 "hierarchical", 1 << 30, None)
  for device in (None, *big.devices):
    enc = schedule_lib.encode(big, device)
    assert enc[1] == schedule_lib.PACKED_VERSION, device
    wide = schedule_lib.widen(enc)
    assert wide[schedule_lib.HEADER_WIDTH:].max() >= 1 << 31
    assert len(schedule_lib.decode(enc)["ops"]) == enc[5]
  values = [0, -1, 1, 63, -64, 64, -65, 8191, 8192, 2**31, -2**31 - 1, 2**62, -2**62,
            np.iinfo(np.int64).max, np.iinfo(np.int64).min]
  head = [schedule_lib.MAGIC, 3, 0, 0, 0, 0, schedule_lib.OP_FIXED, MAX_RANK]
  probe = np.array(head + values, np.int64)
  packed = schedule_lib.pack(probe)
  assert len(packed) == schedule_lib.HEADER_WIDTH + 1 + -(-_varint_bytes(values) // 8)
  np.testing.assert_array_equal(schedule_lib.widen(packed), probe)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(reshard_cases())
def test_random_plans_encode_as_reference(case):
  shape, src, dst, domain, route, chunk, itemsize = case
  _check_against_reference(_plan_of([case], route, chunk, domain))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.lists(reshard_cases(), min_size=2, max_size=5),
                  st.sampled_from(ROUTES), st.sampled_from([8, 32, 64, 1 << 20]),
                  st.sampled_from([None, 2, 4]), st.data())
def test_random_pytrees_encode_as_reference(cases, route, chunk, domain, data):
  # Repeat some tensors: repeated layouts share one TensorPlan (and its cached arrays).
  cases = cases + data.draw(st.lists(st.sampled_from(cases), max_size=3))
  _check_against_reference(_plan_of(cases, route, chunk, domain))


def test_shared_tensor_plans_are_chunked_once():
  src = parse_layout("mesh(a=2, b=2) P(a, b) @0", (8, 8))
  dst = parse_layout("mesh(c=4) P(None, c) @2", (8, 8))
  plan = plan_reshard([src] * 3, [dst] * 3, [4] * 3, Topology(domain_size=2),
                      "hierarchical", 64)
  assert plan.tensors[0] is plan.tensors[1] is plan.tensors[2]
  tc = chunks_lib.tensor_chunks(plan.tensors[0], 64)
  assert chunks_lib.tensor_chunks(plan.tensors[0], 64) is tc
  assert len(plan.chunks) == 3 * len(tc.step)
  _check_against_reference(plan)


def test_empty_plan():
  plan = plan_reshard([], [], [])
  assert len(plan.chunks) == 0
  _check_against_reference(plan)


# --------------------------------------------------------------------------------------
# Digests and the size of a 256-device plan's encodings
# --------------------------------------------------------------------------------------


def _pytree_plan(chunk=64):
  cases = [((8, 8), "mesh(a=2, b=2) P(a, b) @0", "mesh(c=4) P(None, c) @2", 4),
           ((16,), "mesh(a=4) P(a) @0", "mesh(b=4) P(None) @4", 2)]
  return _plan_of(cases, "hierarchical", chunk, 2)


def test_digests():
  plan = _pytree_plan()
  by_device = {d: schedule_lib.encode(plan, d, True) for d in plan.devices}
  digests = {d: schedule_lib.digest(e) for d, e in by_device.items()}
  assert all(len(h) == 16 for h in digests.values())
  assert schedule_lib.digest(by_device[0].copy()) == digests[0]
  # Equal digests exactly where the encodings are equal.
  for d in plan.devices:
    for e in plan.devices:
      assert (digests[d] == digests[e]) == np.array_equal(by_device[d], by_device[e])
  # A plan's digest: the same when everything is planned again (other objects), another
  # for another chunking, staging or plan; a site key from it like from the encoding.
  want = schedule_lib.plan_digest(plan, True)
  schedule_lib.clear_caches()
  planner.clear_caches()
  again = _pytree_plan()
  assert again is not plan
  assert schedule_lib.plan_digest(again, True) == want
  assert schedule_lib.plan_digest(again, False) != want
  assert schedule_lib.plan_digest(_pytree_plan(chunk=32), True) != want
  key = schedule_lib.site_key(b"eager", want)
  assert key == schedule_lib.site_key(b"eager", schedule_lib.plan_digest(again, True))
  assert 0 <= key < 1 << 63
  assert key != schedule_lib.site_key(b"eager", want, salt=1)


def test_256_device_plan_encodings_are_sized_by_each_device():
  """A DeepSeek-V3-shaped refit on 256 devices (8 PP stages of EP16 -> TP16 x DP8, one
  layer per stage, four NVLink domains): each device's encoding holds the prefix and
  the rank-sized records of its own ops, and nothing builds the all-ops table.

  Budget: an op is on at most two devices (its source and destination), at most
  11 + 3 * rank elements each, packed as varints (1-2 bytes an element here; narrow took
  4, version 3 8); this plan's 92,990 chunks are 1-, 2- and 3-D. Its encodings take
  4.8 MiB over all devices and 0.060 MiB on the busiest (narrow: 14.4 and 0.17 MiB;
  version 3: 28.8 and 0.34 MiB;
  231,680 chunks, 62.8 MiB and 0.84 MiB before a small shard's fan-out was merged into
  one copy per receiver, routes._whole_fanout; 582,656 chunks, 144.5 MiB and 1.15 MiB
  before small tensors were led by few replicas, routes.MIN_LEAD_BYTES; version 2's
  35-element records took 2.3x that); the budgets leave ~5% for changes that do not add
  ops or widen records.
  """
  from jax_m2n.bench import suites
  model = suites.PlannerModel(name="deepseek_v3_256_small", layers=8, hidden=112,
                              experts=16, moe_ffn=128, vocab=2032)
  layouts = suites._parse_stages(model, model.descriptors())  # noqa: SLF001
  src = [s for stage, _ in layouts for s in stage]
  dst = [d for _, stage in layouts for d in stage]
  plan = plan_reshard(src, dst, [2] * len(src), model.topology())
  assert len(plan.devices) == 256 and len(plan.chunks) == 92_990
  schedule_lib._spmd.cache_clear()  # noqa: SLF001
  # Ops per device and their record widths, from the chunks and the transfers' columns.
  chunks = plan.chunks
  src_dev = np.concatenate([tp.transfers.src for tp in plan.tensors])[chunks.transfer]
  dst_dev = np.concatenate([tp.transfers.dst for tp in plan.tensors])[chunks.transfer]
  width = np.array([schedule_lib.OP_FIXED + 3 * len(tp.src.shape)
                    for tp in plan.tensors])[chunks.tensor]
  head = schedule_lib._prefix_width(plan)  # noqa: SLF001
  sizes = {}
  for d in plan.devices:
    enc = schedule_lib.encode(plan, d)
    mine = (src_dev == d) | (dst_dev == d)
    body = head - schedule_lib.HEADER_WIDTH + int(width[mine].sum())
    assert enc[1] == schedule_lib.PACKED_VERSION, d
    assert enc[schedule_lib.HEADER_WIDTH] == body, d  # the elements, one varint each
    assert enc.nbytes <= 8 * (schedule_lib.HEADER_WIDTH + 1) + 2 * body + 8, d
    sizes[d] = enc.nbytes
  assert schedule_lib._spmd.cache_info().currsize == 0  # noqa: SLF001
  assert sum(sizes.values()) <= 5.05 * (1 << 20)
  assert max(sizes.values()) <= 0.064 * (1 << 20)
  # Trainer devices send their own shards only: a small part of a generator device's.
  assert max(sizes[d] for d in range(128)) * 4 < max(sizes.values())


def test_a_process_finds_only_its_own_devices_ops():
  """One process of a 256-device refit (its 8 devices, the first host of the
  generator) encodes its devices from the plan's per-tensor chunks: the plan's op list
  (`Plan.chunks`, every device's ops) is never built, the ops found are those that touch
  its devices, and each encoding is the one any process would write."""
  from jax_m2n.bench import suites
  model = suites.PlannerModel(name="deepseek_v3_256_small", layers=8, hidden=112,
                              experts=16, moe_ffn=128, vocab=2032)
  layouts = suites._parse_stages(model, model.descriptors())  # noqa: SLF001
  src = [s for stage, _ in layouts for s in stage]
  dst = [d for _, stage in layouts for d in stage]
  schedule_lib.clear_caches()
  planner.clear_caches()
  plan = plan_reshard(src, dst, [2] * len(src), model.topology())
  local = tuple(range(128, 136))
  mine = {d: schedule_lib.encode(plan, d, True, local=local) for d in local}
  site = schedule_lib.plan_digest(plan, True)
  assert "chunks" not in plan.__dict__  # no device's encoding needed every op
  ops = schedule_lib._ops(plan, True, None, local)  # noqa: SLF001
  chunks = plan.chunks
  src_dev = np.concatenate([tp.transfers.src for tp in plan.tensors])[chunks.transfer]
  dst_dev = np.concatenate([tp.transfers.dst for tp in plan.tensors])[chunks.transfer]
  touching = np.isin(src_dev, local) | np.isin(dst_dev, local)
  assert len(ops.step) == int(touching.sum()) < len(chunks) // 4
  np.testing.assert_array_equal(ops.tensor, chunks.tensor[touching])
  np.testing.assert_array_equal(ops.index, chunks.index[touching])
  np.testing.assert_array_equal(ops.step, chunks.step[touching])
  for d in local:
    np.testing.assert_array_equal(mine[d], schedule_lib.encode(plan, d, True))
  assert schedule_lib.plan_digest(plan, True) == site
  with pytest.raises(ValueError, match="device 3 must be one of local"):
    schedule_lib.encode(plan, 3, True, local=local)


def test_a_gathered_broadcast_in_small_chunks_is_chunked_in_bounded_memory():
  """gather_bcast of a (24576, 1536) bfloat16 tensor (EP4 -> DP2 x TP4) in 4 KiB chunks:
  each broadcast chunk's step is found among the gathered chunks that can meet it (their
  flat spans overlap), not by comparing it with every one of them (18,432 x 4 gathered
  chunks per broadcast chunk: 4.5 GiB of pairs, killed for memory). Each chunk runs
  one step after the latest parent chunk it meets, checked by brute force on a sample."""
  import tracemalloc
  src = parse_layout("mesh(ep=4) P(ep, None) @0", (24576, 1536))
  dst = parse_layout("mesh(dp=2, tp=4) P(tp, None) @8", (24576, 1536))
  planner.clear_caches()
  tracemalloc.start()
  try:
    plan = plan_reshard([src], [dst], [2], Topology(domain_size=4), "gather_bcast", 4096)
    tc = chunks_lib.tensor_chunks(plan.tensors[0], plan.chunk_bytes)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert len(tc.step) == 270_336
  assert peak < 256 << 20, peak
  xs = plan.tensors[0].transfers
  parents = {x: [int(xs.parent[x])] + list(xs.extra_parents.get(x, ()))
             for x in range(len(xs)) if xs.parent[x] >= 0}
  rng = np.random.default_rng(0)
  with_parents = np.flatnonzero(np.isin(tc.transfer, list(parents)))
  for c in rng.choice(with_parents, 300, replace=False).tolist():
    of = np.flatnonzero(np.isin(tc.transfer, parents[int(tc.transfer[c])]))
    meets = (np.maximum(tc.lo[of], tc.lo[c]) < np.minimum(tc.hi[of], tc.hi[c])).all(axis=1)
    assert tc.step[c] == (tc.step[of][meets].max() + 1 if meets.any() else 0), c
