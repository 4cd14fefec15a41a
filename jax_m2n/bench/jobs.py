"""The `jobs` suite: `Publisher.publish` + `Subscriber.pull` between two separate
programs, every data path side by side in one run, against one copy of the same bytes
in one process and the transports' raw fetches of them.

Owns the generator's side and the tables. A trainer program (jobs_trainer.py: 4 CPU
devices, or the first GPU) publishes on command; this process (4 of its 8 CPU devices,
or the GPU) pulls, so that every pull waits for nothing but itself:
- throughput (issue 42): per size (64 and 256 MiB on CPU; 256 and 1024 on GPU) and
  wire dtype (float32, bfloat16), float32 [rows, 1024] P(x) -> P(x): the local path
  (path="auto", which takes it on one host), the network path over each transport
  ("net", "net+curve": Publisher(encrypt=True), "transfer_server"), the raw fetch of
  the trainer's shards (in the wire dtype, tickets handed over: no control plane, no
  plan) over "transfer_server" and "net", and one copy in this process (numpy into
  fresh memory and into warm memory on CPU; an XLA copy, `device_put(may_alias=False)`,
  everywhere);
- latency (issue 43): 4 KiB (4 devices and 1 each side), the Ray example's policy (its
  tree and layouts, pulled as bfloat16), 64 leaves x 64 KiB and 1 leaf x 4 MiB, local
  and network, >= 20 timed pulls;
- security (issue 44, bench/jobs_security.py);
- across two emulated hosts (root and iproute2: jax_m2n.testing.hosts, `--link_rate`
  links), the network rows at one size and the 4 KiB pull beside a zmq round trip on
  the same link; then the relay table (bench/relay.py, issue 34).
Every row: a fresh version published before each pull (publish timed by the trainer:
the call, and until its snapshot is complete), the first pull (manifest, plan,
compile, mapped exports) apart, then warm-up and timed pulls (min, median); the data
path each pull took and its phases (`Subscriber.last_pull`); the control messages each
timed pull sent (jax_m2n._src.jobs.channel.stats); the first and last pulls checked
bitwise.

Usage:
  python -m jax_m2n.bench --suite jobs [--size_mib 256] [--iters 10] [--link_rate 1gbit]
  python -m jax_m2n.bench.jobs [--parts throughput,latency,security,hosts,relay]
      [--sizes_mib 64,256] [--iters 10] [--warmup 3] [--link_rate 1gbit] [--out_dir DIR]
Writes OUT_DIR/jobs.json ("schema": 2) and jobs.md (jobs_network.* across hosts).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from jax_m2n.bench import jobs_trainer, jobs_trees, report, runner, timing

MIB = 1 << 20
PARTS = ("throughput", "latency", "security", "hosts", "torch", "relay")
LATENCY_TREES = ("4KiB", "4KiB_1dev", jobs_trees.POLICY, "64x64KiB", "1x4MiB")
LATENCY_ITERS = 20
# The throughput rows of one (size, dtype): (what, publisher spec, path asked).
PULLS = (("auto", "net", "auto"), ("network", "net", "network"),
         ("network", "net+curve", "network"), ("network", "transfer_server", "network"))
RAW = ("transfer_server", "net")
PULL_TIMEOUT_S = 300.0


def _bfloat16():
  import ml_dtypes
  return ml_dtypes.bfloat16


def _loadavg() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def _ms_stats(times: list[float]) -> dict[str, float]:
  return {"min_ms": min(times), "median_ms": statistics.median(times)}


class Generator:
  """This process's side: its devices, the trainer's command channel, a Subscriber per
  publisher spec (made per case: `connect`)."""

  def __init__(self, jax: Any, channel: jobs_trainer.Channel, devices: list[Any],
               print_fn: Callable[[str], object]):
    self.jax, self.channel, self.devices, self.print = jax, channel, devices, print_fn
    self.subs: dict[str, Any] = {}
    self.publishers: dict[str, Any] = {}

  def connect(self, specs=jobs_trainer.SPECS) -> None:
    """Fresh publishers on the trainer and a Subscriber to each of `specs`."""
    import jax_m2n
    self.close()
    self.publishers = self.channel.call("publishers")["publishers"]
    for spec in specs:
      self.subs[spec] = jax_m2n.Subscriber(self.publishers[spec]["address"],
                                           token=jobs_trainer.TOKEN)

  def close(self) -> None:
    for sub in self.subs.values():
      sub.close()
    self.subs = {}

  def tree(self, name: str, seed: int) -> tuple[list[Any], list[Any]]:
    """The case `name` built on the trainer; its (host values, dst shardings) here
    (built here first: a case this checkout cannot build raises here, ImportError for
    the policy without examples/)."""
    got = jobs_trees.build(self.jax, name, self.devices, "generator", seed)
    self.channel.call("tree", name=name, seed=seed)
    return got

  def pulls(self, spec: str, host: list[Any], dst: list[Any], dtype: Any, path: str,
            warmup: int, iters: int) -> dict[str, Any]:
    """1 + warmup + iters pulls of fresh versions through `spec`'s publisher; the
    first and the last checked bitwise against `host` (converted to `dtype`)."""
    import numpy as np
    from jax_m2n._src.jobs import channel as control
    from jax_m2n._src.jobs.records import PHASES  # as Subscriber.last_pull times them
    jax, sub = self.jax, self.subs[spec]
    times, publish, settled, calls, sent, paths, phases = [], [], [], [], [], [], []
    gc.collect()
    gc.disable()
    try:
      for i in range(1 + warmup + iters):
        published = self.channel.call("publish", spec=spec)
        before = dict(control.stats)
        t0 = time.perf_counter()
        out = sub.pull(dst, dtype=dtype, version=published["version"], path=path,
                       timeout_s=PULL_TIMEOUT_S)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3)
        calls.append(control.stats["calls"] - before.get("calls", 0))
        sent.append(control.stats["sent"] - before.get("sent", 0))
        publish.append(published["publish_ms"])
        settled.append(published["settled_ms"])
        record = sub.last_pull
        paths.append(record.path)
        phases.append([1e3 * getattr(record, f"{k}_s") for k in PHASES])
        if i in (0, warmup + iters):  # the first and the last checked
          for t, (h, y) in enumerate(zip(host, out)):
            want = h if dtype is None else h.astype(dtype)
            if not np.array_equal(np.asarray(y).view(np.uint8), want.view(np.uint8)):
              raise AssertionError(f"jobs bench: {spec} {path} pulled wrong bytes "
                                   f"(leaf {t})")
        for a in out:
          a.delete()
        del out
    finally:
      gc.enable()
    timed = slice(1 + warmup, None)
    row = {"kind": "pull", "spec": spec, "path_asked": path,
           "path": sorted(set(paths[timed])), "first_ms": times[0],
           "times_ms": times[timed], **_ms_stats(times[timed]),
           "publish_median_ms": statistics.median(publish[timed]),
           "publish_min_ms": min(publish[timed]),
           "publish_settled_median_ms": statistics.median(settled[timed]),
           "phases_median_ms": dict(zip(PHASES, (statistics.median(col) for col in zip(
               *phases[timed])))),
           "calls_per_pull": statistics.median(calls[timed]),
           "messages_per_pull": statistics.median(sent[timed]),
           "first_calls": calls[0]}
    return row

  def raw(self, kind: str, dtype: Any, warmup: int, iters: int) -> dict[str, Any]:
    """1 + warmup + iters fetches of the trainer's shards as they lie (in the wire
    dtype) over its `kind` transport: the bytes without a control plane or a plan."""
    import numpy as np
    from jax_m2n._src.jobs import connections, transports
    jax = self.jax
    name = None if dtype is None else np.dtype(dtype).name
    offered = self.channel.call("offer_raw", kind=kind, dtype=name,
                                count=1 + warmup + iters)
    host = offered["address"].rsplit(":", 1)[0]
    specs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dt),
                                  sharding=jax.sharding.SingleDeviceSharding(
                                      self.devices[k]))
             for shape, dt, k in offered["arrays"]]
    transport = transports.acquire(connections.local_host_towards(host), kind)
    times = []
    try:
      for ticket in offered["tickets"]:
        t0 = time.perf_counter()
        got = transport.fetch(offered["address"], int(ticket), specs).result()
        jax.block_until_ready(got)
        times.append((time.perf_counter() - t0) * 1e3)
        for a in got:
          a.delete()
    finally:
      transports.release(transport)
    timed = times[1 + warmup:]
    return {"kind": "raw", "spec": kind, "path": ["raw"], "first_ms": times[0],
            "times_ms": timed, **_ms_stats(timed)}


def copies(jax: Any, host: list[Any], dst: list[Any], warmup: int, iters: int
           ) -> list[dict[str, Any]]:
  """One copy of the same bytes in this process: on CPU numpy into fresh memory (numpy
  advises huge pages), into fresh 4 KiB pages (an anonymous mmap: as XLA's CPU buffers
  fault in) and into warm memory; XLA's copy of the generator's array into a new one
  (`device_put(may_alias=False)`, every platform)."""
  import mmap
  import numpy as np
  rows = []
  if jax.devices()[0].platform == "cpu":
    src = np.concatenate([h.reshape(-1) for h in host]).view(np.uint8)
    warm = np.empty_like(src)
    np.copyto(warm, src)
    def into(dst):
      np.copyto(dst, src)
      return dst

    for what, copy in (
        ("memcpy_fresh", lambda: into(np.empty_like(src))),
        ("memcpy_fresh_4k", lambda: into(np.frombuffer(mmap.mmap(-1, src.nbytes),
                                                       np.uint8))),
        ("memcpy_warm", lambda: into(warm))):
      times = []
      for _ in range(warmup + iters):
        t0 = time.perf_counter()
        out = copy()
        times.append((time.perf_counter() - t0) * 1e3)
        del out  # freed outside the clock, as a pull's result
      rows.append({"kind": "copy", "spec": what, "path": ["one process"],
                   "times_ms": times[warmup:], **_ms_stats(times[warmup:])})
  arrays = [jax.device_put(h, s) for h, s in zip(host, dst)]
  jax.block_until_ready(arrays)
  times = []
  for _ in range(warmup + iters):
    t0 = time.perf_counter()
    out = [jax.device_put(a, may_alias=False) for a in arrays]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3)
    for a in out:
      a.delete()
  rows.append({"kind": "copy", "spec": "xla_copy", "path": ["one process"],
               "times_ms": times[warmup:], **_ms_stats(times[warmup:])})
  return rows


# ---------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------

def throughput(g: Generator, sizes: list[int], warmup: int, iters: int,
               specs=jobs_trainer.SPECS, raw=RAW, with_copies: bool = True
               ) -> list[dict[str, Any]]:
  """Per size and wire dtype: every data path, the raw fetches, one copy."""
  rows = []
  for s, size in enumerate(sizes):
    name = jobs_trees.same_layout(size).name
    host, dst = g.tree(name, seed=s)
    nbytes = sum(h.nbytes for h in host)
    base = {"tree": name, "payload_bytes": nbytes, "leaves": len(host)}
    if with_copies:
      for row in copies(g.jax, host, dst, warmup, iters):
        rows.append({**base, "dtype": "float32", **row})
        g.print(f"  jobs/{name} {row['spec']}: {row['median_ms']:.2f} ms")
    for dtype in (None, _bfloat16()):
      dname = "float32" if dtype is None else "bfloat16"
      g.connect(specs)
      try:
        for what, spec, path in PULLS:
          if spec not in specs:
            continue
          row = {**base, "dtype": dname, "what": what,
                 **g.pulls(spec, host, dst, dtype, path, warmup, iters)}
          rows.append(row)
          g.print(f"  jobs/{name} {dname} {what} {spec}: pull {row['median_ms']:.2f} "
                  f"ms (first {row['first_ms']:.0f}), publish "
                  f"{row['publish_median_ms']:.2f} ms, path {row['path']}")
      finally:
        g.close()
      for kind in raw:
        row = {**base, "dtype": dname, "what": "raw", **g.raw(kind, dtype, warmup, iters)}
        rows.append(row)
        g.print(f"  jobs/{name} {dname} raw {kind}: {row['median_ms']:.2f} ms")
  return rows


def latency(g: Generator, warmup: int, iters: int, trees=LATENCY_TREES,
            paths=("auto", "network")) -> list[dict[str, Any]]:
  """The small trees' pulls and publishes, local and network (>= 20 timed each)."""
  rows = []
  iters = max(iters, LATENCY_ITERS)
  for s, name in enumerate(trees):
    try:
      host, dst = g.tree(name, seed=100 + s)
    except ImportError as e:  # an installed package: no examples/ beside it
      g.print(f"  jobs/latency {name}: skipped ({e})")
      continue
    dtype = _bfloat16() if name == jobs_trees.POLICY else None
    g.connect(("net",))
    try:
      for path in paths:
        row = {"tree": name, "payload_bytes": sum(h.nbytes for h in host),
               "leaves": len(host), "dtype": "bfloat16" if dtype else "float32",
               "what": path,
               **g.pulls("net", host, dst, dtype, path, warmup, iters)}
        rows.append(row)
        g.print(f"  jobs/latency {name} {path}: pull {row['min_ms']:.3f} / "
                f"{row['median_ms']:.3f} ms, publish {row['publish_median_ms']:.3f} ms, "
                f"{row['calls_per_pull']:g} calls, path {row['path']}")
    finally:
      g.close()
  return rows


def round_trips(g: Generator, n: int = 200) -> dict[str, Any]:
  """A zmq REQ/REP round trip of 64 bytes to the trainer's echo (the link's latency,
  on the path the control messages take)."""
  import zmq
  address = g.channel.call("echo")["address"]
  ctx = zmq.Context()
  sock = ctx.socket(zmq.REQ)
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.RCVTIMEO, 10_000)
  sock.connect(f"tcp://{address}")
  msg = b"x" * 64
  times = []
  try:
    for _ in range(n + 10):
      t0 = time.perf_counter()
      sock.send(msg)
      sock.recv()
      times.append((time.perf_counter() - t0) * 1e3)
  finally:
    sock.close(0)
    ctx.term()
  return {"kind": "rtt", "what": "zmq round trip (64 B)", "times_ms": times[10:],
          **_ms_stats(times[10:])}


# ---------------------------------------------------------------------------------------
# Programs and orchestration
# ---------------------------------------------------------------------------------------

def _trainer_env(jax: Any, hosts: bool) -> dict[str, str]:
  env = dict(os.environ)
  if jax.devices()[0].platform == "cpu" or hosts:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={jobs_trees.DEVICES}"
  else:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
  return env


def _table(name: str, run: Callable[[], Any]) -> dict[str, Any]:
  """A part's rows with when it ran and the machine's load before and after."""
  import datetime
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  load = _loadavg()
  rows = run()
  return {"part": name, "started_utc": started, "loadavg_start": load,
          "loadavg_end": _loadavg(), "rows": rows}


def run_loopback(jax: Any, parts: list[str], sizes: list[int], iters: int, warmup: int,
                 print_fn: Callable[[str], object]) -> dict[str, Any]:
  """The parts on 127.0.0.1: the trainer a program of its own, this process the
  generator."""
  from jax_m2n.bench import jobs_security
  proc, address = jobs_trainer.start("127.0.0.1", _trainer_env(jax, False))
  channel = None
  devices = (jax.devices()[jobs_trees.DEVICES:2 * jobs_trees.DEVICES]
             if jax.devices()[0].platform == "cpu" else jax.devices()[:1])
  tables = {}
  try:
    channel = jobs_trainer.connect(address)
    g = Generator(jax, channel, devices, print_fn)
    runs = {"throughput": lambda: throughput(g, sizes, warmup, iters),
            "latency": lambda: latency(g, warmup, iters),
            "security": lambda: jobs_security.run(g, warmup, iters)}
    for part in parts:
      if part in runs:
        print_fn(f"jobs: {part} (127.0.0.1)")
        tables[part] = _table(part, runs[part])
  finally:
    jobs_trainer.stop(channel, proc)
  return {"schema": 2, "suite": "jobs", "links": "127.0.0.1", "iters": iters,
          "warmup": warmup, "platform": jax.devices()[0].platform,
          "environment": runner.environment(jax), "tables": tables}


def hosts_main(address: str, out: str, size: int, iters: int, warmup: int) -> None:
  """The generator program on emulated host 1 (the trainer at `address` on host 0):
  the network rows at `size`, the 4 KiB pull and the link's round trip; writes `out`."""
  import jax  # on CPU with 4 devices: the environment run_hosts gives
  channel = jobs_trainer.connect(address)
  g = Generator(jax, channel, jax.devices()[:jobs_trees.DEVICES],
                lambda text: print(text, flush=True))
  try:
    tables = {
        "throughput": _table("throughput", lambda: throughput(
            g, [size], warmup, iters, specs=("net", "net+curve"), with_copies=False)),
        "latency": _table("latency", lambda: latency(g, warmup, iters, trees=("4KiB",),
                                                     paths=("auto",))
                          + [round_trips(g)]),
    }
  finally:
    channel.send({"op": "exit"})
    channel.close()
  with open(out + ".tmp", "w") as f:
    json.dump(tables, f)
  os.replace(out + ".tmp", out)


def run_hosts(jax: Any, size: int, iters: int, warmup: int, link_rate: str,
              print_fn: Callable[[str], object]) -> dict[str, Any]:
  """The trainer on emulated host 0, the generator on host 1, links of `link_rate`."""
  from jax_m2n.testing.hosts import EmulatedHosts
  env = _trainer_env(jax, True)
  directory = tempfile.mkdtemp(prefix="m2n_jobs_bench_")
  out = os.path.join(directory, "hosts.json")
  print_fn(f"jobs: two emulated hosts, {link_rate} links")
  with EmulatedHosts(2, rate=link_rate) as hosts:
    trainer, address = jobs_trainer.start(hosts.address(0), env,
                                          functools.partial(hosts.popen, 0))
    code = ("import sys; from jax_m2n.bench import jobs; "
            "jobs.hosts_main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))")
    gen = hosts.popen(1, [sys.executable, "-c", code, address, out, str(size),
                          str(iters), str(warmup)], env=env)
    try:
      rc = gen.wait(timeout=3600)
    except subprocess.TimeoutExpired:
      gen.kill()
      rc = "killed after 3600 s"
    jobs_trainer.stop(None, trainer)
  if not os.path.exists(out):
    raise RuntimeError(f"jobs bench: the generator program on host 1 failed (rc={rc})")
  with open(out) as f:
    tables = json.load(f)
  shutil.rmtree(directory, ignore_errors=True)
  return {"schema": 2, "suite": "jobs", "links": f"2 emulated hosts, {link_rate} each way",
          "iters": iters, "warmup": warmup, "platform": "cpu",
          "environment": runner.environment(jax), "tables": tables}


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------

def _size(n: int) -> str:
  return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def _f(v: float | None, digits: int = 3) -> str:
  if v is None:
    return "-"
  return f"{v:.{digits}g}" if v < 100 else f"{v:.0f}"


def _header(doc: dict[str, Any], table: dict[str, Any]) -> str:
  env = doc.get("environment", {})
  return (f"{table['part']}: {table['started_utc']}; commit "
          f"{(env.get('git_commit') or '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}"
          f"; {env.get('cpu_count')} CPUs, {doc['platform']}; load average "
          f"{table['loadavg_start'][0]:.1f} -> {table['loadavg_end'][0]:.1f}; "
          f"{doc['links']}; {doc['warmup']} warm-up, {doc['iters']} timed "
          f"(latency: >= {LATENCY_ITERS})")


def throughput_markdown(rows: list[dict[str, Any]]) -> str:
  lines = ["| tree | wire dtype | what | transport | path | pull min ms | pull median ms "
           "| median / copy | first pull ms | publish median ms | calls / pull |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  # The one copy a pull is held against: numpy's into fresh memory on CPU, XLA's device
  # copy on GPUs (issue 42's references).
  copy = {r["tree"]: r["median_ms"] for r in rows if r.get("spec") == "xla_copy"}
  copy.update({r["tree"]: r["median_ms"] for r in rows
               if r.get("spec") == "memcpy_fresh"})
  for r in rows:
    ref = copy.get(r["tree"])
    lines.append(
        f"| {r['tree']} | {r['dtype']} | {r.get('what', 'copy')} | {r['spec']} | "
        f"{','.join(r['path'])} | {_f(r['min_ms'])} | {_f(r['median_ms'])} | "
        f"{_f(r['median_ms'] / ref) if ref else '-'} | {_f(r.get('first_ms'))} | "
        f"{_f(r.get('publish_median_ms'))} | {_f(r.get('calls_per_pull'))} |")
  return "\n".join(lines) + "\n"


def latency_markdown(rows: list[dict[str, Any]]) -> str:
  lines = ["| tree | leaves | bytes | wire dtype | path (asked) | pull min ms | pull median ms | "
           "first pull ms | publish min ms | publish median ms | calls / messages per "
           "pull | wait / plan / move / compose ms |",
           "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  for r in rows:
    if r["kind"] == "rtt":
      lines.append(f"| {r['what']} | | | | | {_f(r['min_ms'])} | {_f(r['median_ms'])} "
                   "| | | | | |")
      continue
    lines.append(
        f"| {r['tree']} | {r['leaves']} | {_size(r['payload_bytes'])} | {r['dtype']} | "
        f"{','.join(r['path'])} ({r['path_asked']}) | {_f(r['min_ms'])} | {_f(r['median_ms'])} | "
        f"{_f(r['first_ms'])} | {_f(r['publish_min_ms'])} | "
        f"{_f(r['publish_median_ms'])} | {_f(r['calls_per_pull'])} / "
        f"{_f(r['messages_per_pull'])} | "
        f"{' / '.join(_f(v, 2) for v in r.get('phases_median_ms', {}).values())} |")
  return "\n".join(lines) + "\n"


def markdown(doc: dict[str, Any]) -> str:
  from jax_m2n.bench import jobs_security
  out = []
  for part, table in doc["tables"].items():
    out.append(f"**{_header(doc, table)}**\n")
    fmt = {"throughput": throughput_markdown, "latency": latency_markdown,
           "security": jobs_security.markdown}[part]
    out.append(fmt(table["rows"]))
  return "\n".join(out)


def main(jax: Any, out_dir: str, size_mib: float | None, iters: int, warmup: int,
         print_fn: Callable[[str], object] = print, link_rate: str | None = None,
         parts=PARTS, sizes_mib: list[float] | None = None) -> int:
  """The parts on 127.0.0.1 (report `jobs`), across two emulated hosts where they can
  be made (`jobs_network`), then the relay table. Sizes: `sizes_mib`, else
  `size_mib`, else 64 and 256 MiB (256 and 1024 on GPUs)."""
  gpu = jax.devices()[0].platform != "cpu"
  if sizes_mib is None:
    sizes_mib = [size_mib] if size_mib else ([256, 1024] if gpu else [64, 256])
  sizes = [int(s * MIB) for s in sizes_mib]
  warmup = max(1, warmup)
  loop = [p for p in parts if p in ("throughput", "latency", "security")]
  if loop:
    doc = run_loopback(jax, loop, sizes, iters, warmup, print_fn)
    report.write_suite(doc, markdown(doc), out_dir, "jobs", print_fn)
  if "hosts" in parts and link_rate:
    from jax_m2n.testing.hosts import EmulatedHosts
    why = EmulatedHosts.unavailable()
    if why is not None or gpu:
      print_fn(f"jobs over emulated hosts: skipped ({why or 'a GPU run'})")
    else:
      doc = run_hosts(jax, min(sizes), iters, warmup, link_rate, print_fn)
      report.write_suite(doc, markdown(doc), out_dir, "jobs_network", print_fn)
  if "torch" in parts:  # the torch generator's rows (bench/torch_jobs.py), where torch is
    import importlib.util
    if importlib.util.find_spec("torch") is None:
      print_fn("jobs: torch rows skipped (no torch: requirements/torch.txt)")
    else:
      from jax_m2n.bench import torch_jobs
      doc = torch_jobs.run(size_mib=256, warmup=warmup, iters=iters,
                           print_fn=print_fn)
      report.write_suite(doc, torch_jobs.markdown(doc), out_dir, "jobs_torch", print_fn)
  if "relay" in parts:
    # Relays among subscriber jobs (issue 34; bench/relay.py): its own programs, on
    # emulated hosts where they can be made (else 127.0.0.1, said in its table); 3
    # timed versions per mode (K = 8 pulls directly in about 5 s a version at 1 Gbit/s).
    from jax_m2n.bench import relay
    return relay.main(out_dir, size_mib, max(1, min(iters, 3)), 1,
                      rate=link_rate or "1gbit", print_fn=print_fn)
  return 0


def _cli() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default=",".join(PARTS))
  parser.add_argument("--sizes_mib", default="")
  timing.add_loop_flags(parser, iters=10, warmup=3)
  parser.add_argument("--link_rate", default="1gbit")
  parser.add_argument("--out_dir", default="bench_out")
  args = parser.parse_args()
  parts = args.parts.split(",")
  if set(parts) - set(PARTS) or args.iters < 1 or args.warmup < 0:
    parser.error(f"--parts must be a comma list from {','.join(PARTS)}; --iters >= 1, "
                 "--warmup >= 0.")
  from jax_m2n.testing import workers
  workers.default_to_cpu_devices()
  import jax
  sizes = [float(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else None
  return main(jax, args.out_dir, None, args.iters, args.warmup, link_rate=args.link_rate,
              parts=parts, sizes_mib=sizes)


if __name__ == "__main__":
  sys.exit(_cli())
