"""The multi-controller control plane: reshards whose devices span processes.

Every process of a `jax.distributed` job calls `jax_m2n.reshard` with the same
arguments; each derives the same plan and runs its own devices' part. Owns, bottom up:
the key-value store with every operation bounded and the reachability probe (`store`),
liveness and the verdict on a silent peer (`liveness`), the per-job state: the CPU
engine's server, its address and connections, the beat thread (`bootstrap`), the call
sequence, fingerprints, outcome and waits (`sequence`), the CPU engine, JAX's transfer
server (`transfer_engine`), and one layout's lifecycle (`call`); NCCL stays the CUDA
engine (xla_ffi/cuda). It never decides what moves (the planner does) and holds no
argument rules (checks.py).
"""
