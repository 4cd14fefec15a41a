"""What the worker programs of jax_m2n's tests and benchmarks (and its examples) share.

Owns starting JAX on CPU devices in a worker (as one process of a `jax.distributed` job
where there are several) or in an example run without a GPU, handing small files
between programs (written atomically, waited for a bounded time), and leaving a job
with process 0 last. Knows nothing of reshards or jobs' protocols; never imported by
`import jax_m2n`.

Usage (a worker started by a test with --devices/--num-processes/--process-id/--port):
  from jax_m2n.testing import workers
  jax = workers.start_jax(args.devices, args.num_processes, args.process_id,
                          f"127.0.0.1:{args.port}")
  ...
  workers.write_file(os.path.join(args.dir, "ready"))     # another program waits for it
  text = workers.wait_file(os.path.join(args.dir, "go"), timeout_s=60)
  workers.leave_job(args.process_id, args.num_processes, rc)   # does not return
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, NoReturn

# How long process 0 waits for the others' ends before it leaves anyway.
LEAVE_TIMEOUT_S = 30.0
# How long process 0 stays once every end is posted: the replies to the last posts.
LEAVE_GRACE_S = 0.5


def start_jax(devices: int, num_processes: int = 1, process_id: int = 0,
              coordinator: str | None = None) -> Any:
  """JAX on `devices` CPU devices (set before JAX starts); with `num_processes` > 1
  this process joins the `jax.distributed` job whose coordinator is at `coordinator`
  ("host:port"), waiting at most 120 s for the others. Returns the `jax` module."""
  import jax  # noqa: PLC0415 - a worker sets its flags before anything imports jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", devices)
  if num_processes > 1:
    jax.distributed.initialize(coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
  return jax


def default_to_cpu_devices() -> None:
  """An example's devices: without a GPU (no /dev/nvidiactl) and without JAX_PLATFORMS
  set, 8 CPU devices, or $JAX_M2N_CPU_DEVICES. Call before JAX starts its backend; an
  explicit --xla_force_host_platform_device_count in XLA_FLAGS wins."""
  import jax  # noqa: PLC0415 - the flags below, before the backend starts
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["JAX_PLATFORMS"] = "cpu"  # for the example's child processes too
    jax.config.update("jax_platforms", "cpu")  # jax read the variable at its import
  if (os.environ.get("JAX_PLATFORMS") == "cpu"
      and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_M2N_CPU_DEVICES", 8)))


def write_file(path: str, text: str = "") -> None:
  """Writes `path` atomically: a reader never sees it half written."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def wait_file(path: str, timeout_s: float, poll_s: float = 0.02) -> str:
  """The text of `path` once it exists (looked for every `poll_s`); TimeoutError
  after `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"no {path} within {timeout_s:g} s")
    time.sleep(poll_s)
  with open(path) as f:
    return f.read()


def run_worker(fn: Callable[[Any, Any, Any], int], args: Any, coordinator: str,
               tag: str) -> NoReturn:
  """A worker's whole life after its arguments: JAX on `args.devices` CPU devices (in
  the job of `args.num_processes` whose coordinator is `coordinator`), then
  `fn(jax, jax_m2n, args)` -> rc, a "DONE <tag> rc=<rc>" line, and `leave_job`."""
  jax = start_jax(args.devices, args.num_processes, args.process_id, coordinator)
  import jax_m2n  # noqa: PLC0415 - after JAX's flags
  rc = fn(jax, jax_m2n, args)
  print(f"DONE {tag} rc={rc}", flush=True)
  leave_job(args.process_id, args.num_processes, rc)


def leave_job(process_id: int, num_processes: int, rc: int,
              expected: int | None = None) -> NoReturn:
  """Ends this worker with exit status `rc`, skipping Python's teardown (no races
  between the servers of programs that end together).

  In a `jax.distributed` job every process posts its end; process 0 hosts the
  coordination service (its exit ends the job), so it leaves last: it waits up to
  LEAVE_TIMEOUT_S for `expected` ends (default: every process's; fewer where a test
  kills or drops some), then LEAVE_GRACE_S for the last posts' replies.
  """
  if num_processes > 1:
    from jax_m2n._src import jax_compat  # noqa: PLC0415 - only in a distributed job
    kv = jax_compat.distributed_client()
    kv.key_value_set(f"test/end/{process_id}", "1")
    want = num_processes if expected is None else expected
    deadline = time.monotonic() + LEAVE_TIMEOUT_S
    while process_id == 0 and time.monotonic() < deadline:
      if len(kv.key_value_dir_get("test/end/")) >= want:
        # The last post is in the store before its caller has the reply: leaving at
        # once closed the service under that call (the caller's coordination agent
        # then aborted it: rc -6, seen in CI).
        time.sleep(LEAVE_GRACE_S)
        break
      time.sleep(0.05)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(rc)
