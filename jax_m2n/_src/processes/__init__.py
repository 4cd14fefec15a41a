"""The multi-controller control plane: reshards whose devices span processes.

Every process of a `jax.distributed` job calls `jax_m2n.reshard` with the same
arguments; each derives the same plan and runs its own devices' part. Owns the
bootstrap (`bootstrap`: the key-value store, the CPU engine's servers, liveness), the
call sequence and plan fingerprints (`sequence`) and the CPU engine, JAX's transfer
server (`transfer_engine`); NCCL stays the CUDA engine (xla_ffi/cuda). It never
decides what moves (the planner does) and holds no argument rules (checks.py).
"""
