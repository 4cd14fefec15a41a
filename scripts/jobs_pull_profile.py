"""Where a jobs pull's time goes: cProfile of one Publisher and one Subscriber in one
process (the publisher's threads profiled apart), on a tree of the jobs bench.

  PYTHONPATH=$PWD .venv/bin/python scripts/jobs_pull_profile.py \
      [--tree 20k_leaves] [--path network] [--pulls 3] [--top 25] [--sort cumulative]
(--leaves N instead of --tree: N float32 [256] leaves on one device a side.) Profiles,
each printed as its `--top` functions by `--sort`: publish (the trainer's
thread), the first pull (manifest, plan, compile, exports), a steady pull (the last of
`--pulls`, a fresh version each) on the subscriber's thread, and the publisher's
server thread and worker thread over all of them (every control message it answered,
the work it did off the server thread). Trees:
jax_m2n/bench/jobs_trees.py (4 CPU devices a side, one for one-device trees).
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _print(title: str, prof: cProfile.Profile, sort: str, top: int) -> None:
  out = io.StringIO()
  pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
  print(f"==== {title}\n{out.getvalue()}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tree", default="20k_leaves")
  parser.add_argument("--leaves", type=int, default=0,
                      help="instead of --tree: this many float32 [256] leaves, 1 device")
  parser.add_argument("--path", default="network", choices=["auto", "local", "network"])
  parser.add_argument("--pulls", type=int, default=3)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--sort", default="cumulative")
  args = parser.parse_args()
  sys.path.insert(0, ROOT)
  from jax_m2n.testing import workers
  workers.default_to_cpu_devices()
  import jax
  import jax_m2n
  from jax_m2n._src.jobs import serving
  from jax_m2n.bench import jobs_trainer, jobs_trees

  # The publisher's threads, each its own profile: the server thread's handler and,
  # where requests' work runs off it (a worker thread), that work.
  server = {"the publisher's server thread": cProfile.Profile(),
            "the publisher's worker thread": cProfile.Profile()}
  for (name, prof), method in zip(server.items(), ("handle", "_off_thread")):
    original = getattr(serving.Service, method, None)
    if original is not None:  # before the Publisher binds its handler
      setattr(serving.Service, method,
              lambda self, *a, _p=prof, _f=original, **k: _p.runcall(_f, self, *a, **k))
  devices = jax.devices()
  half = len(devices) // 2
  tree = (jobs_trees.Tree(f"{args.leaves}_leaves", ((256,),) * args.leaves, devices=1)
          if args.leaves else None)
  build = (lambda *a: jobs_trees.build_tree(jax, tree, *a)) if tree else (
      lambda *a: jobs_trees.build(jax, args.tree, *a))
  host, src = build(devices[:half], "trainer", 0)
  _, dst = build(devices[half:], "generator", 0)
  tree = [jax.device_put(h, s) for h, s in zip(host, src)]
  jax.block_until_ready(tree)
  pub = jax_m2n.Publisher(token=jobs_trainer.TOKEN, keep=2)
  sub = jax_m2n.Subscriber(pub.address, token=jobs_trainer.TOKEN)
  try:
    for i in range(args.pulls):
      publish = cProfile.Profile()
      t0 = time.perf_counter()
      version = publish.runcall(pub.publish, tree)
      t1 = time.perf_counter()
      pull = cProfile.Profile()
      out = pull.runcall(sub.pull, dst, version=version, path=args.path)
      jax.block_until_ready(out)
      t2 = time.perf_counter()
      print(f"version {version}: publish {1e3 * (t1 - t0):.1f} ms, pull "
            f"{1e3 * (t2 - t1):.1f} ms ({sub.last_pull.path})")
      if i == 0:
        _print(f"publish (version {version})", publish, args.sort, args.top)
        _print("first pull", pull, args.sort, args.top)
      del out
    _print(f"steady pull (version {version})", pull, args.sort, args.top)
    for name, prof in server.items():
      if prof.getstats():
        _print(f"{name} (every pull)", prof, args.sort, args.top)
  finally:
    sub.close()
    pub.close()


if __name__ == "__main__":
  main()
