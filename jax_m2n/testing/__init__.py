"""Test and benchmark utilities of jax_m2n (not part of the reshard API).

`jax_m2n.testing.hosts.EmulatedHosts`: several "hosts" on one Linux machine, each a
network namespace with its own address and a shaped link to a switch, for running a
multi-process job as if it spanned machines (tests/ and `python -m jax_m2n.bench
--suite network` share it). `jax_m2n.testing.wire`: the link process that adds delay
and loss where the kernel has no netem. `jax_m2n.testing.workers`: what worker programs
(and the examples) share: JAX on CPU devices, hand-over files, leaving a job. None is
imported by `import jax_m2n`.
"""
