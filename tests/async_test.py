"""The asynchronous eager reshard (issue 15 item 1): the call returns once every device's
program is dispatched, its outputs not ready; errors known only later surface at the
outputs' block_until_ready / first use and as a ReshardError at the next call.

On CPU this is opt-in (JAX_M2N_CPU_ASYNC=1, here `eager.programs._CPU_ASYNC`, read when a
layout's programs are built; docs/design.md, "Dispatch"): this file turns it on for its
layouts, and checks that the default CPU call returns finished.

"Not finished yet" is proven without timing: the CPU transport's test gate
(`_ffi.hold`) keeps a device's handler from joining its generation until released, so
the call returns while that device's transfer has not even started.
"""

import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jax_m2n
from jax_m2n._src import eager
from jax_m2n._src import ffi as m2n_ffi

import launcher

SETTLE_S = 10.0  # how long a failed call may take to be noticed, generously



@pytest.fixture(scope="module", autouse=True)
def cpu_async():
  """This file's layouts are built with asynchronous CPU dispatch on, and only this
  file's: set at import, the switch also reached the files collected with it in one
  pytest process (reshard_test's peer timeout then returned before it). The eager
  cache is emptied on both sides, so no entry crosses the switch."""
  before = eager.programs._CPU_ASYNC
  eager.eager_cache.clear()
  eager.programs._CPU_ASYNC = True
  yield
  eager.programs._CPU_ASYNC = before
  eager.eager_cache.clear()


@pytest.fixture(scope="module")
def devs():
  return jax.devices()[:8]


@pytest.fixture
def hold():
  """hold(ids): those devices' handlers wait until the test ends (or release())."""
  module = m2n_ffi.load("cpu")
  held = []

  def install(ids):
    held.extend(ids)
    module.hold(list(ids), True)

  def release():
    module.hold(list(held), False)
    held.clear()
  install.release = release
  yield install
  release()


def _settled():
  """Waits until every eager call has finished (the watcher has seen all outputs)."""
  deadline = time.monotonic() + SETTLE_S
  while any(s.in_flight for s in eager.site_states.values()):
    assert time.monotonic() < deadline, "calls still in flight"
    time.sleep(0.01)


def _host(n=1152, offset=0.0):
  return np.arange(n, dtype=np.float32) + offset


def test_returns_before_the_transfer_and_outputs_wait(devs, hold):
  x = jax.device_put(_host(), devs[0])
  dst = SingleDeviceSharding(devs[1])
  jax.block_until_ready(jax_m2n.reshard(x, dst))  # built, compiled
  hold([1])
  y = jax_m2n.reshard(x, dst)  # returns although device 1 cannot start
  assert not y.is_ready()
  z = y * 2  # later work is queued behind it
  time.sleep(0.2)
  assert not y.is_ready() and not z.is_ready()
  hold.release()
  np.testing.assert_array_equal(np.asarray(z), 2 * _host())
  np.testing.assert_array_equal(np.asarray(y), _host())


def test_pytree_returns_before_the_transfer(devs, hold):
  mesh = Mesh(np.array(devs[:4]), ("x",))
  dst_mesh = Mesh(np.array(devs[4:]), ("y",))
  hosts = {"a": _host(64 * 32).reshape(64, 32), "b": _host(48, 7.0),
           "c": _host(8 * 8 * 2, 1.0).reshape(8, 8, 2)}
  x = {"a": jax.device_put(hosts["a"], NamedSharding(mesh, P("x"))),
       "b": jax.device_put(hosts["b"], devs[2]),
       "c": jax.device_put(hosts["c"], NamedSharding(mesh, P(None, "x")))}
  dst = {"a": NamedSharding(dst_mesh, P(None, "y")), "b": NamedSharding(dst_mesh, P()),
         "c": NamedSharding(dst_mesh, P("y"))}
  jax.block_until_ready(jax_m2n.reshard(x, dst))
  hold([6])
  y = jax_m2n.reshard(x, dst)
  assert not any(leaf.is_ready() for leaf in jax.tree.leaves(y))
  hold.release()
  for k in hosts:
    assert y[k].sharding == dst[k]
    np.testing.assert_array_equal(np.asarray(y[k]), hosts[k])


def test_back_to_back_calls_keep_their_order(devs, hold):
  """Several calls of one layout (and a chained one) issued before the first could
  start: each gets its own data, in order."""
  mesh = Mesh(np.array(devs[:2]), ("x",))
  dst = NamedSharding(Mesh(np.array(devs[2:4]), ("y",)), P("y"))
  back = NamedSharding(mesh, P())
  srcs = [jax.device_put(_host(256, 1000.0 * k).reshape(16, 16), NamedSharding(mesh, P("x")))
          for k in range(5)]
  jax.block_until_ready(jax_m2n.reshard(srcs[0], dst))
  jax.block_until_ready(jax_m2n.reshard(jax_m2n.reshard(srcs[0], dst), back))
  hold([3])
  ys = [jax_m2n.reshard(s, dst) for s in srcs]
  chained = jax_m2n.reshard(ys[2], back)  # reads an output not ready yet
  assert not any(y.is_ready() for y in ys) and not chained.is_ready()
  hold.release()
  for k, y in enumerate(ys):
    np.testing.assert_array_equal(np.asarray(y), _host(256, 1000.0 * k).reshape(16, 16))
  np.testing.assert_array_equal(np.asarray(chained), _host(256, 2000.0).reshape(16, 16))


@pytest.mark.parametrize("held", ["source", "destination"])
def test_donated_source_stays_valid_until_the_transfer_has_read_it(devs, hold, held):
  """donate=True deletes the source at once; XLA keeps its buffers alive until the
  programs that read them have finished, so reusing the memory meanwhile cannot
  change what arrives."""
  x = jax.device_put(_host(4096), devs[0])
  dst = SingleDeviceSharding(devs[1])
  jax.block_until_ready(jax_m2n.reshard(x, dst, donate=False))
  hold([0] if held == "source" else [1])
  y = jax_m2n.reshard(x, dst, donate=True)
  assert x.is_deleted() and not y.is_ready()
  # Churn the source device's memory while the transfer waits (transfers only: a
  # program on the held device would queue behind the held one).
  junk = [jax.device_put(np.full(4096, -1.0, np.float32), devs[0]) for _ in range(32)]
  jax.block_until_ready(junk)
  hold.release()
  np.testing.assert_array_equal(np.asarray(y), _host(4096))


def test_peer_timeout_surfaces_at_block_until_ready_then_next_call(devs, hold):
  """A source device that does not come within timeout_s: the destination's output
  carries the timeout (block_until_ready, first use); the next reshard raises it as a
  ReshardTimeoutError naming the call, runs nothing, and the one after works."""
  x = jax.device_put(_host(), devs[0])
  dst = SingleDeviceSharding(devs[1])
  jax.block_until_ready(jax_m2n.reshard(x, dst, timeout_s=0.3))
  hold([0])
  t = time.perf_counter()
  y = jax_m2n.reshard(x, dst, timeout_s=0.3)
  assert time.perf_counter() - t < 0.3  # returned before the timeout could pass
  with pytest.raises(Exception, match=r"devices \[0\] did not arrive") as info:
    jax.block_until_ready(y)
  assert "jax_m2n_reshard" in str(info.value)
  with pytest.raises(Exception, match="did not arrive"):
    np.asarray(y + 1)  # first use
  hold.release()
  _settled()
  with pytest.raises(jax_m2n.ReshardTimeoutError, match="an earlier asynchronous call, "
                     r"eager reshard #\d+ \(site \d+, generation \d+, devices \[0, 1\]\)"):
    jax_m2n.reshard(x, dst, timeout_s=0.3)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst, timeout_s=0.3)),
                                  _host())


def test_unwaited_failure_is_raised_by_the_next_call_once(devs):
  """A peer that never comes (its program not dispatched) and nobody waits on the
  outputs: the next reshard (any layout) raises it, once; nothing of it ran."""
  x = jax.device_put(_host(), devs[0])
  dst = SingleDeviceSharding(devs[1])
  other = jax.device_put(_host(64), devs[2])
  jax.block_until_ready(jax_m2n.reshard(x, dst, timeout_s=0.2))
  jax.block_until_ready(jax_m2n.reshard(other, devs[3]))
  fn = next(eager.eager_cache[k] for k in eager.eager_cache
            if k[2].timeout_ms == 200 and eager.eager_cache[k].out_avals[0][2] == dst)
  assert fn([x], False, devices=[1]) == []  # device 0 never comes; returns at once
  _settled()
  with pytest.raises(jax_m2n.ReshardTimeoutError, match=r"devices \[0\] did not arrive"):
    jax_m2n.reshard(other, devs[3])  # another layout: raised here, did not run
  z = jax_m2n.reshard(other, devs[3])  # raised once: this one runs
  np.testing.assert_array_equal(np.asarray(z), _host(64))
  np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst, timeout_s=0.2)),
                                _host())


def test_error_known_before_dispatch_raises_at_once(devs, hold):
  """A deleted shard is known before anything runs: raised by the call itself."""
  x = jax.device_put(_host(), devs[0])
  dst = SingleDeviceSharding(devs[1])
  jax.block_until_ready(jax_m2n.reshard(x, dst))
  y = jax.device_put(_host(), devs[0])
  y._arrays[0].delete()
  with pytest.raises(jax_m2n.ReshardValueError, match="deleted"):
    jax_m2n.reshard(y, dst)
  np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst)), _host())


def test_block_waits_and_raises_the_calls_own_error(devs):
  """The internal blocking mode (failure_test's Ctrl-C test uses it) returns ready
  outputs, and raises a failure itself (not again at the next call)."""
  x = jax.device_put(_host(), devs[0])
  dst = SingleDeviceSharding(devs[1])
  jax.block_until_ready(jax_m2n.reshard(x, dst, timeout_s=0.2))
  fn = next(eager.eager_cache[k] for k in eager.eager_cache
            if k[2].timeout_ms == 200 and eager.eager_cache[k].out_avals[0][2] == dst)
  (y,) = fn([x], False, block=True)
  assert y.is_ready()
  np.testing.assert_array_equal(np.asarray(y), _host())
  with pytest.raises(jax_m2n.ReshardTimeoutError):
    fn([x], False, devices=[1], block=True)
  np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst, timeout_s=0.2)),
                                _host())


def test_programs_run_asynchronously_in_xla(devs):
  """The per-device programs are costly enough for XLA's CPU client to queue them
  (else it would run each inline, and the caller would wait for the transfer)."""
  x = jax.device_put(_host(), devs[0])
  jax.block_until_ready(jax_m2n.reshard(x, devs[1]))
  entries = [eager.eager_cache[k] for k in eager.eager_cache]
  assert entries and all(e.caller_dispatch for e in entries if e.platform == "cpu")


def _threads(work, n, join_s=120.0):
  """Runs work(k) on n threads; returns their exceptions (a thread still running
  after join_s is a failure: it is left as a daemon)."""
  errors = []

  def run(k):
    try:
      work(k)
    except BaseException as e:  # noqa: BLE001 - reported by the test
      errors.append(e)
  threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
  for t in threads:
    t.start()
  deadline = time.monotonic() + join_s
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
  assert not any(t.is_alive() for t in threads), "a thread is still waiting"
  return errors


@pytest.mark.parametrize("n_threads,sources", [(2, "own"), (4, "shared")])
def test_threads_issuing_at_once_are_safe(devs, n_threads, sources):
  """JAX_M2N_CPU_ASYNC=1 calls from several threads at once: two threads repeating
  one reshard each on their own source, four sharing one (issue 26: timed out in
  most runs; now one thread issues at a time). Short timeouts: a hang fails fast."""
  d = np.array(devs)
  src = NamedSharding(Mesh(d[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(d[4:], ("y",)), P(None, "y"))
  host = np.arange(48 * 16, dtype=np.float32).reshape(48, 16)
  shared = jax.device_put(host, src)
  xs = [shared if sources == "shared" else jax.device_put(host + k, src)
        for k in range(n_threads)]

  def work(k):
    for _ in range(12):
      y = jax_m2n.reshard(xs[k], dst, timeout_s=5)
      np.testing.assert_array_equal(np.asarray(y), np.asarray(xs[k]))
  errors = _threads(work, n_threads)
  assert not errors, errors[0]
  _settled()


def test_default_cpu_call_returns_finished(devs, monkeypatch):
  """Without the opt-in, a CPU call returns when its transfer has finished, and a
  handler error is raised by the call itself."""
  monkeypatch.setattr(eager.programs, "_CPU_ASYNC", False)
  x = jax.device_put(_host(96), devs[0])  # a layout of its own: built without it
  dst = SingleDeviceSharding(devs[1])
  y = jax_m2n.reshard(x, dst, timeout_s=0.2)
  assert y.is_ready()
  np.testing.assert_array_equal(np.asarray(y), _host(96))
  fn = next(eager.eager_cache[k] for k in eager.eager_cache
            if k[2].timeout_ms == 200 and eager.eager_cache[k].out_avals[0][0] == (96,))
  assert not fn.caller_dispatch
  with pytest.raises(jax_m2n.ReshardTimeoutError, match=r"devices \[0\] did not arrive"):
    fn([x], False, devices=[1])
  np.testing.assert_array_equal(np.asarray(jax_m2n.reshard(x, dst, timeout_s=0.2)),
                                _host(96))


def test_threads_end_before_the_interpreter_finalizes():
  """The exit hook ends the watcher and the device workers while Python still runs (a
  daemon thread caught inside a native call at finalization aborts the process: seen as
  "FATAL: exception not rethrown" on jax 0.11.2). Checked in a fresh process."""
  script = textwrap.dedent("""
      import threading, jax
      jax.config.update("jax_num_cpu_devices", 2)
      import numpy as np, jax_m2n
      from jax_m2n._src import eager
      d = jax.devices()
      y = jax_m2n.reshard(jax.device_put(np.arange(8.0), d[0]), d[1])
      jax.block_until_ready(y)
      names = lambda: sorted(t.name for t in threading.enumerate()
                             if t.name.startswith("jax_m2n") and t.is_alive())
      assert names(), "the call started no thread"
      eager.stop_threads_at_exit()
      assert not names(), names()
      print("ended")
  """)
  proc = launcher.run_python(script, {"JAX_M2N_CPU_ASYNC": "1", "JAX_PLATFORMS": "cpu"},
                             timeout_s=120)
  assert proc.returncode == 0 and "ended" in proc.stdout, proc.stderr[-3000:]
