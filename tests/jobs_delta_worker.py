"""One process of a trainer or a generator job for tests/jobs_delta_test.py: the
separate-programs harness of tests/jobs_worker.py (its argument parsing, its
jax.distributed set-up and its orderly exit), with delta sync's scenario.

Not a test by itself. Usage, one per process:
  python3 tests/jobs_delta_worker.py --role trainer|generator --process-id I \
      --num-processes N --devices D --port P --dir DIR --scenario delta [--seed K]

The trainer publishes VERSIONS versions of LEAVES random-layout leaves, each version
changing a sparse random set of elements of the last (plus one leaf entirely); the
generator pulls every version with delta=True, donating the last result, checks each
bitwise, and prints "RESULT delta role=generator process=I ok=1 deltas=N in_place=B
delta_bytes=X full_bytes=Y"; in a 2-process generator job, then a pull whose processes
hold different bases (process 1 deleted its previous arrays): "RESULT mismatch ...
ok=1" when it failed on both with the rule's message; then two delta="auto" pulls,
full (nothing measured yet) and then, given a slow link's estimates, a delta: "RESULT
auto ... ok=1".
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jobs_worker  # noqa: E402
from jax_m2n.testing import workers  # noqa: E402

VERSIONS = 4
# (shape, dtype, pulled dtype or None)
LEAVES = [((64, 512), "float32", "bfloat16"), ((96, 256), "bfloat16", None),
          ((32, 1024), "float32", None), ((12,), "float32", None),
          ((8, 8, 130), "int32", "float32")]


def _dtype(name):
  import ml_dtypes
  import numpy as np
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def hosts(seed, version):
  """Every leaf's values at `version` (both jobs compute them alike)."""
  import numpy as np
  out = []
  for c, (shape, dtype, _) in enumerate(LEAVES):
    h = jobs_worker.values(seed, c, 1, shape, _dtype(dtype))
    for v in range(2, version + 1):
      rng = np.random.default_rng([seed, c, v])
      if c == len(LEAVES) - 2:  # a small leaf that changes entirely: dense
        h = h + np.ones_like(h)
        continue
      flat = h.reshape(-1)
      at = rng.integers(0, flat.size, max(1, flat.size // 1000))
      flat[at] = (flat[at] + 1).astype(flat.dtype)
    out.append(h)
  return out


def trainer(jax, jax_m2n, args):
  pub = jax_m2n.Publisher("127.0.0.1:0", token=jobs_worker.TOKEN, keep=VERSIONS)
  if args.process_id == 0:
    workers.write_file(os.path.join(args.dir, "address"), pub.address)
  srcs = jobs_worker.shardings(jax, args.seed + 1, jax.devices(), [s for s, _, _ in LEAVES])
  for v in range(1, VERSIONS + 1):
    tree = [jax.make_array_from_callback(h.shape, s, lambda i, h=h: h[i], dtype=h.dtype)
            for h, s in zip(hosts(args.seed, v), srcs)]
    assert pub.publish(tree) == v
  print(f"RESULT published role=trainer process={args.process_id} versions={VERSIONS}",
        flush=True)
  workers.wait_file(os.path.join(args.dir, "generator_done"), 240)
  pub.close()
  return 0


def generator(jax, jax_m2n, args):
  from jax_m2n._src.jobs import delta
  address = workers.wait_file(os.path.join(args.dir, "address"), 120)
  sub = jax_m2n.Subscriber(address, token=jobs_worker.TOKEN)
  dsts = jobs_worker.shardings(jax, args.seed + 2, jax.devices(), [s for s, _, _ in LEAVES])
  outs = [None if o is None else _dtype(o) for _, _, o in LEAVES]
  prev, in_place = None, True
  for v in range(1, VERSIONS + 1):
    if v == 2:
      start = dict(delta.stats)
    out = sub.pull(dsts, dtype=outs, version=v, delta=True, donate=prev, timeout_s=120,
                   path="network")
    if prev is not None:
      in_place = in_place and all(a.is_deleted() for a in prev)
    for c, (h, s, o) in enumerate(zip(hosts(args.seed, v), dsts, outs)):
      try:
        jobs_worker._check(out[c], h, s, o)
      except AssertionError as e:
        print(f"RESULT delta role=generator process={args.process_id} FAIL version={v} "
              f"leaf={c}: {e}", flush=True)
        return 1
    prev = out
  got = {k: delta.stats[k] - start.get(k, 0) for k in delta.stats}
  if jax.process_count() > 1:
    # Process 1 loses its previous arrays, process 0 keeps them: their bases differ,
    # and the pull must fail on both, naming it, before any byte moves.
    if args.process_id == 1:
      for a in out:
        a.delete()
    try:
      sub.pull(dsts, dtype=outs, version=VERSIONS, delta=True, timeout_s=60,
               path="network")
      print(f"RESULT mismatch role=generator process={args.process_id} ok=0", flush=True)
    except jax_m2n.ReshardValueError as e:
      print(f"RESULT mismatch role=generator process={args.process_id} "
            f"ok={int('same previous version' in str(e))} {e}", flush=True)
  # delta="auto": the first pull full (no rate measured yet; in a 2-process job one
  # process also has no base); then, the estimates those of a slow link on every
  # process, a delta on all of them (the job agrees), both bitwise.
  kinds = []
  for forced in (False, True):
    if forced:
      est = sub._state.auto
      est.learn_full(1000, 1.0)
      est.learn_encode(0.0)
      est.learn_changed({t: (1, 1000) for t in range(len(LEAVES))}, full=False)
    before = dict(delta.stats)
    out = sub.pull(dsts, dtype=outs, version=VERSIONS, delta="auto", timeout_s=120,
                   path="network")
    kinds.append("delta" if delta.stats["subscriber_auto_delta"] > before.get(
        "subscriber_auto_delta", 0) else "full")
    for c, (h, s, o) in enumerate(zip(hosts(args.seed, VERSIONS), dsts, outs)):
      jobs_worker._check(out[c], h, s, o)
  print(f"RESULT auto role=generator process={args.process_id} "
        f"ok={int(kinds == ['full', 'delta'])} kinds={','.join(kinds)}", flush=True)
  print(f"RESULT delta role=generator process={args.process_id} ok=1 "
        f"deltas={got['subscriber_delta_pulls']} in_place={in_place} "
        f"delta_bytes={got['subscriber_pulled_bytes']} "
        f"full_bytes={got['subscriber_dense_bytes']}", flush=True)
  return jobs_worker.generator_done(sub, args)


if __name__ == "__main__":
  jobs_worker.trainer = trainer
  jobs_worker.generator = generator
  jobs_worker.main()
