"""The jax_m2n exception family.

Owns the error types every layer raises. Messages follow one rule:
"<api>: <what> must <rule>; got <value>." plus a hint. Nothing here moves data.
"""


class ReshardError(Exception):
  """Base class of every error jax_m2n raises on purpose."""


class ReshardValueError(ReshardError, ValueError):
  """An argument has the right type but breaks a rule (shape, layout, route...)."""


class ReshardTypeError(ReshardError, TypeError):
  """An argument has the wrong type (not a jax.Array, not a Sharding...)."""


class ReshardTimeoutError(ReshardError, TimeoutError):
  """A participating device did not arrive within the configured timeout."""
