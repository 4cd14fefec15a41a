"""The jax_m2n exception family.

Owns every error type any layer raises (the public family and the two internal
signals, `Unplaceable` and `PeerFailed`) and the API name messages start with. Messages
follow one rule: "<api>: <what> must <rule>; got <value>." plus a hint. Nothing here
moves data. Argument errors are raised before data moves and are also ValueError /
TypeError (JAX's convention); failures while data moves are also RuntimeError, timeouts
TimeoutError.
"""

import jax

# The API every reshard message names first ("reshard: ..."); jax_m2n.plan's say "plan".
API = "reshard"


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


class Unplaceable(ReshardValueError):
  """Internal: the in-jit shard_map lowering cannot hold these layouts together (meshes
  with no common refinement, a typed source whose concrete mesh is unknown, devices of
  another process on CPU); JAX can still move them, so the lowering hands such leaves
  to XLA (transforms.py) and the user never sees this error."""


class PeerFailed(ReshardRuntimeError):
  """Another process posted its failure of a cross-process call (relayed, not posted
  again: processes/sequence.py)."""
