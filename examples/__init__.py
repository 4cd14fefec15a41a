"""Runnable examples of jax_m2n (importable from the repository root: `examples.rl_refit`)."""
