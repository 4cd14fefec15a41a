"""A separate program for the local data plane's two-process tests (tests/local_copy_test.py,
tests/local_memory_test.py, tests/gpu_local_test.py): one role per run.

  segment    creates a host segment filled with a pattern (no JAX), offers its fd on an
             FdServer, prints one JSON line (server name, ticket, nbytes), then sleeps
             until killed or stdin closes.
  publisher  (--platform cpu|gpu) puts the published arrays (`published`) on device 0,
             stores them into a segment (CPU: memfd + FdServer; GPU: CUDA IPC), prints
             one JSON line (what a reader needs), then waits until stdin closes.
  reader     (--platform cpu|gpu) gets the memory from that JSON line, local_copies the
             boxes of `pulled` into its arrays, and checks them bitwise against numpy
             slicing + astype of the same published values; prints "OK" and timings.

The "control channel" here is the test's pipes: the tickets and handles travel over it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

import numpy as np

ALIGN = 256  # shard offsets in a segment (>= local_copy.CUDA_POINTER_ALIGN)
PATTERN_BYTES = 1 << 20


def pattern(nbytes: int) -> np.ndarray:
  return (np.arange(nbytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def published(seed: int, scale: int = 1):
  """The published leaf: a float32 array of (64 * scale, 64) (16 KiB * scale) as 4
  source shards (rows and columns halved), its values random f32 bit patterns, NaNs and
  infs included. Returns (global array, [(start, shard array)])."""
  rng = np.random.default_rng(seed)
  rows = 64 * scale
  full = rng.integers(0, 1 << 32, (rows, 64), dtype=np.uint32).view(np.float32)
  shards = []
  for r in (0, rows // 2):
    for c in (0, 32):
      shards.append(((r, c), np.ascontiguousarray(full[r:r + rows // 2, c:c + 32])))
  return full, shards


def pulled(rows: int):
  """The reader's outputs: (start, shape, dtype name) in the published leaf's
  coordinates: rows [10, rows - 14) as float32, everything as bfloat16, a column slab
  as float16."""
  return [((10, 0), (rows - 24, 64), "float32"), ((0, 0), (rows, 64), "bfloat16"),
          ((0, 5), (rows, 35), "float16")]


def _wait_stdin(timeout_s: float) -> None:
  """Until stdin closes (the test is done with us) or `timeout_s` passes."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    ready, _, _ = select.select([sys.stdin], [], [], 0.5)
    if ready and not sys.stdin.readline():
      return


def role_segment(args) -> None:
  from jax_m2n._src.local_memory import FdServer, Segment  # noqa: PLC0415
  seg = Segment.create(PATTERN_BYTES, name="jax_m2n_test")
  seg.array[:] = pattern(PATTERN_BYTES)
  server = FdServer()
  ticket = server.offer(seg.read_only_fd(), ttl_s=60)
  print(json.dumps({"name": server.name, "ticket": ticket.hex(), "nbytes": PATTERN_BYTES,
                    "pid": os.getpid()}), flush=True)
  _wait_stdin(args.timeout)


def _layout(shards):
  offsets, at = [], 0
  for _, shard in shards:
    offsets.append(at)
    at += -(-shard.nbytes // ALIGN) * ALIGN
  return offsets, at


def role_publisher(args) -> None:
  import jax  # noqa: PLC0415
  from jax_m2n._src.local_copy import local_store  # noqa: PLC0415
  from jax_m2n._src import local_memory  # noqa: PLC0415
  from local_cases import min_ms  # noqa: PLC0415
  device = jax.devices(args.platform)[0]
  _, shards = published(args.seed, args.scale)
  arrays = [jax.device_put(shard, device) for _, shard in shards]
  offsets, nbytes = _layout(shards)
  info = {"nbytes": nbytes, "offsets": offsets}
  if args.platform == "cpu":
    seg = local_memory.Segment.create(nbytes)
    local_store(arrays, seg.address, offsets).block_until_ready()
    server = local_memory.FdServer()
    info.update(name=server.name, ticket=server.offer(seg.read_only_fd()).hex())
  else:
    seg = local_memory.DeviceSegment.create(device, nbytes)
    local_store(arrays, seg.address, offsets).block_until_ready()
    info.update(handle=seg.handle.hex())
  if args.time:
    info["store_ms"] = min_ms(
        lambda: local_store(arrays, seg.address, offsets).block_until_ready())
  print(json.dumps(info), flush=True)
  _wait_stdin(args.timeout)
  seg.close()


def role_reader(args) -> None:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax_m2n._src.local_copy import Out, local_copy  # noqa: PLC0415
  from local_cases import fill_boxes, min_ms  # noqa: PLC0415
  from jax_m2n._src import local_memory  # noqa: PLC0415
  info = json.loads(args.info)
  device = jax.devices(args.platform)[0]
  full, shards = published(args.seed, args.scale)
  if args.platform == "cpu":
    fd = local_memory.fetch_fd(info["name"], bytes.fromhex(info["ticket"]), timeout_s=10)
    seg = local_memory.Segment.open(fd, info["nbytes"])
  else:
    seg = local_memory.DeviceSegment.open(device, bytes.fromhex(info["handle"]),
                                          info["nbytes"])
  pointers = np.asarray([seg.address + o for o in info["offsets"]], dtype=np.int64)
  regions = pulled(full.shape[0])
  outs = [Out(shape, np.dtype(jnp.dtype(dtype))) for _, shape, dtype in regions]
  results = local_copy(device, pointers, fill_boxes(shards, regions), outs)
  reference = jnp.asarray(full)
  for (start, shape, dtype), out in zip(pulled(full.shape[0]), results):
    region = tuple(slice(s, s + n) for s, n in zip(start, shape))
    want = np.asarray(reference[region].astype(jnp.dtype(dtype)))
    got = np.asarray(out)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    width = {2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
    if not np.array_equal(got.view(width), want.view(width)):
      bad = np.argwhere(got.view(width) != want.view(width))[:3].tolist()
      raise SystemExit(f"MISMATCH {dtype} at {bad}")
  line = "OK"
  if args.time:
    whole = fill_boxes(shards, [((0, 0), full.shape, None)])

    def pull(dtype):
      out = [Out(full.shape, np.dtype(jnp.dtype(dtype)))]
      return lambda: local_copy(device, pointers, whole, out)[0].block_until_ready()

    x = jax.device_put(full, device)
    copy = jax.jit(lambda a: a + 0)  # one read, one write: the in-process copy
    timings = {"pull_ms": pull("float32"), "pull_bf16_ms": pull("bfloat16"),
               "inprocess_ms": lambda: copy(x).block_until_ready()}
    for name, fn in timings.items():
      fn()  # compile, first touch
      line += f" {name}={min_ms(fn):.3f}"
    line += f" bytes={full.nbytes}"
  print(line, flush=True)
  if args.platform != "cpu":
    seg.close()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--role", required=True,
                      choices=("segment", "publisher", "reader"))
  parser.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--scale", type=int, default=1)
  parser.add_argument("--info", default="")
  parser.add_argument("--time", action="store_true")
  parser.add_argument("--timeout", type=float, default=120.0)
  args = parser.parse_args()
  {"segment": role_segment, "publisher": role_publisher, "reader": role_reader}[
      args.role](args)


if __name__ == "__main__":
  main()
