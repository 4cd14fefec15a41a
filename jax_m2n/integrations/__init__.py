"""Adapters that make other JAX libraries move their arrays through `jax_m2n.reshard`.

One module per library (`jax_m2n.integrations.tunix`); each imports its library only
when it is used, so `import jax_m2n` (and `import jax_m2n.integrations`) never imports
any of them.
"""
