"""The `jobs` suite: `Publisher.publish` + `Subscriber.pull` between two separate
programs against JAX's transfer server pulling the same bytes raw.

Owns one comparison (issue 32): a trainer program (a subprocess with 4 CPU devices, or
the first GPU) publishes each case's pytree; this process (the generator) pulls it into
its layout, and also pulls the trainer's shards raw through the transfer server (uuids
agreed in advance: no control plane, no planning, no slicing). Cases: `same` (float32,
P(x) on 4 devices -> P(x) on 4: the raw pull moves exactly the same arrays), `bf16`
(float32 P(x, None) -> bfloat16 P(None, x): the wire carries half the bytes), `pytree64`
(64 leaves of a transformer-like pytree, P(x, None) -> P(None, x)). Every pull is
validated bitwise against numpy once; times are the median of `iters` pulls after
`warmup`; publish times (snapshot copies) are the trainer's.

Runs on 127.0.0.1 (this process the generator), then, as root with iproute2, across
two emulated hosts (jax_m2n.testing.hosts) on --link_rate links (both sides programs
of their own; report `jobs_network`). Then the relay table (bench/relay.py, issue 34): K = 1, 2, 4, 8 subscriber jobs relaying
against pulling directly, and the recovery from a member's death.

Usage:
  python -m jax_m2n.bench --suite jobs [--size_mib 64] [--iters 5] [--link_rate 1gbit]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from jax_m2n.bench import report

MIB = 1 << 20
CASES = ("same", "bf16", "pytree64")
TOKEN = "jobs-bench-token-01234"
DEFAULT_SIZE_MIB = 64
DEVICES = 4


def _tree(jax, case: str, size: int, devices, seed: int, side: str):
  """(host values, shardings) of a case on `devices` (the trainer's or generator's)."""
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(devices), ("x",))
  rng = np.random.default_rng(seed)
  cols = 1024
  if case == "pytree64":
    rows = max(len(devices), (size // 64 // 4 // cols) // len(devices) * len(devices))
    shapes = [(rows, cols)] * 64
  else:
    shapes = [(max(len(devices), (size // 4 // cols) // len(devices) * len(devices)), cols)]
  host = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
  if side == "trainer":
    spec = P("x") if case == "same" else P("x", None)
  else:
    spec = P("x") if case == "same" else P(None, "x")
  dtype = ml_dtypes.bfloat16 if (case == "bf16" and side == "generator") else None
  return host, [NamedSharding(mesh, spec)] * len(host), dtype


def _raw_uuid(case: int, i: int) -> int:
  return 1000 * (case + 1) + i


def trainer_main(directory: str, size: int, versions: int, host: str = "127.0.0.1"
                 ) -> None:
  """The trainer program: publishes every case `versions` times at `host`, offers the
  `same` case's shards raw `versions` times, reports its publish times, waits for the
  end."""
  import jax
  if jax.devices()[0].platform == "cpu":
    devices = jax.devices()[:DEVICES]
  else:
    devices = jax.devices()[:1]
  import jax_m2n
  from jax_m2n._src.jobs import transports
  pub = jax_m2n.Publisher(f"{host}:0", token=TOKEN, keep=versions * len(CASES))
  server = transports.acquire(host)
  publish_ms = {}
  for c, case in enumerate(CASES):
    host, shardings, _ = _tree(jax, case, size, devices, c, "trainer")
    tree = [jax.device_put(h, s) for h, s in zip(host, shardings)]
    jax.block_until_ready(tree)
    times = []
    for _ in range(versions):
      t0 = time.perf_counter()
      pub.publish(tree)
      times.append((time.perf_counter() - t0) * 1e3)
    publish_ms[case] = times
    # The raw baseline: the same wire bytes as they lie (every shard, in the wire dtype),
    # offered under uuids the generator knows.
    raw = [s.data for leaf in tree for s in leaf.addressable_shards]
    if case == "bf16":
      raw = [a.astype(jax.numpy.bfloat16) for a in raw]
    for i in range(versions):
      server.offer(raw, 3600.0, ticket=_raw_uuid(c, i))
  # publish returns before its snapshot copies have run: let them finish, so that the
  # pulls are not timed against the trainer's own copying on the same cores.
  jax.block_until_ready([a for n in pub._versions.numbers()  # noqa: SLF001
                         for _, a in pub._versions.get(n).shards.values()])
  info = {"address": pub.address, "transfer": server.address, "publish_ms": publish_ms}
  with open(os.path.join(directory, "info.tmp"), "w") as f:
    json.dump(info, f)
  os.replace(os.path.join(directory, "info.tmp"), os.path.join(directory, "info.json"))
  deadline = time.monotonic() + 1800
  while not os.path.exists(os.path.join(directory, "done")) and time.monotonic() < deadline:
    time.sleep(0.05)
  pub.close()


def _as_trainer(jax, sharding, case: str):
  """The trainer's layout of a case, on the generator's devices (the raw pull's shard
  shapes)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  return NamedSharding(sharding.mesh, P("x") if case == "same" else P("x", None))


def _wait_json(path: str, procs, timeout_s: float, what: str) -> dict:
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    dead = [p.poll() for p in procs if p.poll() is not None]
    if dead or time.monotonic() > deadline:
      raise RuntimeError(f"jobs bench: {what} exited or hung (rc={dead or 'running'})")
    time.sleep(0.1)
  with open(path) as f:
    return json.load(f)


def _pulls(jax, info: dict, size: int, iters: int, warmup: int, devices,
           print_fn: Callable[[str], object]) -> list[dict]:
  """The generator's side: every case pulled `warmup + iters` times through a
  Subscriber and raw through the transfer server; one row per case."""
  import numpy as np
  import jax_m2n
  from jax_m2n._src.jobs import connections, planning, transports
  versions = warmup + iters
  sub = jax_m2n.Subscriber(info["address"], token=TOKEN)
  rows = []
  for c, case in enumerate(CASES):
    host, shardings, dtype = _tree(jax, case, size, devices, c, "generator")
    first = c * versions + 1
    times = []
    for i in range(versions):
      t0 = time.perf_counter()
      out = sub.pull(shardings, dtype=dtype, version=first + i)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - t0) * 1e3)
      if i == 0:  # validated bitwise once
        for h, y in zip(host, out):
          want = h if dtype is None else h.astype(dtype)
          if not np.array_equal(np.asarray(y).view(np.uint8), want.view(np.uint8)):
            raise AssertionError(f"jobs bench: {case} pulled wrong bytes")
      del out
    m = sub._state.manifests[next(reversed(sub._state.manifests))]  # noqa: SLF001
    pp = planning.plan_pull(m, tuple(shardings), tuple(
        np.dtype(dtype or np.float32) for _ in shardings), "hierarchical")
    wire = planning.network_bytes(pp)["from_publisher"]
    row = {"case": case, "payload_bytes": sum(h.nbytes for h in host),
           "wire_bytes": wire, "pull_ms": statistics.median(times[warmup:]),
           "pull_ms_min": min(times[warmup:]), "first_pull_ms": times[0],
           "publish_ms": statistics.median(info["publish_ms"][case])}
    thost = info["transfer"].rsplit(":", 1)[0]
    raw_transport = transports.acquire(connections.local_host_towards(thost))
    raw = []
    specs = [jax.ShapeDtypeStruct(s.data.shape, dtype or np.float32,
                                  sharding=jax.sharding.SingleDeviceSharding(d))
             for h, sh in zip(host, shardings)
             for s, d in zip(jax.device_put(h, _as_trainer(jax, sh, case))
                             .addressable_shards, devices)]
    for i in range(versions):
      t0 = time.perf_counter()
      raw_transport.fetch(info["transfer"], _raw_uuid(c, i), specs).result()
      raw.append((time.perf_counter() - t0) * 1e3)
    row["raw_ms"] = statistics.median(raw[warmup:])
    row["ratio"] = row["pull_ms"] / row["raw_ms"]
    rows.append(row)
    print_fn(f"  jobs/{case}: pull {row['pull_ms']:.1f} ms, raw {row['raw_ms']:.1f} ms")
  sub.close()
  return rows


def generator_main(directory: str, size: int, iters: int, warmup: int) -> None:
  """The generator program on an emulated host: waits for the trainer's info, pulls
  (`_pulls`), writes its rows to DIRECTORY/rows.json."""
  import jax
  info = _wait_json(os.path.join(directory, "info.json"), [], 600, "the trainer")
  rows = _pulls(jax, info, size, iters, warmup, jax.devices()[:DEVICES],
                lambda text: print(text, flush=True))
  with open(os.path.join(directory, "rows.tmp"), "w") as f:
    json.dump(rows, f)
  os.replace(os.path.join(directory, "rows.tmp"), os.path.join(directory, "rows.json"))


def _program(fn: str, *args) -> list[str]:
  """The argv that runs `jobs.<fn>(*args)` in a program of its own (arguments made of
  digits pass as ints, the others as strings)."""
  code = ("import sys; from jax_m2n.bench import jobs; "
          f"jobs.{fn}(*[int(a) if a.isdigit() else a for a in sys.argv[1:]])")
  return [sys.executable, "-c", code, *map(str, args)]


def run(jax, size: int, iters: int, warmup: int,
        print_fn: Callable[[str], object] = print, link_rate: str | None = None) -> dict:
  """The suite on 127.0.0.1 (the generator is this process, the trainer a program of
  its own) or, with `link_rate`, across two emulated hosts (jax_m2n.testing.hosts: the
  trainer on host 0, the generator on host 1, each link shaped to `link_rate`)."""
  versions = warmup + iters
  directory = tempfile.mkdtemp(prefix="m2n_jobs_bench_")
  env = dict(os.environ)
  if jax.devices()[0].platform == "cpu" or link_rate:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
  else:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
  done = os.path.join(directory, "done")
  if link_rate:
    from jax_m2n.testing.hosts import EmulatedHosts
    with EmulatedHosts(2, rate=link_rate) as hosts:
      trainer = hosts.popen(0, _program("trainer_main", directory, size, versions,
                                        hosts.address(0)), env=env)
      generator = hosts.popen(1, _program("generator_main", directory, size, iters,
                                          warmup), env=env)
      try:
        rows = _wait_json(os.path.join(directory, "rows.json"), [trainer, generator],
                          1800, "the generator program")
      finally:
        open(done, "w").close()
        for p in (generator, trainer):
          try:
            p.wait(timeout=60)
          except subprocess.TimeoutExpired:
            p.kill()
    return {"schema": 1, "suite": "jobs", "iters": iters, "warmup": warmup,
            "platform": "cpu", "links": f"2 emulated hosts, {link_rate} each way",
            "rows": rows}
  trainer = subprocess.Popen(_program("trainer_main", directory, size, versions,
                                      "127.0.0.1"), env=env)
  try:
    info = _wait_json(os.path.join(directory, "info.json"), [trainer], 600,
                      "the trainer program")
    devices = (jax.devices()[DEVICES:2 * DEVICES] if jax.devices()[0].platform == "cpu"
               else jax.devices()[:1])
    rows = _pulls(jax, info, size, iters, warmup, devices, print_fn)
  finally:
    open(done, "w").close()
    try:
      trainer.wait(timeout=60)
    except subprocess.TimeoutExpired:
      trainer.kill()
  return {"schema": 1, "suite": "jobs", "iters": iters, "warmup": warmup,
          "platform": jax.devices()[0].platform, "links": "127.0.0.1", "rows": rows}


def markdown(doc: dict) -> str:
  lines = ["| case | payload MiB | wire MiB | pull ms (median) | raw transfer ms | "
           "pull / raw | first pull ms | publish ms |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in doc["rows"]:
    raw = f"{r['raw_ms']:.1f}" if "raw_ms" in r else "-"
    ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
    lines.append(f"| {r['case']} | {r['payload_bytes'] / MIB:.1f} | "
                 f"{r['wire_bytes'] / MIB:.1f} | {r['pull_ms']:.1f} | {raw} | {ratio} | "
                 f"{r['first_pull_ms']:.1f} | {r['publish_ms']:.1f} |")
  lines.append("")
  lines.append("- same: float32 P(x) on the trainer's devices -> P(x) on the generator's "
               "; raw: the transfer server pulls the trainer's shards in the wire dtype, "
               "the same bytes, uuids agreed in advance (no control plane, planning or "
               "slicing); bf16: float32 P(x, None) -> bfloat16 P(None, x); pytree64: 64 "
               "leaves P(x, None) -> P(None, x). Separate programs; links: "
               f"{doc.get('links', '127.0.0.1')}.")
  return "\n".join(lines) + "\n"


def main(jax, out_dir: str, size_mib: float | None, iters: int, warmup: int,
         print_fn: Callable[[str], object] = print, link_rate: str | None = None) -> int:
  """The suite on 127.0.0.1, then (where emulated hosts can be made: root and
  iproute2) across two hosts on `link_rate` links; one report each (`jobs`,
  `jobs_network`)."""
  size = int((size_mib or DEFAULT_SIZE_MIB) * MIB)
  doc = run(jax, size, iters, max(1, warmup), print_fn)
  report.write_suite(doc, markdown(doc), out_dir, "jobs", print_fn)
  if link_rate:
    from jax_m2n.testing.hosts import EmulatedHosts
    why = EmulatedHosts.unavailable()
    if why is not None:
      print_fn(f"jobs over emulated hosts: skipped ({why})")
    else:
      doc = run(jax, size, iters, max(1, warmup), print_fn, link_rate)
      report.write_suite(doc, markdown(doc), out_dir, "jobs_network", print_fn)
  # Relays among subscriber jobs (issue 34; bench/relay.py): its own programs, on
  # emulated hosts where they can be made (else 127.0.0.1, said in its table); 3
  # timed versions per mode (K = 8 pulls directly in about 5 s a version at 1 Gbit/s).
  from jax_m2n.bench import relay
  return relay.main(out_dir, size_mib, max(1, min(iters, 3)), 1,
                    rate=link_rate or "1gbit", print_fn=print_fn)
