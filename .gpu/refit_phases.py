"""Where the one-device float32 -> bfloat16 refit's repeat goes (GPU or CPU): the
medians of the eager call's dispatch and assembly, of the call returning and of the
outputs ready, against one jitted astype over the same tree.
  python3 .gpu/refit_phases.py DIV   # DIV: the scale tree's divisor (16: ~880 MiB)
"""
import sys, time
import jax, numpy as np, jax.numpy as jnp
import jax_m2n
from jax_m2n.bench import scale
from jax_m2n._src.eager import programs
div = int(sys.argv[1])
device = jax.devices()[0]; sh = jax.sharding.SingleDeviceSharding(device)
rng = np.random.default_rng(0)
src = {n: jax.device_put(rng.standard_normal(s, dtype=np.float32), sh) for n, _, s, _ in scale.tree_specs(61, div)}
T = {}
def acc(k, v): T.setdefault(k, []).append(round(v * 1000, 2))
for name in ("_dispatch", "_assemble"):
  orig = getattr(programs.EagerReshard, name)
  def w(self, *a, _o=orig, _n=name, **k):
    t = time.perf_counter(); r = _o(self, *a, **k); acc(_n, time.perf_counter() - t); return r
  setattr(programs.EagerReshard, name, w)
cast = jax.jit(lambda t: jax.tree.map(lambda v: v.astype(jnp.bfloat16), t))
for label, fn in (("reshard", lambda: jax_m2n.reshard(src, sh, dtype=jnp.bfloat16)), ("astype", lambda: cast(src))):
  out = fn(); jax.block_until_ready(out)
  for i in range(10):
    del out
    t = time.perf_counter(); out = fn(); t1 = time.perf_counter(); jax.block_until_ready(out); acc(label + " call", t1 - t); acc(label + " total", time.perf_counter() - t)
for k, v in T.items(): print(k, sorted(v)[len(v)//2], v[-5:])
