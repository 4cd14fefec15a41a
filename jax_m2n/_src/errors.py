"""The jax_m2n exception family.

Owns the error types every layer raises. Messages follow one rule:
"<api>: <what> must <rule>; got <value>." plus a hint. Nothing here moves data.
Argument errors are raised before data moves and are also ValueError / TypeError (JAX's
convention); failures while data moves are also RuntimeError, timeouts TimeoutError.
"""


class ReshardError(Exception):
  """Base class of every error jax_m2n raises on purpose."""


class ReshardValueError(ReshardError, ValueError):
  """An argument has the right type but breaks a rule (shape, layout, route...)."""


class ReshardTypeError(ReshardError, TypeError):
  """An argument has the wrong type (not an array, not a Sharding, not a number...)."""


class ReshardRuntimeError(ReshardError, RuntimeError):
  """The native handler (or a transport) failed while moving data; no outputs exist."""


class ReshardTimeoutError(ReshardRuntimeError, TimeoutError):
  """A participating device did not arrive within the configured timeout."""
