"""One process of tests/jobs_relay_test.py (and the relay bench): a trainer job that
publishes versions, or a one-process subscriber job that pulls every version from its
first through a relay, checks each bitwise and may leave, die or be killed.

Not a test by itself. Usage, one per process:
  python3 tests/jobs_relay_worker.py --role trainer|subscriber --name NAME --dir DIR
      [--versions V] [--period S] [--wait-for N] [--dtype float32|bfloat16]
      [--leave-after V] [--die-version V --die-chunks N] [--mib M] [--no-relay]
      [--pull-delay S]
The trainer writes DIR/address, waits (bounded) for N DIR/ready_* files, then publishes
version v, and the next once `period` s have passed and every subscriber that is ready
and not gone (DIR/gone_NAME) has it (DIR/latest_NAME; bounded: 120 s), as an RL loop
waits for its rollouts; it prints "RESULT published ..." per version and waits for
DIR/done. A subscriber writes DIR/ready_NAME (S seconds after it started with
--pull-delay), pulls the newest version,
then each next one, and prints "RESULT pulled name=NAME version=v ok=1 ..." per
version (bytes from the trainer and from other members, re-routes, seconds), and
after the last one waits (bounded) until every subscriber ready and not gone has it
too; "RESULT left" after a clean leave; with --die-version it dies (os._exit(9)) once it has
offered N chunks to a child in a version >= V ("RESULT dying ..."), or, if it never
has a child by version V + 2, once N chunks of that version arrived. Every wait is
bounded.
"""

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from jax_m2n.testing import workers  # noqa: E402

TOKEN = "jobs-relay-test-token"
COLS = 1024


def shapes(mib):
  """Two leaves of `mib` MiB of float32 in all."""
  rows = max(8, (mib << 20) // 4 // COLS // 2 // 8 * 8)
  return {"w": (rows, COLS), "b": (rows, COLS)}


def values(shape, version, name):
  import numpy as np
  rng = np.random.default_rng([version, len(name), ord(name[0])])
  return rng.standard_normal(shape, dtype=np.float32)


def _behind(directory, version):
  """The subscribers ready and not gone that do not have `version` yet."""
  names = [f[len("ready_"):] for f in os.listdir(directory) if f.startswith("ready_")]
  out = []
  for name in names:
    if os.path.exists(os.path.join(directory, f"gone_{name}")):
      continue
    try:
      with open(os.path.join(directory, f"latest_{name}")) as f:
        latest = int(f.read())
    except (OSError, ValueError):
      latest = 0
    if latest < version:
      out.append(name)
  return out


def trainer(jax, jax_m2n, args):
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  pub = jax_m2n.Publisher(f"{args.host}:0", token=TOKEN, keep=args.versions)
  if args.process_id == 0:
    workers.write_file(os.path.join(args.dir, "address"), pub.address)
  deadline = time.monotonic() + 120
  while (len([f for f in os.listdir(args.dir) if f.startswith("ready_")]) < args.wait_for
         and time.monotonic() < deadline):
    time.sleep(0.05)
  mesh = Mesh(np.array(jax.devices()), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  for v in range(1, args.versions + 1):
    started = time.monotonic()
    tree = {k: jax.make_array_from_callback(s, sharding, lambda i, h=values(s, v, k): h[i])
            for k, s in shapes(args.mib).items()}
    pub.publish(tree)
    jax.block_until_ready(tree)
    print(f"RESULT published role=trainer process={args.process_id} version={v} "
          f"at={time.time():.6f}", flush=True)
    done = os.path.join(args.dir, "done")
    limit = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < limit and (
        time.monotonic() < started + args.period or _behind(args.dir, v)):
      time.sleep(0.02)
  workers.wait_file(os.path.join(args.dir, "done"), 600)
  pub.close()
  return 0


def _die_hooks(args):
  """--die-version: die once N chunks were offered to a child (a member others pull
  from), or, by version V + 2, once N chunks arrived."""
  from jax_m2n._src.jobs import relay
  state = {"version": 0, "offered": 0, "arrived": 0}
  original_init = relay._Forwarder.__init__
  original_state = relay._state

  def dying(how, version):
    print(f"RESULT dying name={args.name} version={version} {how}=1 "
          f"at={time.time():.6f}", flush=True)
    workers.write_file(os.path.join(args.dir, f"gone_{args.name}"))
    os._exit(9)

  def forwarder(self, member, v, transport, timeout_s):
    class Counting:  # the member's own transport, counting its offers to children
      def offer(self_, *a, **k):
        ticket = transport.offer(*a, **k)
        if v.version >= args.die_version:
          state["offered"] += 1
          if state["offered"] >= args.die_chunks:
            dying("forwarding", v.version)
        return ticket

      def __getattr__(self_, name):
        return getattr(transport, name)
    original_init(self, member, v, Counting(), timeout_s)

  def watched(array):
    out = original_state(array)
    if (out == "ok" and threading.current_thread() is threading.main_thread()
        and state["version"] >= args.die_version + 2):
      state["arrived"] += 1
      if state["arrived"] >= args.die_chunks:
        dying("receiving", state["version"])
    return out

  relay._Forwarder.__init__ = forwarder
  relay._state = watched
  return state


def subscriber(jax, jax_m2n, args):
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_m2n._src.jobs import engine, relay
  address = workers.wait_file(os.path.join(args.dir, "address"), 120)
  sub = jax_m2n.Subscriber(address, token=TOKEN, relay=not args.no_relay)
  if sub._state.relay is not None and args.chunk_kib:
    sub._state.relay.chunk_bytes = args.chunk_kib << 10
  state = _die_hooks(args) if args.die_version else {}
  mesh = Mesh(np.array(jax.devices()), ("y",))
  dst = {"w": NamedSharding(mesh, P(None, "y")), "b": NamedSharding(mesh, P("y"))}
  dtype = None if args.dtype == "float32" else np.dtype(getattr(ml_dtypes, args.dtype))
  time.sleep(args.pull_delay)  # (a trainer that waits for fewer starts without it)
  workers.write_file(os.path.join(args.dir, f"ready_{args.name}"))
  out, version = None, None
  while True:
    before = dict(relay.stats, direct=engine.stats["pulled_bytes"])
    state["version"] = version or 1  # (about: the first pull takes the newest)
    t0 = time.perf_counter()
    got = sub.pull(dst, dtype=dtype, version=version, donate=out, timeout_s=60,
                   path="network")
    seconds = time.perf_counter() - t0
    v = sub.version
    for k, shape in shapes(args.mib).items():
      want = values(shape, v, k)
      if dtype is not None:
        want = want.astype(dtype)
      have = np.asarray(got[k])
      if have.dtype != want.dtype or not np.array_equal(have.view(np.uint8),
                                                        want.view(np.uint8)):
        print(f"RESULT pulled name={args.name} version={v} ok=0 FAIL leaf={k}", flush=True)
        return 1
      if got[k].sharding != dst[k]:
        print(f"RESULT pulled name={args.name} version={v} ok=0 FAIL sharding", flush=True)
        return 1
    delta = {k: relay.stats[k] - before.get(k, 0) for k in
             ("from_trainer_bytes", "from_peers_bytes", "reroutes")}
    # A pull the coordinator sent straight to the trainer (its group relayed a newer
    # version already) counts as bytes from the trainer too.
    delta["from_trainer_bytes"] += engine.stats["pulled_bytes"] - before["direct"]
    print(f"RESULT pulled name={args.name} version={v} ok=1 group={args.dtype} "
          f"trainer={delta['from_trainer_bytes']} peers={delta['from_peers_bytes']} "
          f"reroutes={delta['reroutes']} seconds={seconds:.3f} at={time.time():.6f}",
          flush=True)
    out, version = got, v + 1
    workers.write_file(os.path.join(args.dir, f"latest_{args.name}"), str(v))
    if args.leave_after and v >= args.leave_after:
      t0 = time.perf_counter()
      sub.close()
      workers.write_file(os.path.join(args.dir, f"gone_{args.name}"))
      print(f"RESULT left name={args.name} version={v} "
            f"seconds={time.perf_counter() - t0:.3f}", flush=True)
      return 0
    if v >= args.versions:
      break
  # Later members of the chain may still read the last version from this one: it
  # stays until every subscriber ready and not gone has it (bounded), as a job would,
  # rather than leaving them to re-route to the trainer.
  limit = time.monotonic() + 60
  while _behind(args.dir, args.versions) and time.monotonic() < limit:
    time.sleep(0.02)
  sub.close()
  return 0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--role", choices=["trainer", "subscriber"], required=True)
  p.add_argument("--name", default="t")
  p.add_argument("--dir", required=True)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--versions", type=int, default=6)
  p.add_argument("--period", type=float, default=1.5)
  p.add_argument("--wait-for", type=int, default=0)
  p.add_argument("--mib", type=int, default=8)
  p.add_argument("--chunk-kib", type=int, default=0)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--leave-after", type=int, default=0)
  p.add_argument("--die-version", type=int, default=0)
  p.add_argument("--die-chunks", type=int, default=2)
  p.add_argument("--no-relay", action="store_true")
  p.add_argument("--pull-delay", type=float, default=0.0)
  p.add_argument("--process-id", type=int, default=0)  # a trainer job of several
  p.add_argument("--num-processes", type=int, default=1)  # processes (jax.distributed)
  p.add_argument("--port", type=int, default=0)
  args = p.parse_args()
  import logging
  logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(message)s")
  logging.getLogger("jax_m2n").setLevel(logging.INFO)  # the relay's joins and re-routes
  workers.run_worker(trainer if args.role == "trainer" else subscriber, args,
                     f"127.0.0.1:{args.port}", f"role={args.role} name={args.name}")


if __name__ == "__main__":
  main()
