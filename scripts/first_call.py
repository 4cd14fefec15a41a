"""The first call of a large pytree: `jax_m2n.reshard` against `jax.device_put` of the
same leaves into the same layout, each in a fresh process (what a model's first refit
pays at start-up: planning, building and compiling the programs), then the second call.

  python scripts/first_call.py                         # 2,000 leaves, 3 runs each
  python scripts/first_call.py --leaves 500 --runs 5
  python scripts/first_call.py --shapes mixed          # 10 shapes, as a model's layers
(From a checkout, with `PYTHONPATH=.` so that its jax_m2n is the one measured.)

The leaves are float32 (16, 8) arrays (`--shapes mixed`: ten shapes, cycled, as the
parameters of a repeated layer), dim-0 sharded over devices 0-3, moved to devices 4-7
sharded on dim 1. Prints seconds per run (median of --runs fresh processes) and the
ratio reshard / device_put.
"""

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
fn_name, n, mixed = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "mixed"
D = np.array(jax.devices())
src = NamedSharding(Mesh(D[:4], ("x",)), P("x"))
dst = NamedSharding(Mesh(D[4:], ("y",)), P(None, "y"))
shapes = [(16, 8)] if not mixed else [(8 * (k + 1), 4 * (k % 3 + 1)) for k in range(10)]
tree = {f"leaf{i:05d}": jax.device_put(np.full(shapes[i % len(shapes)], i, np.float32), src)
        for i in range(n)}
jax.block_until_ready(tree)
if fn_name == "reshard":
  import jax_m2n
  fn = jax_m2n.reshard
else:
  fn = jax.device_put
times = []
for _ in range(2):
  t = time.perf_counter()
  out = jax.block_until_ready(fn(tree, dst))
  times.append(time.perf_counter() - t)
assert all(np.asarray(out[k])[0, 0] == int(k[4:]) for k in list(out)[:50])
print(json.dumps(times))
"""


def _run(fn_name: str, leaves: int, shapes: str) -> list[float]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _CHILD, fn_name, str(leaves), shapes],
                        capture_output=True, text=True, env=env, timeout=900, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=2000)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--shapes", choices=("one", "mixed"), default="one")
  args = parser.parse_args()
  result = {}
  for fn_name in ("device_put", "reshard"):
    runs = sorted((_run(fn_name, args.leaves, args.shapes) for _ in range(args.runs)),
                  key=lambda t: t[0])
    result[fn_name] = runs[len(runs) // 2]
    print(f"{fn_name:10s} first {result[fn_name][0]:7.3f} s   second "
          f"{result[fn_name][1]:7.3f} s   (median of {args.runs} processes, "
          f"{args.leaves} leaves, shapes {args.shapes})", flush=True)
  first = result["reshard"][0] / result["device_put"][0]
  second = result["reshard"][1] / result["device_put"][1]
  print(f"reshard / device_put: first call {first:.2f}x, second call {second:.2f}x")


if __name__ == "__main__":
  main()
