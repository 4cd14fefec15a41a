"""The CPU transport's emulated network (xla_ffi/nic_emulator.h) against the cost model.

Ratios only, generous bounds (issue 13): on 8 CPU devices in domains of 2 with a slow
emulated NIC, the hierarchical route beats flat direct sends by at least 0.7 x r_d, and a
transfer takes at least the time its NIC bytes need. Bytes are checked too: the emulator
delays, it never changes what moves.
"""

import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import topology as topology_lib

NIC_GBPS = 0.025  # 8 MiB over 2 sources: 168 ms per source at this rate (CPU work is
# then small beside it, even on a loaded 2-core machine)
CHUNK = 256 << 10  # 16 chunks per source: pipeline fill adds (r_d - 1) / 16


@pytest.fixture(scope="module")
def devs():
  return np.array(jax.devices()[:8])


@pytest.fixture(scope="module")
def topo():
  return jax_m2n.Topology(domain_size=2, nic_gbps=NIC_GBPS, emulate_network=True)


def best_ms(x, dst, route, topo, reps=3):
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    y = jax_m2n.reshard(x, dst, route=route, topology=topo, chunk_bytes=CHUNK)
    jax.block_until_ready(y)
    ts.append((time.perf_counter() - t) * 1e3)
  return min(ts), y


@pytest.mark.parametrize("r_d", [2, 3])
def test_hierarchical_beats_flat_by_r_d_on_the_emulated_network(devs, topo, r_d):
  host = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)  # 8 MiB
  x = jax.device_put(host, NamedSharding(Mesh(devs[:2], ("tp",)), P("tp", None)))
  dst = NamedSharding(Mesh(devs[2:2 + 2 * r_d].reshape(r_d, 2), ("dp", "tp")),
                      P("tp", None))
  times = {}
  for route in ("hierarchical", "flat"):
    jax.block_until_ready(jax_m2n.reshard(x, dst, route=route, topology=topo,
                                          chunk_bytes=CHUNK))  # compile
    times[route], y = best_ms(x, dst, route, topo)
    for s in y.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), host[s.index])
    estimate = jax_m2n.plan(x, dst, route=route, topology=topo,
                            chunk_bytes=CHUNK).route_estimate_ms()
    # The NIC is modelled, not skipped: no faster than its bytes allow.
    assert times[route] >= 0.9 * estimate, (route, times[route], estimate)
  assert times["flat"] / times["hierarchical"] >= 0.7 * r_d, times


def test_without_emulation_the_same_reshard_is_fast(devs, topo):
  host = np.ones((2048, 1024), np.float32)
  x = jax.device_put(host, NamedSharding(Mesh(devs[:2], ("tp",)), P("tp", None)))
  dst = NamedSharding(Mesh(devs[2:6].reshape(2, 2), ("dp", "tp")), P("tp", None))
  plain = jax_m2n.Topology(domain_size=2, nic_gbps=NIC_GBPS)
  jax.block_until_ready(jax_m2n.reshard(x, dst, route="flat", topology=plain))
  ms, _ = best_ms(x, dst, "flat", plain)
  estimate = jax_m2n.plan(x, dst, route="flat", topology=topo).route_estimate_ms()
  assert ms < 0.5 * estimate, (ms, estimate)


def test_network_attribute_lists_the_domain_of_each_participant():
  topo = jax_m2n.Topology(domains=[[0, 3], [1, 2]], nic_gbps=2.5, nic_latency_us=7,
                          emulate_network=True)
  assert topology_lib.emulated_network(topo, [0, 1, 2, 3]) == [
      2_500_000_000, 7000, 0, 1, 1, 0]
  assert topology_lib.emulated_network(
      jax_m2n.Topology(domain_size=2), [0, 1]) is None


@pytest.mark.parametrize("kwargs,error", [
    ({"emulate_network": 1}, jax_m2n.ReshardTypeError),
    ({"nic_latency_us": -1.0}, jax_m2n.ReshardValueError),
    ({"nic_gbps": 0.0}, jax_m2n.ReshardValueError),
    ({"nic_gbps": True}, jax_m2n.ReshardTypeError),
    ({"domain_size": True}, jax_m2n.ReshardTypeError),
])
def test_bad_topology_fields(kwargs, error):
  with pytest.raises(error, match="Topology: "):
    jax_m2n.Topology(**kwargs)


def test_inside_jit_the_emulated_network_paces_too(devs, topo):
  """The traced path passes the `network` attribute as well (colocated: all-gather)."""
  host = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
  mesh = Mesh(devs, ("x",))
  x = jax.device_put(host, NamedSharding(mesh, P("x", None)))
  dst = NamedSharding(mesh, P(None, None))
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, topology=topo, chunk_bytes=CHUNK,
                                        src_sharding=x.sharding))
  jax.block_until_ready(f(x))
  t = time.perf_counter()
  y = jax.block_until_ready(f(x))
  ms = (time.perf_counter() - t) * 1e3
  for s in y.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), host)
  estimate = jax_m2n.plan(x, dst, topology=topo, chunk_bytes=CHUNK).route_estimate_ms()
  assert estimate > 10 and ms >= 0.9 * estimate, (ms, estimate)
