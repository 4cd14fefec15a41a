"""The jax_m2n exception family.

Owns the error types every layer raises. Messages follow one rule:
"<api>: <what> must <rule>; got <value>." plus a hint. Nothing here moves data.
Argument errors are raised before data moves and are also ValueError / TypeError (JAX's
convention); failures while data moves are also RuntimeError, timeouts TimeoutError.
"""

import jax


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


class ReshardTransferGuardError(ReshardRuntimeError, jax.errors.JaxRuntimeError):
  """A transfer guard (`jax.transfer_guard_device_to_device("disallow_explicit")`)
  refuses the move between devices, as it refuses jax.device_put's; also the
  `jax.errors.JaxRuntimeError` JAX raises there. Raised before any data moves."""
