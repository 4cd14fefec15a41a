"""jax_m2n: reshard distributed JAX arrays from M source devices to N destination devices.

The public surface: `reshard` (move a pytree of arrays into new layouts, eagerly across
device sets or inside jit), `plan` (the transfer plan without moving anything),
`check_errors` (did an in-jit reshard fail?), `Quantize` (a `dtype=` that quantizes:
FP8 values and scales on the wire) and `QuantizedArray`, `Topology`, `Layout`,
`Publisher` / `Subscriber` (versions of a pytree between separate jobs) with
`new_token`, and the
`ReshardError` family. Internals live in `jax_m2n._src`.
"""

from jax_m2n._src.errors import (
    ReshardError as ReshardError,
    ReshardRuntimeError as ReshardRuntimeError,
    ReshardTimeoutError as ReshardTimeoutError,
    ReshardTransferGuardError as ReshardTransferGuardError,
    ReshardTypeError as ReshardTypeError,
    ReshardValueError as ReshardValueError,
)
from jax_m2n._src.layout import Layout as Layout
from jax_m2n._src.api import check_errors as check_errors
from jax_m2n._src.api import plan as plan
from jax_m2n._src.api import reshard as reshard
from jax_m2n._src.quantize import Quantize as Quantize
from jax_m2n._src.quantize import QuantizedArray as QuantizedArray
from jax_m2n._src.topology import Topology as Topology
from jax_m2n._src.jobs.publisher import Publisher as Publisher
from jax_m2n._src.jobs.subscriber import Subscriber as Subscriber
from jax_m2n._src.jobs.auth import new_token as new_token

__version__ = "0.1.0"

__all__ = [
    "Layout",
    "Publisher",
    "Quantize",
    "QuantizedArray",
    "ReshardError",
    "ReshardRuntimeError",
    "ReshardTimeoutError",
    "ReshardTransferGuardError",
    "ReshardTypeError",
    "ReshardValueError",
    "Subscriber",
    "Topology",
    "__version__",
    "check_errors",
    "new_token",
    "plan",
    "reshard",
]
