"""The one-device float32 -> bfloat16 refit's first call, profiled (GPU or CPU): the
first call's wall time and its cProfile (cumulative, top 45) into $OUT.
  python3 .gpu/refit_first.py DIV
"""
import cProfile, io, os, pstats, sys, time
import jax, numpy as np, jax.numpy as jnp
import jax_m2n
from jax_m2n.bench import scale
div = int(sys.argv[1])
device = jax.devices()[0]; sh = jax.sharding.SingleDeviceSharding(device)
rng = np.random.default_rng(0)
src = {n: jax.device_put(rng.standard_normal(s, dtype=np.float32), sh)
       for n, _, s, _ in scale.tree_specs(61, div)}
jax.block_until_ready(jax.jit(lambda v: v + 1)(np.float32(1)))
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
out = jax_m2n.reshard(src, sh, dtype=jnp.bfloat16)
jax.block_until_ready(out)
pr.disable()
print(f"first {time.perf_counter() - t:.3f} s")
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "refit_first_prof.log"), "w") as f:
  f.write(s.getvalue())
