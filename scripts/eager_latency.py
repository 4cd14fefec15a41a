"""Eager reshard fixed cost (CPU devices, or the GPUs where present): per-call time of a
tiny cached reshard against `jax.device_put` of the same bytes, to return to Python and
to completion.

  python scripts/eager_latency.py --devices 2                       # default (blocking)
  JAX_M2N_CPU_ASYNC=1 python scripts/eager_latency.py --devices 2   # asynchronous
  python scripts/eager_latency.py --devices 8 --iters 1000          # + the 4to4 case
  python scripts/eager_latency.py --gap_us 0                        # back to back
  python scripts/eager_latency.py --cases convert --profile         # cProfile top 15
(From a checkout, with `PYTHONPATH=.` so that its jax_m2n is the one measured.)

Cases: `convert` (4.5 KiB f32 on device 0 -> bf16 on device 0: one program, no peer;
against `jax.device_put(x.astype(bf16), d0)`), `1to1` (4.5 KiB device 0 -> 1), `tree20`
(20 leaves of 4.5 KiB, device 0 -> 1, one call), `full20` (tree20 with
`src_sharding=` given: a call the fast path does not take, so every argument rule runs
on every call) and with 4+ devices `4to4` (half the devices, dim-0 sharded -> the other
half, replicated). Each timed call starts with the
devices idle (the previous call finished, then a --gap_us sleep, 500 us by default),
so "return" is the cost of a call nobody waits on; with --gap_us 0 the calls run back
to back (caches and threads warm: the steady per-call cost); "done" adds block_until_ready. `entry` is the cached
per-device programs called directly (dispatch + output assembly, no argument work):
`reshard - entry` is the front end's per-call cost; for `convert`, `program` is the one
compiled program called bare (what XLA and the handler cost). us, median / min.
"""

import argparse
import cProfile
import io
import pstats
import time

import jax
import numpy as np


def _time(fn, iters: int, gap_s: float) -> tuple[list[float], list[float]]:
  """(return, done) seconds of `iters` calls of fn, each after a gap_s pause."""
  ret, done = [], []
  for _ in range(iters):
    t0 = time.perf_counter()
    y = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(y)
    t2 = time.perf_counter()
    ret.append(t1 - t0)
    done.append(t2 - t0)
    del y
    if gap_s:
      time.sleep(gap_s)
  return sorted(ret), sorted(done)


def _fmt(samples: list[float]) -> str:
  return f"{samples[len(samples) // 2] * 1e6:6.0f} / {samples[0] * 1e6:5.0f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--iters", type=int, default=1000)
  parser.add_argument("--gap_us", type=float, default=500.0,
                      help="pause before each timed call (0: back to back)")
  parser.add_argument("--cases", default="convert,1to1,tree20,full20,4to4",
                      help="comma-separated subset of convert,1to1,tree20,full20,4to4")
  parser.add_argument("--profile", action="store_true",
                      help="also print a cProfile top 15 (tottime) of each case's "
                      "jax_m2n.reshard calls")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.devices)
  import jax.numpy as jnp  # noqa: PLC0415
  import jax_m2n  # noqa: PLC0415 - after the device count is set
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
  from jax_m2n._src import eager  # noqa: PLC0415 - the cached entry, for the breakdown
  d = jax.devices()
  n = len(d)
  host = np.arange(1152, dtype=np.float32)  # 4.5 KiB
  s0, s1 = SingleDeviceSharding(d[0]), SingleDeviceSharding(d[1 % n])
  x0 = jax.device_put(host, s0)
  bf16 = jnp.bfloat16
  # name -> (x, dst, reshard kwargs, the device_put reference)
  cases = {
      "convert": (x0, s0, {"dtype": bf16}, lambda: jax.device_put(x0.astype(bf16), s0)),
      "1to1": (x0, s1, {}, lambda: jax.device_put(x0, s1)),
  }
  tree = {f"w{i:02d}": jax.device_put(host + i, s0) for i in range(20)}
  cases["tree20"] = (tree, s1, {}, lambda: jax.device_put(tree, s1))
  cases["full20"] = (tree, s1, {"src_sharding": s0}, lambda: jax.device_put(tree, s1))
  if n >= 4:
    src = NamedSharding(Mesh(np.array(d[:n // 2]), ("a",)), P("a"))
    dst = NamedSharding(Mesh(np.array(d[n // 2:]), ("a",)), P())
    xs = jax.device_put(host, src)
    cases["4to4"] = (xs, dst, {}, lambda: jax.device_put(xs, dst))
  wanted = [c for c in args.cases.split(",") if c in cases]
  print(f"{n} {d[0].platform.upper()} devices, {args.iters} calls per row, jax {jax.__version__}, "
        f"JAX_M2N_CPU_ASYNC={int(eager.programs._CPU_ASYNC)}, gap {args.gap_us:g} us; us, "
        "median / min")
  print(f"{'case':8s} {'what':14s} {'return':>14s} {'done':>14s}")
  for name in wanted:
    x, dst, kwargs, reference = cases[name]
    call = lambda x=x, dst=dst, kwargs=kwargs: jax_m2n.reshard(x, dst, **kwargs)  # noqa: E731
    before = set(eager.eager_cache)
    for _ in range(20):
      jax.block_until_ready(call())
      jax.block_until_ready(reference())
    new = [k for k in eager.eager_cache if k not in before]
    rows = {"reshard": call, "device_put": reference}
    if len(new) == 1:  # the entry this case built: its programs without the front end
      entry = eager.eager_cache[new[0]]
      leaves = jax.tree.leaves(x)
      rows["entry"] = lambda entry=entry, leaves=leaves: entry(leaves, False)
      if len(entry.programs) == 1:
        prog = entry.programs[0]
        from jax_m2n._src import jax_compat  # noqa: PLC0415
        shards = [jax_compat.single_device_arrays(v) for v in leaves]
        operands = [shards[t][k] for t, k in prog.operands]

        def bare(prog=prog, operands=operands, entry=entry):
          # The CPU program's last operand: its generation ticket, one per call, as
          # the entry hands them out (the site is idle between these calls).
          state = eager.state_of_site(entry.site)
          ticket = eager.tickets_of(prog.device)[state.next % eager.TICKETS]
          state.next += 1
          return prog.call(*operands, ticket)
        if entry.platform == "cpu":
          rows["program"] = bare
    for what, fn in rows.items():
      ret, done = _time(fn, args.iters, args.gap_us * 1e-6)
      print(f"{name:8s} {what:14s} {_fmt(ret):>14s} {_fmt(done):>14s}")
    if args.profile:
      profiler = cProfile.Profile()
      profiler.enable()
      for _ in range(args.iters):
        jax.block_until_ready(call())
      profiler.disable()
      out = io.StringIO()
      pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
      print(f"--- cProfile of {args.iters} calls of {name}, top 15 by tottime ---")
      print("\n".join(out.getvalue().splitlines()[4:]))


if __name__ == "__main__":
  main()
