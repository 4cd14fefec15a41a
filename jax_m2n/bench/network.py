"""The network suite (`python -m jax_m2n.bench --suite network`): jax_m2n across CPU
processes where each process is its own host behind a NIC-limited link.

Owns making the hosts (jax_m2n.testing.hosts.EmulatedHosts: one network namespace per
process, every link shaped to --link_rate in each direction, 1 Gbit/s by default) and
running bench/multiprocess_cpu's parts over them with no address configured anywhere:
the engine part (reshard / raw transfer at 16 MiB and --size_mib) and Figure 4 at
r_d = 2, 3, 4 (--size_mib, 64 MiB by default), estimates priced at the link rate,
key-value operations per call. Where hosts cannot be made (not
root, no iproute2: e.g. the GPU machine) it says why and runs nothing; the loopback
figures are `--suite multiprocess` on a machine without 2 GPUs.
  python -m jax_m2n.bench --suite network [--link_rate 1gbit] [--size_mib 64]
"""

from __future__ import annotations

import json
import os

from jax_m2n.bench import multiprocess_cpu

R_DS = (2, 3, 4)


def run_suite(out_dir: str, size_mib: float = 64, iters: int = 5, warmup: int = 2,
              rate: str = "1gbit", echo=print) -> int:
  """Runs the parts over emulated hosts; writes OUT_DIR/network.{json,md}; 0, or 1 on a
  failure (0 with a line saying why where hosts cannot be made)."""
  from jax_m2n.testing import hosts as hosts_lib
  reason = hosts_lib.EmulatedHosts.unavailable()
  if reason is not None:
    echo(f"network suite: not run: {reason}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "network.json"), "w") as f:
      json.dump({"schema": multiprocess_cpu.SCHEMA, "skipped": reason}, f)
    return 0
  gbps = hosts_lib._bits_per_s(rate) / 8e9  # pylint: disable=protected-access
  with hosts_lib.EmulatedHosts(1 + max(R_DS), rate=rate) as hosts:
    echo(f"network suite: {hosts.n} emulated hosts, links {rate} each way "
         f"({gbps:.4g} GB/s)")
    return multiprocess_cpu.run_suite(out_dir, size_mib, iters, warmup, echo=echo,
                                      hosts=hosts, link_gbps=gbps, r_ds=R_DS,
                                      name="network", title="network",
                                      fig4_mib=size_mib)
