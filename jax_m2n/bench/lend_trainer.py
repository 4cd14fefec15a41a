"""A trainer program for the lend measurements and GPU tests: a Publisher driven by JSON
lines on stdin, each answered by one JSON line on stdout.

Owns what the trainer side does on command: publishing generated trees (`values`:
the same bytes the reader generates to check against) lent or snapshotted, donating
them through a jitted step, waiting for pulls, and reporting its memory (XLA's
`bytes_in_use`, the device's used memory from the driver) and its stats. Pulls and
times nothing.

  python -m jax_m2n.bench.lend_trainer --keep 2 [--lend_limit N]
prints {"address": ...} first, then answers one line per command until "exit".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from typing import Any

TOKEN = "lend-bench-token-0123456789abcdef"


def values(jnp: Any, shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
  """A leaf's generated values (exact in every published dtype: integers in
  [-125, 125], or their parity for bool), made on the default device."""
  import jax  # noqa: PLC0415
  n = 1
  for d in shape:
    n *= d

  @jax.jit
  def make():
    x = (jnp.arange(n, dtype=jnp.int32) * 7 + seed * 13) % 251 - 125
    if jnp.dtype(dtype) == jnp.bool_:
      return (x % 2 == 0).reshape(shape)
    return x.astype(dtype).reshape(shape)
  return make()


def memory(jax: Any) -> dict[str, int]:
  """This process's XLA memory and the device's used memory (driver)."""
  from jax_m2n._src import lent_memory  # noqa: PLC0415
  from jax_m2n._src.errors import ReshardRuntimeError  # noqa: PLC0415
  d = jax.devices()[0]
  stats = d.memory_stats() or {}
  try:
    free, total = lent_memory.device_memory_used(int(d.local_hardware_id))
  except ReshardRuntimeError:  # no CUDA driver (a dry run on CPU)
    free = total = 0
  return {"bytes_in_use": int(stats.get("bytes_in_use", 0)),
          "pool_bytes": int(stats.get("pool_bytes", stats.get("bytes_reserved", 0))),
          "device_used": total - free}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--keep", type=int, default=2)
  ap.add_argument("--lend_limit", type=float, default=None)
  args = ap.parse_args(argv)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import jax_m2n  # noqa: PLC0415
  pub = jax_m2n.Publisher(token=TOKEN, keep=args.keep, lend_limit=args.lend_limit)
  tree: dict[str, Any] = {}
  step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
  out = sys.stdout
  out.write(json.dumps({"address": pub.address, **memory(jax)}) + "\n")
  out.flush()
  for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    try:
      if op == "make":  # leaves: [[name, shape, dtype], ...]
        tree = {name: values(jnp, tuple(shape), dtype, cmd.get("seed", 0))
                for name, shape, dtype in cmd["leaves"]}
        jax.block_until_ready(tree)
        answer: dict[str, Any] = {"made": len(tree)}
      elif op == "publish":
        t = time.perf_counter()
        v = pub.publish(tree, lend=cmd.get("lend", False), dtype=cmd.get("dtype"))
        answer = {"version": v, "publish_s": time.perf_counter() - t}
      elif op == "step":  # donates the tree: x + 1
        tree = step(tree)
        if cmd.get("wait"):
          jax.block_until_ready(tree)
        answer = {"stepped": True}
      elif op == "race":  # publish lent, (wait_pulled | a random wait), donate; n times
        got = []
        for _ in range(cmd["n"]):
          v = pub.publish(tree, lend=True)
          if cmd.get("wait_pulled"):
            pub.wait_pulled(v, 1, timeout_s=30)
          time.sleep(random.uniform(0.0, cmd.get("sleep_s", 0.0)))
          tree = step(tree)
          got.append(v)
        jax.block_until_ready(tree)
        answer = {"versions": got}
      elif op == "wait_pulled":
        answer = {"have": pub.wait_pulled(cmd["version"], cmd["n"],
                                          cmd.get("timeout_s", 30.0))}
      elif op == "drop":  # the caller's own references go
        tree = {}
        answer = {"dropped": True}
      elif op == "memory":
        answer = memory(jax)
      elif op == "stats":
        answer = pub.stats().to_json()
      elif op == "exit":
        pub.close()
        out.write(json.dumps({"bye": True}) + "\n")
        out.flush()
        return 0
      else:
        answer = {"error": f"unknown op {op!r}"}
    except Exception as e:  # noqa: BLE001 - reported to the driver
      answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    out.write(json.dumps(answer) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
