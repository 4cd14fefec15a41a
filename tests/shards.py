"""Comparing a result with a reference shard by shard, bit for bit (a helper module of
the tests: tests/BUILD gives it to every test)."""

import numpy as np


def bits(a) -> np.ndarray:
  """a's bytes, flat: NaN payloads, signed zeros and padding-free dtypes compared
  exactly (a dtype of no bytes is returned as it is)."""
  a = np.ascontiguousarray(np.asarray(a)).reshape(-1)
  return a.view(np.uint8) if a.dtype.itemsize else a


def assert_same_shards(y, ref) -> None:
  """y's addressable shards are ref's: on the same devices, at the same indices, with
  the same bits."""
  ys = {s.device: s for s in y.addressable_shards}
  rs = {s.device: s for s in ref.addressable_shards}
  assert set(ys) == set(rs)
  for d, r in rs.items():
    assert ys[d].index == r.index, (d, ys[d].index, r.index)
    np.testing.assert_array_equal(bits(ys[d].data), bits(r.data), err_msg=str(d))
