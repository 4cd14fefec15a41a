"""Two CPU processes under jax.distributed: reshard refuses the other process's devices
with a clear error before any data moves, and still works within each process."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]), initialization_timeout=60)
    import jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    everyone = Mesh(np.array(jax.devices()), ("x",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(everyone, P("x")), np.arange(2, dtype=np.float32) + 2 * jax.process_index())
    try:
      jax_m2n.reshard(x, NamedSharding(everyone, P()), timeout_s=5)
      print("NO ERROR")
    except jax_m2n.ReshardValueError as e:
      print("REFUSED:", e)
    mine = Mesh(np.array(jax.local_devices()), ("x",))
    y = jax.device_put(np.arange(4.0), NamedSharding(mine, P("x")))
    z = jax_m2n.reshard(y, NamedSharding(mine, P()))
    print("LOCAL OK:", np.asarray(z).tolist() == [0.0, 1.0, 2.0, 3.0])
    jax.distributed.shutdown()
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_cpu_reshard_across_processes_is_refused_clearly(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("a worker hung")
    outs.append(out)
  for out in outs:
    if "jax_cpu_collectives_implementation" in out and "REFUSED" not in out:
      pytest.skip("this jaxlib has no CPU multi-process support: " + out[-300:])
    assert "REFUSED:" in out, out[-3000:]
    assert "every participating device must belong to this process" in out
    assert "LOCAL OK: True" in out, out[-3000:]
