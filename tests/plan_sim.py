"""A numpy executor of encoded schedules: the test oracle of planner + encoding.

Runs docs/schedule_format.md literally: every device's buffers as numpy arrays, ops
step by step, and each step reads a snapshot taken before the step, so an op that
reads what another op of the same step writes gets stale bytes and the check fails.
"""

import numpy as np

from jax_m2n._src import schedule as schedule_lib
from jax_m2n._src.planner import DST_SHARD, FULL_TMP, SRC_SHARD


def _slices(box):
  return tuple(slice(lo, hi) for lo, hi in box)


def run(plan, arrays, staging=False):
  """Executes `plan` on global numpy `arrays`; returns (results, writes).

  results[(device, tensor)] is the destination buffer of each destination device;
  writes[(device, tensor)] counts how many times each element of it was written.
  """
  from jax_m2n._src.schedule import buffers
  bufs = buffers(plan)
  enc = schedule_lib.decode(schedule_lib.encode(plan, staging=staging))
  mem = {}
  for t, tp in enumerate(plan.tensors):
    for d, box in zip(tp.src.devices, tp.src.boxes):
      mem[(d, SRC_SHARD, bufs.operands[d][t])] = arrays[t][_slices(box)].copy()
    for d, box in zip(tp.dst.devices, tp.dst.boxes):
      shape = tuple(hi - lo for lo, hi in box)
      mem[(d, DST_SHARD, bufs.results[d][t])] = np.zeros(shape, arrays[t].dtype)
  for d, offsets in bufs.tmp.items():
    for t, off in offsets.items():
      mem[(d, FULL_TMP, off)] = np.zeros(arrays[t].shape, arrays[t].dtype)
  writes = {k: np.zeros(v.shape, np.int64) for k, v in mem.items() if k[1] == DST_SHARD}
  ops = enc["ops"]
  for step in range(enc["n_steps"]):
    snapshot = {k: v.copy() for k, v in mem.items()}
    for op in ops[ops[:, 0] == step]:
      tensor, src, skind, sslot, dst, dkind, dslot = (int(v) for v in op[[2, 3, 4, 5, 6, 7, 8]])
      rank = len(arrays[tensor].shape)
      ext = [int(op[11 + 3 * d]) for d in range(rank)]
      slo = [int(op[12 + 3 * d]) for d in range(rank)]
      dlo = [int(op[13 + 3 * d]) for d in range(rank)]
      sbox = tuple(slice(a, a + e) for a, e in zip(slo, ext))
      dbox = tuple(slice(a, a + e) for a, e in zip(dlo, ext))
      data = snapshot[(src, skind, sslot)][sbox]
      target = mem[(dst, dkind, dslot)]
      assert target[dbox].shape == tuple(ext), (op, target.shape)
      target[dbox] = data
      if dkind == DST_SHARD:
        writes[(dst, DST_SHARD, dslot)][dbox] += 1
  results, counts = {}, {}
  for t, tp in enumerate(plan.tensors):
    for d in tp.dst.devices:
      key = (d, DST_SHARD, bufs.results[d][t])
      results[(d, t)] = mem[key]
      counts[(d, t)] = writes[key]
  return results, counts
