"""jax_m2n's benchmark harness (`python -m jax_m2n.bench`; usage in __main__.py).

Modules: suites (cases and the planner suite), engines (what is compared), timing (the
measurement loop), runner (orchestration and environment), torch_engine (torch.distributed,
out of process), data (deterministic data, bitwise checks), report (JSON, markdown,
terminal), plots (PNG). Not part of the public API.
"""
