"""Topology: which devices share an NVLink domain, and the bandwidths of the links.

Owns the device -> domain map and the per-device bandwidth figures the cost model uses.
Knows nothing about tensors or layouts; never touches devices (built from ids only, or
from jax devices by `Topology.for_devices`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from jax_m2n._src.errors import ReshardValueError

# Per device, one direction, in GB/s (1 GB = 1e9 bytes). The defaults of the `plan`
# command: the paper's 50 GB/s NIC; an NVLink figure between H100/H200 (~391 measured)
# and GB200 (900).
DEFAULT_NIC_GBPS = 50.0
DEFAULT_NVLINK_GBPS = 450.0


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
  """

  domain_size: int | None = None
  domains: tuple[tuple[int, ...], ...] | None = None
  nvlink_gbps: float = DEFAULT_NVLINK_GBPS
  nic_gbps: float = DEFAULT_NIC_GBPS

  def __post_init__(self):
    if self.domain_size is not None:
      if not isinstance(self.domain_size, int) or self.domain_size < 1:
        raise ReshardValueError(
            f"Topology: domain_size must be a positive int; got {self.domain_size!r}.")
    if self.domains is not None:
      domains = tuple(tuple(int(d) for d in group) for group in self.domains)
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
      if not value > 0:
        raise ReshardValueError(
            f"Topology: {name} must be a positive number of GB/s; got {value!r}.")
      object.__setattr__(self, name, float(value))

  def domain_of(self, device: int) -> int:
    """The domain index of a global device id."""
    if self.domains is not None:
      index = self._domain_index.get(device)  # type: ignore[attr-defined]
      # Unlisted devices get a domain of their own, after the listed ones.
      return index if index is not None else len(self.domains) + device
    if self.domain_size is not None:
      return device // self.domain_size
    return 0

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
    """The runtime default: the devices of one process form one NVLink domain."""
    by_process: dict[int, list[int]] = {}
    for d in devices:
      by_process.setdefault(d.process_index, []).append(d.id)
    groups = tuple(tuple(sorted(ids)) for _, ids in sorted(by_process.items()))
    if len(groups) <= 1:
      return cls(**bandwidths)
    return cls(domains=groups, **bandwidths)


def as_topology(topology: "Topology | int | Sequence[Sequence[int]] | None",
                devices: Iterable | None = None) -> Topology:
  """Normalizes the `topology=` argument of the public API."""
  if topology is None:
    return Topology.for_devices(devices) if devices is not None else Topology()
  if isinstance(topology, Topology):
    return topology
  if isinstance(topology, int):
    return Topology(domain_size=topology)
  if isinstance(topology, (list, tuple)):
    return Topology(domains=tuple(tuple(g) for g in topology))
  raise ReshardValueError(
      "topology must be a jax_m2n.Topology, a domain size (int) or a list of device-id "
      f"lists; got {topology!r}.")
