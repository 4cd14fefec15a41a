"""Where a repeated local pull's time goes, one GPU (or CPU), two programs: a
`jax_m2n.bench.lend_trainer` publishing one float32 leaf of MIB MiB, this process
pulling it N times after 10 (each after a new publish), the medians of the pull and of
its phases and local steps, then the in-process device copy of the same bytes; with
PROF=1 also a cProfile of N more pulls into $OUT/prof_MODE_MIB.txt. To compare two
trees on one machine, run it under each tree's PYTHONPATH in turns.
  python3 .gpu/prof_pull.py lend|snapshot MIB N fraction_0.35|default_prealloc|no_prealloc
"""
import cProfile, pstats, sys, time, statistics, os, io
import jax, jax.numpy as jnp
import jax_m2n
from jax.sharding import SingleDeviceSharding
from jax_m2n.bench.lend import _Trainer, SETTINGS
from jax_m2n.bench.lend_trainer import TOKEN
mode, mib, n, setting = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lend = mode == "lend"
dst = {"w": SingleDeviceSharding(jax.devices()[0])}
jax.jit(lambda v: v + 1)(jnp.zeros(8)).block_until_ready()
t = _Trainer(2, SETTINGS[setting])
t(op="make", leaves=[["w", [int(mib * (1 << 20)) // 4], "float32"]], seed=0)
sub = jax_m2n.Subscriber(t.address, token=TOKEN)
t(op="publish", lend=lend)
jax.block_until_ready(sub.pull(dst, path="local"))
def loop(k):
  ts = []; steps = []
  for i in range(k):
    t(op="publish", lend=lend)
    s = time.perf_counter()
    jax.block_until_ready(sub.pull(dst, path="local"))
    ts.append(time.perf_counter() - s)
    r = sub.last_pull
    steps.append(dict(r.steps, wait=r.wait_s, plan=r.plan_s, move=r.move_s,
                      compose=r.compose_s))
  return ts, steps
loop(10)
ts, steps = loop(n)
print(f"{mode} {mib} MiB {setting}: median {statistics.median(ts)*1e3:.3f} ms "
      f"min {min(ts)*1e3:.3f}")
print("  " + " ".join(f"{k}={statistics.median(s.get(k, 0) for s in steps)*1e3:.3f}"
                      for k in steps[0]))
x = jax.device_put(jnp.zeros(int(mib * (1 << 20)) // 4, jnp.float32), dst["w"])
cs = []
for i in range(n):
  s = time.perf_counter()
  jax.block_until_ready(jax.device_put(x, dst["w"], may_alias=False))
  cs.append(time.perf_counter() - s)
print(f"  device copy median {statistics.median(cs)*1e3:.3f} ms; pull/copy "
      f"{statistics.median(ts)/statistics.median(cs):.2f}")
if os.environ.get("PROF"):
  pr = cProfile.Profile()
  pr.enable(); loop(n); pr.disable()
  s = io.StringIO()
  st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(35)
  st.sort_stats("cumtime").print_stats(60)
  path = os.path.join(os.environ.get("OUT", "/tmp"), f"prof_{mode}_{mib}.txt")
  with open(path, "w") as f:
    f.write(s.getvalue())
sub.close(); t.close()
