"""The jax_m2n exception family.

Owns every error type any layer raises (the public family and the two internal
signals, `Unplaceable` and `PeerFailed`, the control plane's `CoordinatorUnreachable`,
the jobs layer's `ProtocolError`, `PlanUnknown`, `Unconfirmed` and `VersionGone`) and
the API name messages start with. Messages
follow one rule: "<api>: <what> must <rule>; got <value>." plus a hint. Nothing here
moves data. Argument errors are raised before data moves and are also ValueError /
TypeError (JAX's convention); failures while data moves are also RuntimeError, timeouts
TimeoutError.
"""

import re

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


class CoordinatorUnreachable(ReshardRuntimeError):
  """A key-value operation got no answer in time: this process is cut off from the
  jax.distributed coordinator (processes/store.py decides, by probing it)."""


class PeerFailed(ReshardRuntimeError):
  """Another process posted its failure of a cross-process call (relayed, not posted
  again: processes/sequence.py)."""


class ProtocolError(ReshardValueError):
  """A control message between jobs broke the format (jobs/messages.py): refused
  without effect."""


class PlanUnknown(ReshardRuntimeError):
  """Internal: a publisher process no longer knows the plan a pull names (evicted, or
  the process restarted); the subscriber registers it again and retries."""


class Unconfirmed(Exception):
  """Internal: a pull begun before the publisher named its version (a local copy made
  while it answers; a network pull of "the newest after the last one") cannot go on as
  begun: it needs a control call first, or the newest version is not what it assumed.
  `got`: the (version, manifest id) the publisher named, where it did; the pull then
  runs the usual way."""

  def __init__(self, got: "tuple[int, str] | None" = None):
    super().__init__(got)
    self.got = got


class VersionGone(ReshardValueError):
  """The version a pull asked for is no longer held by the publisher (beyond `keep`);
  a pull of the newest moves on to the next newest."""


def _status_code(msg: str) -> str | None:
  """The absl status code XLA puts before a failed custom call's message, if any."""
  m = re.match(r"\s*([A-Z][A-Z_]+):", msg)
  return m.group(1) if m else None


# The CUDA transport's watchdog says this when a step outlived timeout_ms (its sticky
# error carries no status code).
_CUDA_WATCHDOG_TIMEOUT = "did not complete within timeout_ms="


def map_native_error(e: BaseException) -> ReshardError:
  """A native handler error as the jax_m2n exception (the native message kept).

  Timeouts are told by their status code (DEADLINE_EXCEEDED, what the CPU handler
  returns) or type (TimeoutError), and by the CUDA watchdog's fixed phrase.
  """
  if isinstance(e, ReshardError):
    return e
  msg = str(e)
  if (isinstance(e, TimeoutError) or _status_code(msg) == "DEADLINE_EXCEEDED"
      or _CUDA_WATCHDOG_TIMEOUT in msg):
    return ReshardTimeoutError(
        f"{API}: a participating device did not arrive in time; the handler says: "
        f"{msg}. Hint: every participating device must call reshard with identical "
        "layouts in the same order (the collective contract); raise timeout_s if a "
        "peer is merely slow.")
  return ReshardRuntimeError(f"{API}: the native handler failed: {msg}")
