"""Topology: which devices share an NVLink domain, and the bandwidths of the links.

Owns the device -> domain map and the per-device bandwidth figures the cost model uses.
Knows nothing about tensors or layouts; never touches devices (built from ids only, or
from jax devices by `Topology.for_devices`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Iterable, Sequence

import numpy as np

from jax_m2n._src.errors import ReshardTypeError, ReshardValueError

# Per device, one direction, in GB/s (1 GB = 1e9 bytes). The defaults of the `plan`
# command: the paper's 50 GB/s NIC; an NVLink figure between H100/H200 (~391 measured)
# and GB200 (900).
DEFAULT_NIC_GBPS = 50.0
DEFAULT_NVLINK_GBPS = 450.0
# A CPU host's network link (10 Gbit/s Ethernet), shared by that process's CPU devices:
# the default between CPU processes (Topology.for_devices).
CPU_HOST_NIC_GBPS = 1.25

_MAX_DEVICE_ID = 2**63 - 1  # device ids travel as int64 in schedules


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Topology:
  """NVLink domains and link bandwidths.

  Exactly one way of naming domains is used, checked in this order:
    * `domains`: explicit groups of global device ids, e.g. `[[0, 1], [2, 3]]`; a device
      listed in none is its own domain;
    * `domain_size=N`: device ids `[k*N, (k+1)*N)` form domain k;
    * neither: every device is in domain 0 (one NVLink domain).

  Attributes:
    domain_size: devices per domain when `domains` is not given.
    domains: explicit domains (tuples of global device ids).
    nvlink_gbps: usable one-way NVLink bandwidth per device, GB/s.
    nic_gbps: usable one-way network bandwidth per device (between domains), GB/s.
    emulate_network: on CPU devices, pass bytes between devices of different domains
      through the CPU transport's NIC emulator: per device an egress and an ingress
      queue, each at `nic_gbps` and shared by all of that device's cross-domain
      transfers (docs/design.md, "The emulated network"). Copies inside a domain run
      at memory speed. Ignored on CUDA, where the links are real.
    nic_latency_us: with `emulate_network`, the latency the emulator adds to each
      cross-domain transfer (microseconds, >= 0).

  Example:
    >>> topo = jax_m2n.Topology(domain_size=2, nic_gbps=1.0, emulate_network=True)
    >>> topo.link_class(0, 2)
    'network'
  """

  domain_size: int | None = None
  domains: tuple[tuple[int, ...], ...] | None = None
  nvlink_gbps: float = DEFAULT_NVLINK_GBPS
  nic_gbps: float = DEFAULT_NIC_GBPS
  emulate_network: bool = False
  nic_latency_us: float = 0.0

  def __post_init__(self):
    if self.domain_size is not None:
      if not _is_int(self.domain_size):
        raise ReshardTypeError(
            f"Topology: domain_size must be a positive int; got {self.domain_size!r}.")
      if not 1 <= self.domain_size <= _MAX_DEVICE_ID:
        raise ReshardValueError(
            f"Topology: domain_size must be a positive int64; got {self.domain_size!r}.")
      object.__setattr__(self, "domain_size", int(self.domain_size))
    if self.domains is not None:
      domains = _domain_groups("Topology", self.domains)
      seen: dict[int, int] = {}
      for k, group in enumerate(domains):
        if not group:
          raise ReshardValueError(
              f"Topology: every domain must list at least one device; domain {k} is empty.")
        for d in group:
          if d in seen:
            raise ReshardValueError(
                f"Topology: a device must belong to one domain; device {d} is in "
                f"domains {seen[d]} and {k}.")
          seen[d] = k
      object.__setattr__(self, "domains", domains)
      object.__setattr__(self, "_domain_index", seen)
    for name in ("nvlink_gbps", "nic_gbps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ReshardTypeError(
            f"Topology: {name} must be a positive number of GB/s; got {value!r}.")
      # Below 1e-9 GB/s (1 byte/s) times overflow; above 1e9 GB/s nothing is real.
      if not 1e-9 <= value <= 1e9:
        raise ReshardValueError(
            f"Topology: {name} must be a number of GB/s in [1e-9, 1e9]; got {value!r}.")
      object.__setattr__(self, name, float(value))
    if not isinstance(self.emulate_network, bool):
      raise ReshardTypeError(
          f"Topology: emulate_network must be a bool; got {self.emulate_network!r}.")
    latency = self.nic_latency_us
    if isinstance(latency, bool) or not isinstance(latency, numbers.Real):
      raise ReshardTypeError(
          f"Topology: nic_latency_us must be a number of microseconds; got {latency!r}.")
    if not 0 <= latency <= 1e9:
      raise ReshardValueError(
          f"Topology: nic_latency_us must be in [0, 1e9] microseconds; got {latency!r}.")
    object.__setattr__(self, "nic_latency_us", float(latency))

  def domain_of(self, device: int) -> int:
    """The domain index of a global device id."""
    if self.domains is not None:
      index = self._domain_index.get(device)  # type: ignore[attr-defined]
      # Unlisted devices get a domain of their own, after the listed ones.
      return index if index is not None else len(self.domains) + device
    if self.domain_size is not None:
      return device // self.domain_size
    return 0

  def domains_of(self, devices: np.ndarray) -> np.ndarray:
    """`domain_of` of each of `devices` (global ids, an int array), as an int64 array."""
    devices = np.asarray(devices, np.int64)
    if self.domains is not None:  # a lookup per device (unlisted ones: domain_of)
      return np.fromiter(map(self.domain_of, devices.tolist()), np.int64, len(devices))
    if self.domain_size is not None:
      return devices // self.domain_size
    return np.zeros(len(devices), np.int64)

  def bandwidth_gbps(self, src: int, dst: int) -> float:
    """One-way bandwidth of the link class between two devices (inf for local)."""
    if src == dst:
      return float("inf")
    if self.domain_of(src) == self.domain_of(dst):
      return self.nvlink_gbps
    return self.nic_gbps

  def link_class(self, src: int, dst: int) -> str:
    """`local` (same device), `nvlink` (same domain) or `network`."""
    if src == dst:
      return "local"
    return "nvlink" if self.domain_of(src) == self.domain_of(dst) else "network"

  @classmethod
  def for_devices(cls, devices: Iterable, **bandwidths) -> "Topology":
    """The runtime default: the devices of one process form one NVLink domain. CPU
    devices of several processes share their host's network link: unless given, each
    one's `nic_gbps` is CPU_HOST_NIC_GBPS over its process's devices (what prices the
    cross-process engine's chunks; the GPU default stays the paper's NIC per GPU)."""
    devices = list(devices)
    by_process: dict[int, list[int]] = {}
    for d in devices:
      by_process.setdefault(d.process_index, []).append(d.id)
    groups = tuple(tuple(sorted(ids)) for _, ids in sorted(by_process.items()))
    if len(groups) <= 1:
      return cls(**bandwidths)
    if "nic_gbps" not in bandwidths and all(d.platform == "cpu" for d in devices):
      bandwidths["nic_gbps"] = CPU_HOST_NIC_GBPS / max(len(g) for g in groups)
    return cls(domains=groups, **bandwidths)


def _domain_groups(api: str, groups) -> tuple[tuple[int, ...], ...]:
  """Explicit domains as tuples of ints; refuses anything else with a clear error."""
  if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
    raise ReshardTypeError(
        f"{api}: domains must be a list of device-id lists, e.g. [[0, 1], [2, 3]]; got "
        f"{groups!r}.")
  out = []
  for k, group in enumerate(groups):
    if isinstance(group, (str, bytes)) or not isinstance(group, (list, tuple)):
      raise ReshardTypeError(
          f"{api}: every domain must be a list of device ids, e.g. [[0, 1], [2, 3]]; got "
          f"{group!r} at position {k} of {groups!r}.")
    for d in group:
      if not _is_int(d):
        raise ReshardTypeError(
            f"{api}: a device id must be an int; got {d!r} in domain {k} of {groups!r}.")
      if not 0 <= d <= _MAX_DEVICE_ID:
        raise ReshardValueError(
            f"{api}: a device id must be in [0, 2^63); got {d!r} in domain {k}.")
    out.append(tuple(int(d) for d in group))
  return tuple(out)


def as_topology(topology: "Topology | int | Sequence[Sequence[int]] | None",
                devices: Iterable | None = None, api: str = "reshard") -> Topology:
  """Normalizes the `topology=` argument of the public API.

  Raises:
    ReshardTypeError: `topology` is none of the accepted kinds (a bool, a dict, a flat
      list of ints, a device id that is not an int...).
    ReshardValueError: a domain size below 1, a device in two domains...
  """
  if topology is None:
    return Topology.for_devices(devices) if devices is not None else Topology()
  if isinstance(topology, Topology):
    return topology
  if isinstance(topology, bool):
    raise ReshardTypeError(
        f"{api}: topology must be a jax_m2n.Topology, a domain size (int) or a list of "
        f"device-id lists; got the bool {topology!r}.")
  try:
    if _is_int(topology):
      return Topology(domain_size=topology)
    if isinstance(topology, (list, tuple)):
      return Topology(domains=_domain_groups(f"{api}: topology", topology))
  except (ReshardTypeError, ReshardValueError) as e:
    message = str(e)
    if message.startswith("Topology: "):
      message = f"{api}: topology: " + message[len("Topology: "):]
    raise type(e)(message) from None
  raise ReshardTypeError(
      f"{api}: topology must be a jax_m2n.Topology, a domain size (int) or a list of "
      f"device-id lists; got {type(topology).__name__} {topology!r}.")


def emulated_network(topology: Topology, devices: Sequence[int]) -> "list[int] | None":
  """The CPU handler's `network` attribute for `devices` (a schedule's participants,
  ascending), or None when `topology` does not emulate the network.

  Layout (xla_ffi/nic_emulator.h): [bytes_per_s, latency_ns, domain of each device].
  """
  if not topology.emulate_network:
    return None
  return ([max(1, round(topology.nic_gbps * 1e9)), round(topology.nic_latency_us * 1e3)]
          + [topology.domain_of(d) for d in devices])
