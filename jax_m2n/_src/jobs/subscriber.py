"""`Subscriber`: a generator job's side of weight sync between separate jobs.

Owns the public calls (pull, close) and what one Subscriber keeps between pulls
(pulling.State: its connections to the publisher, its relay membership, the last
version, manifests and delta base; watch.Watch: its records). The pull itself is
pulling.py's.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_m2n._src import checks
from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError
from jax_m2n._src.jobs import auth, metrics as metrics_lib, pulling, relay as relay_lib
from jax_m2n._src.jobs import lifetime, records, watch
from jax_m2n._src.jobs.connections import Connections
from jax_m2n._src.jobs.request import pull_options

_API = "Subscriber"


class Subscriber(lifetime.Closing):
  """Pulls versions a `Publisher` published, into this job's layouts.

  Every process of the generator job (one process, or a `jax.distributed` job of its
  own, never shared with the trainer) creates its Subscriber and calls `pull` alike;
  each receives only its own devices' shards.

  Args:
    address: process 0 of the trainer job's Publisher address, "host:port".
    token: the publisher's token (a str of at least 16 characters, or 16 bytes;
      `jax_m2n.new_token()` makes one). A wrong one raises here.
    timeout_s: how long to wait for the publisher to answer the handshake.
    relay: True: this job (one process) relays with the other subscriber jobs that
      pull the same version with the same dst layouts and dtypes: the trainer sends
      each byte once per version to the first of them, and each forwards it, chunk by
      chunk, to the next (docs/jobs.md, "Relays"). Its arrays are then held
      (forwarded) until the group starts the next version. A job of several processes
      pulls directly whatever this says.
    metrics: a `prometheus_client.CollectorRegistry` to count this subscriber's pulls
      into (docs/watching.md, lists the metrics), or None. No port is
      opened; instances passing one registry share its metrics.

  Raises:
    ReshardValueError: a wrong or short token, a malformed address.
    ReshardRuntimeError: nothing answered at `address` within `timeout_s`.

  Example (both jobs in one program here; normally two):
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> pub = jax_m2n.Publisher(token="s3cret-token-0123456789")
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    >>> _ = pub.publish({"w": w})
    >>> sub = jax_m2n.Subscriber(pub.address, token="s3cret-token-0123456789")
    >>> gen = Mesh(np.array(jax.devices()[4:]), ("y",))
    >>> out = sub.pull(NamedSharding(gen, P(None, "y")), dtype=jnp.bfloat16)
    >>> sub.version, out["w"].dtype, out["w"].sharding.spec == P(None, "y")
    (1, dtype(bfloat16), True)
    >>> sub.last_pull.path, sub.last_pull.result_bytes   # read from the trainer's memory
    ('local', 64)
    >>> sub.close(); pub.close()
  """

  def __init__(self, address: str, *, token: Any, timeout_s: float = 60.0,
               relay: bool = False, metrics: Any = None):
    key = auth.as_key(_API, token)
    self._watch = watch.Watch(metrics_lib.of(_API, metrics))
    if not isinstance(relay, bool):
      raise ReshardTypeError(f"{_API}: relay must be a bool; got {type(relay).__name__}.")
    connect_s = checks.options(_API, timeout_s=timeout_s).timeout_s
    self._state = pulling.State(Connections(_API, address, key, connect_s))
    # A one-process job relays (docs/jobs.md, "Relays"); a multi-process job pulls
    # directly (its processes already forward among themselves).
    if relay and jax.process_count() == 1:
      self._state.relay = relay_lib.Member(_API, self._state.connections.new_root)
    self._close_with(_shut, self._state)

  @property
  def version(self) -> int:
    """The version of the last successful pull (0 before the first)."""
    return self._state.version

  @property
  def last_pull(self) -> records.PullRecord | None:
    """The record of the last successful pull on this process (None before one)."""
    return self._watch.last_pull

  @property
  def last_failure(self) -> records.PullFailure | None:
    """The record of the last failed pull on this process (None before one)."""
    return self._watch.last_failure

  def close(self) -> None:
    """Closes the connections (the publisher forgets this subscriber's session) and
    releases this process's share of the transport. Also when a `with` block ends
    and when the last reference goes."""
    super().close()

  def prepare(self, dst: Any, *, dtype: Any = None, route: str = "hierarchical",
              timeout_s: float | None = None, path: str = "auto") -> int:
    """Does now what the first pull into these layouts would do besides moving the
    weights, so that the first `pull` costs what later ones do: waits (up to
    `timeout_s`) for a version, fetches its manifest, checks and plans the pull,
    and compiles the copies on both sides (the local path maps the publisher's
    exports; the network path registers the plan with each publisher process, which
    prepares its cut). Arguments as `pull`'s; every process of a job calls it.

    Returns:
      The version whose layout set it prepared (nothing is pulled; the next `pull`
      still returns the newest version after the last pull).

    Raises:
      As `pull`: bad dst or dtype, no version within timeout_s, a dead publisher.

    Example:
      >>> sub.prepare(dst_shardings, dtype=jnp.bfloat16)   # doctest: +SKIP
      1
    """
    api = "Subscriber.prepare"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, route=route, timeout_s=timeout_s, path=path)
    return pulling.prepare(self._state, dst, dtype, options)

  def pull(self, dst: Any, *, dtype: Any = None, version: int | None = None,
           donate: Any = None, route: str = "hierarchical",
           timeout_s: float | None = None, delta: bool | str = False,
           path: str = "auto") -> Any:
    """Returns a published version in this job's layouts.

    Without `version`, the newest version published after this subscriber's last
    pull (waiting up to `timeout_s` for one); with it, that version (held by the
    publisher, or published within `timeout_s`). The result's leaves are global
    jax.Arrays in the dst layouts, bitwise equal to
    `jax.device_put(x.astype(dtype), dst)` of the published x.

    Collective over the generator job: every process calls pull with the same
    arguments, in the same order.

    Args:
      dst: where each leaf goes: a `Sharding`, an array or a `ShapeDtypeStruct`
        whose sharding to use, or a pytree prefix of the published pytree of them
        (matched by key paths). Devices of this job.
      dtype: as reshard's `dtype=`: None (the published dtype), a dtype, a
        `jax_m2n.Quantize` spec, or a pytree prefix of them. A conversion between
        float32, float16, bfloat16 and the float8s crosses in the narrower type;
        others are converted by the publisher first. A Quantize leaf crosses in the
        published dtype and is quantized here, on the dst layout (bitwise qwix's).
      version: a version number to pull, or None (the newest not yet pulled).
      donate: the previous version's arrays (a pytree of jax.Arrays, e.g. the last
        pull's result): deleted once the new version has arrived, so their memory
        serves the next one; kept if the pull fails.
      route: "hierarchical" (default: each byte leaves the trainer once per
        subscriber job and is forwarded and fanned out inside it, its processes being
        the domains) or "flat" (every destination device pulls its pieces from the
        trainer).
      timeout_s: bound on each wait: for a version, for the publisher's answers and
        for the bytes to arrive (default 300 s).
      delta: False (default) or True: the version crosses as only the elements whose
        wire-dtype bits changed since this subscriber's last pull (per chunk of 16 Ki
        elements nothing, a bitmap or index runs with the changed values, or the
        dense chunk: whichever is smallest), applied to that pull's result (in place
        when `donate` is it, off CPU; on CPU to copies of its shards, the donated ones
        then deleted). The result is bitwise what a full pull returns. A full copy
        instead (as delta=False) when there is no earlier delta=True pull, the
        published layouts, dst layouts or dtypes changed, a leaf is quantized, or
        the previous arrays were deleted or donated elsewhere; chunks whose base
        version the publisher no longer holds (beyond `keep`) cross dense. A delta
        pull runs the flat route's pieces (each box once per process). "auto": per
        leaf, delta where it is measured to pay (the leaf's change fraction, the
        link's rate from earlier full pulls, the publisher's encode and this
        process's apply costs), else full: never slower than full by the model.
        docs/jobs.md ("Delta sync") has the rule and the measurements.

      path: "auto" (default): where every publisher process runs on this host (same
        kernel, network namespace and user), the version is read straight from the
        publisher's memory (shared memory on CPU, CUDA IPC on GPUs: one copy into the
        result, no socket); elsewhere it crosses the network. "local" or "network"
        forces one ("local" is an error where it cannot be). A local pull ignores
        `route`, `delta` (it copies at memory speed) and relays.

    Returns:
      The pytree: the published structure where it is made of dicts, lists, tuples
      and None (or dst's own where dst is a whole tree), of jax.Arrays (QArrays for
      quantized leaves).

    Raises:
      ReshardValueError / ReshardTypeError: dst or dtype that do not fit the published
        pytree (structure, shapes, devices), a version no longer held; before any byte
        moves.
      ReshardTimeoutError: no version (newer than the last pull, or the one asked)
        within timeout_s, or bytes that did not arrive in time.
      ReshardRuntimeError: the publisher died or closed (named, within 2 s of it), a
        transfer failed, another process of this job failed the pull.
    """
    api = "Subscriber.pull"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, route=route, timeout_s=timeout_s, version=version,
                           delta=delta, path=path)
    return self._watch.pull(self._state, lambda: pulling.pull(
        self._state, dst, dtype, donate, options))


def _shut(state: pulling.State) -> None:
  """A subscriber's close (at most once: weakref.finalize)."""
  if state.relay is not None:
    state.relay.close(state.connections.live_root(), pulling.ANSWER_S)
  state.close()
