"""The multi-process suite (`python -m jax_m2n.bench --suite multiprocess`).

Owns the launch of N processes x 1 GPU (N = the GPUs present, at most 4) under
jax.distributed on loopback, spawned by the bench itself, that time jax_m2n eager reshards
across processes (the NCCL engine), and of N torch.distributed ranks that time the same
moves the way RL frameworks do (send/recv; all-gather, then a broadcast where replicas
are needed). A second jax_m2n launch runs with NCCL forced onto its socket transport
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket over `lo`), each process its own
domain: the multi-node code path on one host, with the planner's estimate at the socket
bandwidth measured by the copy case. Reports per case jax_m2n / best other engine.

Latency = the maximum over processes of each one's mean (and min) over --iters timed calls
after --warmup, every call started behind a barrier; every output is checked bitwise
against numpy before timing. Usage by hand (the bench starts the workers):
  python -m jax_m2n.bench.multiprocess --out_dir DIR [--size_mib 1024] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

MIB = 1 << 20
_BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
             "PYTHONUNBUFFERED": "1"}
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
              "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def _cases(n: int, size: int) -> list[dict]:
  """(name, title, shape, src spec over which processes, dst ...) for N processes."""
  cols = 16384
  rows = max(8, size // (2 * cols) // 8 * 8)
  return [
      {"name": "1to1_copy", "title": "GPU 0 -> GPU 1 (two processes)", "shape": [rows, cols],
       "src": ([0], [None, None]), "dst": ([1], [None, None]), "bound_bytes": rows * cols * 2},
      {"name": f"{n}dev_dim0_to_dim1", "title": f"{n} procs P(x,None) -> P(None,x)",
       "shape": [rows, cols], "src": (list(range(n)), ["x", None]),
       "dst": (list(range(n)), [None, "x"]),
       "bound_bytes": rows * cols * 2 * (n - 1) // (n * n)},
      {"name": f"{n}dev_dim0_to_replicated", "title": f"{n} procs P(x,None) -> P()",
       "shape": [rows, cols], "src": (list(range(n)), ["x", None]),
       "dst": (list(range(n)), [None, None]),
       "bound_bytes": rows * cols * 2 * (n - 1) // n},
  ]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _gpu_count() -> int:
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                         timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _launch(mode: str, n: int, args, extra_env: dict, timeout_s: float) -> list[dict]:
  """Starts n workers of `mode`; returns their MPRESULT dicts (an error dict on failure).

  A free port can be taken between picking it and the coordinator binding it (JAX's
  coordinator binds the wildcard address, the pick only 127.0.0.1): a launch that fails
  with "Address already in use" is retried on a fresh port, twice at most.
  """
  for _ in range(2):
    out = _launch_once(mode, n, args, extra_env, timeout_s)
    if not ("error" in out[0] and "Address already in use" in out[0]["error"]):
      return out
  return _launch_once(mode, n, args, extra_env, timeout_s)


def _launch_once(mode: str, n: int, args, extra_env: dict, timeout_s: float) -> list[dict]:
  port = _free_port()
  env = dict(os.environ)
  for k, v in _BASE_ENV.items():
    env.setdefault(k, v)
  env.update(extra_env)
  env.pop("JAX_PLATFORMS", None)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  logs = [os.path.join(args.out_dir, f"multiprocess_{mode}_{i}.log") for i in range(n)]
  files = [open(p, "w") for p in logs]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jax_m2n.bench.multiprocess", "--worker", mode, "--pid", str(i),
       "--n", str(n), "--port", str(port), "--size_mib", str(args.size_mib),
       "--iters", str(args.iters), "--warmup", str(args.warmup), "--out_dir", args.out_dir],
      stdout=f, stderr=subprocess.STDOUT, env=env) for i, f in enumerate(files)]
  deadline = time.monotonic() + timeout_s
  error = None
  while error is None and any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
      error = "a worker failed"
    elif time.monotonic() > deadline:
      error = f"timed out after {timeout_s} s"
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  for f in files:
    f.close()
  out = []
  for i, path in enumerate(logs):
    text = open(path).read()
    line = next((ln for ln in text.splitlines() if ln.startswith("MPRESULT ")), None)
    if line is None:
      return [{"error": f"{mode} worker {i}: {error or 'no result'}: {text[-1500:]}"}]
    out.append(json.loads(line[len("MPRESULT "):]))
  return out


def _merge(results: list[dict]) -> dict:
  """Per case: max over processes of the mean and of the min (ms), and validity."""
  if len(results) == 1 and "error" in results[0]:
    return {"error": results[0]["error"]}
  merged = {}
  for r in results:
    for name, c in r["cases"].items():
      m = merged.setdefault(name, {"mean_ms": 0.0, "min_ms": 0.0, "ok": True, "extra": {}})
      m["mean_ms"] = max(m["mean_ms"], c["mean_ms"])
      m["min_ms"] = max(m["min_ms"], c["min_ms"])
      m["ok"] = m["ok"] and c["ok"]
      m["extra"].update(c.get("extra", {}))
  return merged


# --- workers ------------------------------------------------------------------------------

def _timed(fn, barrier, iters, warmup):
  for _ in range(warmup):
    barrier()
    fn()
  ts = []
  for _ in range(iters):
    barrier()
    t0 = time.perf_counter()
    fn()
    ts.append((time.perf_counter() - t0) * 1e3)
  return {"mean_ms": sum(ts) / len(ts), "min_ms": min(ts)}


def _jax_worker(a, socket_mode: bool) -> dict:
  import jax
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=a.n,
                             process_id=a.pid, local_device_ids=[a.pid],
                             initialization_timeout=120)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_m2n
  from jax_m2n._src import jax_compat
  from jax_m2n.bench import data as bench_data
  client = jax_compat.distributed_client()
  devs = jax.devices()
  count = [0]

  def barrier():
    count[0] += 1
    client.wait_at_barrier(f"jax_m2n_mp_{count[0]}", 120_000)

  topo = jax_m2n.Topology(domain_size=1) if socket_mode else None
  out = {}
  cases = _cases(a.n, int(a.size_mib * MIB))
  copy_gbps = None
  for c in cases:
    shape = tuple(c["shape"])
    host = bench_data.make_array(shape, "bfloat16", bench_data.seed_of("mp", c["name"]))
    src = NamedSharding(Mesh(np.array([devs[i] for i in c["src"][0]]), ("x",)),
                        P(*c["src"][1]))
    dst = NamedSharding(Mesh(np.array([devs[i] for i in c["dst"][0]]), ("x",)),
                        P(*c["dst"][1]))
    x = jax.make_array_from_callback(shape, src, lambda idx: host[idx], dtype=host.dtype)

    def run():
      return jax.block_until_ready(jax_m2n.reshard(x, dst, topology=topo))

    y = run()
    ok = all(bench_data.same_bits(np.asarray(s.data), host[s.index])
             for s in y.addressable_shards)
    del y
    r = _timed(run, barrier, a.iters, a.warmup)
    r["ok"] = bool(ok)
    if socket_mode:
      if c["name"] == "1to1_copy":
        copy_gbps = c["bound_bytes"] / (r["min_ms"] * 1e-3) / 1e9
      bw = jax_m2n.Topology(domain_size=1, nic_gbps=copy_gbps)
      est = jax_m2n.plan(x, dst, topology=bw).route_estimate_ms()
      r["extra"] = {"socket_gbps": round(copy_gbps, 3), "estimate_ms": round(est, 3)}
    out[c["name"]] = r
  return {"cases": out}


def _torch_worker(a) -> dict:
  import torch
  import torch.distributed as dist
  torch.cuda.set_device(a.pid)
  dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.pid,
                          world_size=a.n, device_id=torch.device("cuda", a.pid))
  dev = torch.device("cuda", a.pid)
  out = {}
  for c in _cases(a.n, int(a.size_mib * MIB)):
    rows, cols = c["shape"]
    g = torch.Generator(device="cpu").manual_seed(1234)
    # bf16 bit patterns (NCCL has no int16); compared as int16 (NaN != NaN in bf16).
    full = torch.randint(-(1 << 15), 1 << 15, (rows, cols), dtype=torch.int16,
                         generator=g).to(dev).view(torch.bfloat16)
    eq = lambda u, v: torch.equal(u.view(torch.int16), v.view(torch.int16))  # noqa: E731
    if c["name"] == "1to1_copy":
      buf = full.clone() if a.pid == 0 else torch.empty_like(full)

      def run():
        if a.pid == 0:
          dist.send(buf, 1)
        elif a.pid == 1:
          dist.recv(buf, 0)
        torch.cuda.synchronize()
      engine = "torch send/recv"
      check = lambda: a.pid != 1 or eq(buf, full)  # noqa: E731
    elif c["name"].endswith("dim0_to_dim1"):
      # all_to_all of contiguous pieces plus the local transposition into columns.
      part = full.chunk(a.n, 0)[a.pid].contiguous()
      send = torch.cat([p.contiguous() for p in part.chunk(a.n, 1)])
      recv = torch.empty_like(send)
      res = torch.empty(rows, cols // a.n, dtype=full.dtype, device=dev)

      def run():
        dist.all_to_all_single(recv, send)
        res.copy_(recv.view(rows, cols // a.n))
        torch.cuda.synchronize()
      engine = "torch all_to_all + copy"
      check = lambda: eq(res, full.chunk(a.n, 1)[a.pid])  # noqa: E731
    else:
      part = full.chunk(a.n, 0)[a.pid].contiguous()
      res = torch.empty_like(full)

      def run():
        dist.all_gather_into_tensor(res, part)
        torch.cuda.synchronize()
      engine = "torch all_gather"
      check = lambda: eq(res, full)  # noqa: E731

    def barrier():
      dist.barrier()
      torch.cuda.synchronize()

    run()
    ok = bool(check())
    r = _timed(run, barrier, a.iters, a.warmup)
    r["ok"] = ok
    r["extra"] = {"engine": engine}
    out[c["name"]] = r
  dist.destroy_process_group()
  return {"cases": out}


def _worker_main(a) -> int:
  try:
    if a.worker == "torch":
      result = _torch_worker(a)
    else:
      result = _jax_worker(a, socket_mode=a.worker == "jax_socket")
  except BaseException:  # noqa: BLE001 - peers must not wait: exit at once
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
  print("MPRESULT " + json.dumps(result), flush=True)
  os._exit(0)


# --- the suite ------------------------------------------------------------------------------

def run_suite(out_dir: str, size_mib: float = 1024, iters: int = 10, warmup: int = 3,
              timeout_s: float = 240, echo=print) -> int:
  """Runs the suite; writes OUT_DIR/multiprocess.{json,md}; returns 0, or 1 on a failure."""
  n = min(4, _gpu_count())
  if n < 2:  # no 2 GPUs: the same control plane across CPU processes (transfer server)
    from jax_m2n.bench import multiprocess_cpu
    return multiprocess_cpu.run_suite(out_dir, 64 if size_mib >= 1024 else size_mib,
                                      min(iters, 5), min(warmup, 2), echo=echo)
  a = argparse.Namespace(out_dir=out_dir, size_mib=size_mib, iters=iters, warmup=warmup)
  os.makedirs(out_dir, exist_ok=True)
  runs = {}
  for mode, env in (("torch", {}), ("jax", {}), ("jax_socket", SOCKET_ENV)):
    echo(f"multiprocess suite: {n} x {mode} ...")
    t0 = time.perf_counter()
    runs[mode] = _merge(_launch(mode, n, a, env, timeout_s))
    echo(f"multiprocess suite: {mode} done in {time.perf_counter() - t0:.1f} s"
         + (f" ({runs[mode]['error'][:2000]})" if "error" in runs[mode] else ""))
  rows, ok = [], all("error" not in r for r in runs.values())
  lines = [f"| case | jax_m2n mean / min ms | best other | ratio | NCCL socket, each process "
           f"a domain: mean ms, estimate ms |", "| --- | --- | --- | --- | --- |"]
  for c in _cases(n, int(size_mib * MIB)):
    j = runs["jax"].get(c["name"], {})
    t = runs["torch"].get(c["name"], {})
    s = runs["jax_socket"].get(c["name"], {})
    ok = ok and j.get("ok", False) and t.get("ok", True) and s.get("ok", False)
    ratio = j["mean_ms"] / t["mean_ms"] if j and t else float("nan")
    est = s.get("extra", {}).get("estimate_ms")
    row = {"case": c["name"], "title": c["title"], "jax_m2n": j, "torch": t, "socket": s,
           "ratio_to_best_other": ratio}
    rows.append(row)
    lines.append(
        f"| {c['title']} | {j.get('mean_ms', float('nan')):.3f} / "
        f"{j.get('min_ms', float('nan')):.3f} | {t.get('extra', {}).get('engine', '-')} "
        f"{t.get('mean_ms', float('nan')):.3f} | {ratio:.3f} | "
        f"{s.get('mean_ms', float('nan')):.1f}, {est if est is not None else '-'} |")
  table = "\n".join(lines)
  echo(table)
  with open(os.path.join(out_dir, "multiprocess.json"), "w") as f:
    json.dump({"processes": n, "size_mib": size_mib, "iters": iters, "warmup": warmup,
               "rows": rows, "errors": {k: v["error"] for k, v in runs.items()
                                        if "error" in v}}, f, indent=1)
  with open(os.path.join(out_dir, "multiprocess.md"), "w") as f:
    f.write(table + "\n")
  return 0 if ok else 1


def main(argv=None) -> int:
  from jax_m2n.bench import timing  # the workers import jax (or torch) themselves
  p = argparse.ArgumentParser()
  p.add_argument("--worker", choices=("jax", "jax_socket", "torch"))
  p.add_argument("--pid", type=int, default=0)
  p.add_argument("--n", type=int, default=2)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--size_mib", type=float, default=1024)
  timing.add_loop_flags(p, iters=10, warmup=3)
  p.add_argument("--out_dir", default="bench_out")
  a = p.parse_args(argv)
  if a.worker:
    return _worker_main(a)
  return run_suite(a.out_dir, a.size_mib, a.iters, a.warmup)


if __name__ == "__main__":
  sys.exit(main())
