"""`jax_m2n.torch.Subscriber`: a PyTorch process's side of weight sync with a JAX trainer.

Owns the torch subscriber's calls (pull_into, pull, iter_pull, close) and a pull's steps
on one torch rank: the version (the jobs layer's long poll, `pulling.choose`), the
manifest, the targets (targets.resolve: every check before any byte moves), the plan
(planning.plan_rank: reshard's planner), then the data path: on the trainer's host the
export mapped and read with torch copies (copies.copy_local), elsewhere the jobs
protocol's register / pull / fetch (engine.request, the transport) and the packs copied
in (copies.compose). The token, control channel, errors and timeouts are the jobs
layer's; JAX only receives the network path's packs (host memory torch views).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import torch

from jax_m2n._src import checks
from jax_m2n._src.errors import (PlanUnknown, ReshardError, ReshardRuntimeError,
                                 ReshardTypeError, ReshardValueError, Unconfirmed,
                                 VersionGone)
from jax_m2n._src.jobs import auth, engine, exports, lifetime, local
from jax_m2n._src.jobs import manifest as manifest_lib, pulling
from jax_m2n._src.jobs.connections import Connections
from jax_m2n._src.jobs.pull import Pull, wait_arrived
from jax_m2n._src.jobs.request import pull_options
from jax_m2n._src.torch import copies, planning, targets as targets_lib
from jax_m2n._src.torch.targets import TORCH_OF, dotted

_API = "jax_m2n.torch.Subscriber"


def dotted_name(path: str) -> str:
  """The default mapping: a leaf's dotted key path is its torch name."""
  return path


def pieces_shape(pack) -> tuple[int, ...]:
  """What one pack arrives as (engine.pack_spec's rule): its one box's shape, or its
  boxes flattened and concatenated."""
  if len(pack) == 1:
    return tuple(hi - lo for lo, hi in pack[0].box)
  return (sum(math.prod(hi - lo for lo, hi in op.box) for op in pack),)


@dataclasses.dataclass(frozen=True)
class TorchPull:
  """What the last pull did on this rank: its version, data path ("local" or
  "network"), the bytes this rank received (wire dtype; the local path reads them out
  of the trainer's memory), the targets written, its seconds (wall) and their phases:
  `wait_s` (the version's long poll, where it was not overlapped) and `move_s` (the
  bytes' way in, with the answer's confirmation)."""
  version: int
  path: str
  nbytes: int
  targets: int
  seconds: float
  phases: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Request:
  manifest: manifest_lib.Manifest
  options: Any


class Subscriber(lifetime.Closing):
  """Pulls versions a `jax_m2n.Publisher` published into this torch rank's tensors.

  Each rank of the generator (a torch process: one of `world_size` tensor-parallel
  ranks, or the only one) makes its own Subscriber and receives only its own slices
  (reshard's planner over the trainer's layouts; the flat route). On the trainer's
  host the bytes are read with torch copies straight out of the trainer's exported
  memory; elsewhere they cross the network (the jobs protocol, token and transport).
  Results are bitwise `x.astype(dtype)` of the published `x` (conversions among
  float32, float16, bfloat16 and float8 round to nearest even on either path).

  Args:
    address: the Publisher's address ("host:port").
    token: the publisher's token (`jax_m2n.new_token()`); a wrong one raises here.
    rank, world_size: this rank and how many ranks the placements split over.
    timeout_s: how long the publisher may take to answer the handshake.

  Raises:
    ReshardValueError: a wrong or short token, a malformed address or rank.
    ReshardRuntimeError: nothing answered at `address` within `timeout_s`.

  Example:
    >>> sub = jax_m2n.torch.Subscriber(pub.address, token=token, rank=0, world_size=2)  # doctest: +SKIP
    >>> sub.pull_into(model.state_dict(), names=my_names,                # doctest: +SKIP
    ...               placements={"qkv.weight": jax_m2n.torch.Shard(0)})
    3
  """

  def __init__(self, address: str, *, token: Any, rank: int = 0, world_size: int = 1,
               timeout_s: float = 60.0):
    key = auth.as_key(_API, token)
    if (isinstance(rank, bool) or isinstance(world_size, bool)
        or not isinstance(rank, int) or not isinstance(world_size, int)
        or not 0 <= rank < world_size):
      raise ReshardValueError(f"{_API}: rank must be an int in [0, world_size); got "
                              f"rank={rank!r}, world_size={world_size!r}.")
    self.rank, self.world_size = rank, world_size
    connect_s = checks.options(_API, timeout_s=timeout_s).timeout_s
    self._state = pulling.State(Connections(_API, address, key, connect_s))
    self._mapped: dict[tuple[int, str], copies.Mapped] = {}
    self._sources: dict[Any, Any] = {}
    self.last_pull: TorchPull | None = None
    self._waited = 0.0
    self._close_with(_shut, self._state, self._mapped, self._sources)

  @property
  def version(self) -> int:
    """The version of the last successful pull (0 before the first)."""
    return self._state.version

  def pull_into(self, tensors: Mapping[str, torch.Tensor], *,
                names: Callable[[str], Any] = dotted_name,
                placements: Mapping[str, Any] | None = None, version: int | None = None,
                timeout_s: float | None = None, path: str = "auto") -> int:
    """Pulls a version into `tensors` in place; returns its number.

    Args:
      tensors: per torch name, this rank's tensor (its shape: this rank's slice under
        `placements`; its dtype: the delivered one).
      names: maps each published leaf's dotted key path ("layers.0.wq") to a torch
        name (a str), an `Into` (transposed, or one part of a fused q/k/v or gate/up
        tensor), or None (not pulled). Every target needs a leaf; every name given
        must be a target.
      placements: per torch name, `Shard(dim)`, `Replicate()` (default) or
        `Slice(offsets, sizes)` over the `world_size` ranks.
      version, timeout_s, path: as `jax_m2n.Subscriber.pull`'s (the newest after the
        last pull, or that one; the bound on each wait; "auto", "local", "network").

    Raises:
      ReshardValueError / ReshardTypeError: a missing or extra name, a shape or dtype
        that does not fit (naming the parameter), before any tensor is written.
      ReshardTimeoutError: no version in time.
      ReshardRuntimeError: the publisher died or closed (within 2 s); the message and
        the error's `written` name the tensors written before it failed.
    """
    api = f"{_API}.pull_into"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    for n, x in tensors.items():
      if not isinstance(x, torch.Tensor):
        raise ReshardTypeError(f"{api}: every target must be a torch.Tensor; got "
                               f"{type(x).__name__} for {n!r}.")
    options = pull_options(api, timeout_s=timeout_s, version=version, path=path)
    dtypes = {n: x.dtype for n, x in tensors.items()}
    shapes = {n: tuple(x.shape) for n, x in tensors.items()}
    return self._pull(api, options, names, dict(placements or {}), dtypes, shapes,
                      lambda ts: [tensors[t.name] for t in ts])

  def pull(self, *, names: Callable[[str], Any] = dotted_name,
           placements: Mapping[str, Any] | None = None, dtype: Any = None,
           version: int | None = None, timeout_s: float | None = None,
           path: str = "auto", device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Pulls a version into new tensors: {torch name: this rank's tensor} for every
    name `names` gives (arguments as `pull_into`'s; `dtype`: None for the published
    dtype, a torch dtype, or per name a mapping; `device`: where they are made)."""
    api = f"{_API}.pull"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, timeout_s=timeout_s, version=version, path=path)
    made: dict[str, torch.Tensor] = {}

    def alloc(ts):
      for t in ts:
        made[t.name] = torch.empty(t.shape, dtype=t.dtype, device=device)
      return [made[t.name] for t in ts]

    self._pull(api, options, names, dict(placements or {}), dtype, None, alloc)
    return made

  def published(self, *, version: int | None = None, timeout_s: float | None = None
                ) -> tuple[int, list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """What a version is made of, without pulling it: (its number, per leaf its
    dotted name, global shape and torch dtype). Without `version`, the newest
    published after the last pull (waiting up to `timeout_s`); pull it with
    `version=` that number."""
    api = f"{_API}.published"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, timeout_s=timeout_s, version=version)
    number, mid = pulling.choose(self._state, options)
    m = self._manifest(mid)
    return number, [(dotted(l.path), tuple(l.shape),
                     TORCH_OF.get(manifest_lib.dtype_of(l.dtype))) for l in m.leaves]

  def iter_pull(self, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """`pull`'s tensors as (name, tensor) pairs, for a model's `load_weights`."""
    return iter(self.pull(**kwargs).items())

  def close(self) -> None:
    """Closes the connections and unmaps the exports (also at `with`'s end and when
    the last reference goes)."""
    super().close()

  # -------------------------------------------------------------------------------------

  def _pull(self, api, options, names, placements, dtypes, shapes, tensors_of) -> int:
    state = self._state
    deadline = time.monotonic() + options.timeout_s
    while True:
      started = time.monotonic()
      got = None
      ahead = pulling.Ahead.begin(state, options) if state.path == "local" else None
      if ahead is not None:  # the copy runs while the publisher confirms the version
        try:
          return self._attempt(api, options, names, placements, dtypes, shapes,
                               tensors_of, ahead.number, ahead.mid, started, ahead)
        except (Unconfirmed, VersionGone):
          got = ahead.answer()  # the publisher's word (raises where it closed or died)
        except BaseException:
          ahead.drain()
          raise
      elif (options.path != "local" and options.version is None
          and state.net_mid in state.manifests and state.path == "network"):
        # A steady network pull: the newest after the last one and its bytes in one
        # message (answered within 1.5 s: a dead publisher is named that fast).
        try:
          return self._attempt(api, options, names, placements, dtypes, shapes,
                               tensors_of, None, state.net_mid, started)
        except Unconfirmed as e:
          got = e.got  # a newer version of another layout set, or none yet
      if got is None:
        waited = time.monotonic()
        number, mid = pulling.choose(state, options, deadline)
        self._waited = time.monotonic() - waited
      else:
        number, mid = got
      try:
        return self._attempt(api, options, names, placements, dtypes, shapes,
                             tensors_of, number, mid, started)
      except VersionGone:
        if options.version is not None:
          raise
        # dropped while we read it: the next newest

  def _attempt(self, api, options, names, placements, dtypes, shapes, tensors_of,
               number: int | None, mid: str, started: float, ahead: Any = None) -> int:
    """Pulls version `number` of layout set `mid` (None: the newest after the last
    pull, named by the publisher's answer: the network path only)."""
    state = self._state
    m = self._manifest(mid)
    want = dtypes if isinstance(dtypes, dict) else _dtypes_of(api, m, names, dtypes)
    ts = targets_lib.resolve(api, m, names, placements, want, shapes, self.rank,
                             self.world_size)
    rp = planning.plan_rank(api, m, ts, self.rank, self.world_size)
    tensors = tensors_of(ts)
    written: list[str] = []
    moved = time.monotonic()
    try:
      p = "network"
      if number is not None and self._local_path(api, options, m):
        mapped = self._imports(api, options, m, rp, ahead is not None)
        if mapped is not None:
          p = "local"
          self._run_local(api, options, m, rp, mapped, number, tensors, written)
          if ahead is not None and not ahead.confirmed():
            raise Unconfirmed  # (a valid version, but not the one to return)
        elif ahead is not None:
          raise Unconfirmed
      if p == "network":
        number = self._run_network(api, options, m, rp, number, tensors, written)
    except (VersionGone, Unconfirmed):
      raise
    except ReshardError as e:
      msg = (f"{e} Tensors written before the failure: {written or 'none'} (the "
             "others hold what they held).")
      err = type(e)(msg)
      err.written = list(written)
      raise err from e
    state.version = max(state.version, number)
    state.path = p
    if p == "network":
      state.net_mid = m.id
    else:
      state.local_mid = m.id
    total = time.monotonic() - started
    self.last_pull = TorchPull(number, p, rp.nbytes, len(ts), total,
                               {"wait_s": getattr(self, "_waited", 0.0),
                                "move_s": time.monotonic() - moved})
    self._waited = 0.0
    return number

  def _manifest(self, mid: str) -> manifest_lib.Manifest:
    m = self._state.manifests.get(mid)
    if m is None:
      reply = self._state.connections.root().call({"op": "manifest", "id": mid},
                                                  pulling.REQUEST_S, "a manifest")
      m = manifest_lib.from_json(reply.get("manifest"))
      if m.id != mid:
        raise ReshardRuntimeError(f"{_API}: the manifest must match its id; got another.")
      if len(self._state.manifests) >= pulling.MAX_MANIFESTS:
        self._state.manifests.pop(next(iter(self._state.manifests)))
      self._state.manifests[mid] = m
    return m

  def _local_path(self, api: str, options, m: manifest_lib.Manifest) -> bool:
    if options.path == "network":
      return False
    here = exports.host_identity()
    elsewhere = [k for k, (_, _, host, _) in enumerate(m.processes)
                 if not here or host != here]
    if options.path == "local" and elsewhere:
      raise ReshardValueError(f"{api}: path='local' needs every publisher process on "
                              f"this host; got trainer process(es) {elsewhere[:8]} "
                              "elsewhere.")
    return not elsewhere

  def _imports(self, api, options, m, rp, ahead: bool = False
               ) -> dict[int, copies.Mapped] | None:
    """The exports this rank reads, mapped (once per layout set and publisher
    process, kept in `State.imports`); None where one declines (the network then)."""
    out = {}
    imports = self._state.imports
    procs = sorted({m.devices[k] for boxes in rp.boxes.values() for k, _ in boxes})
    for p in procs:
      mp = self._mapped.get((p, m.id))
      if mp is None or imports.get((p, m.id)) is not mp.imp:
        if ahead:
          raise Unconfirmed  # (mapping is a control call: not while one is open)
        link = self._state.connections.link(p, m)
        reply = link.client.call(local.describe_request(m.id),
                                 max(pulling.REQUEST_S, options.timeout_s),
                                 "the local export")
        if not reply.get("local") or reply.get("handles"):
          if options.path == "local":
            raise ReshardValueError(f"{api}: path='local' needs {link.name} to export "
                                    f"host memory; it declined: {reply.get('why')}.")
          return None
        self._sources.clear()
        while len(imports) >= pulling.MAX_MANIFESTS:
          key = next(iter(imports))
          imports.pop(key).close()
          self._mapped.pop(key, None)
        imp = imports[(p, m.id)] = local.Import(reply, link.name)
        mp = self._mapped[(p, m.id)] = copies.Mapped(imp)
      out[p] = mp
    return out

  def _run_local(self, api, options, m, rp, mapped, number, tensors, written) -> None:
    deadline = time.monotonic() + min(local.COMMIT_WAIT_S, options.timeout_s)
    slots = {p: mp.imp.slot_of(number, deadline) for p, mp in mapped.items()}
    for p, mp in mapped.items():
      if not mp.imp.alive():
        raise ReshardRuntimeError(f"{api}: {mp.imp.name} must be alive to be read from; "
                                  "it exited.")
    key = (id(rp), tuple(sorted((p, id(mp), s) for (p, mp), s in
                                zip(mapped.items(), slots.values()))))
    sources = self._sources.get(key)
    if sources is None:
      if len(self._sources) > 64:
        self._sources.clear()
      sources = self._sources[key] = (rp, copies.local_sources(rp, m, mapped, slots))
    copies.copy_local(sources[1], tensors, [t.name for t in rp.targets], written)
    for p, mp in mapped.items():  # the seqlock's second read
      if int(mp.imp.header[slots[p]]) != number:
        raise VersionGone(f"{api}: version {number} was overwritten on {mp.imp.name} "
                          "while it was copied.")

  def _run_network(self, api, options, m, rp, number, tensors, written) -> int:
    conn = self._state.connections
    transport = conn.transport(m)
    links = {k: conn.link(k, m) for k in rp.requests}
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    where = copies.where_leaves(rp)
    touched: set[int] = set()
    for attempt in range(2):
      pull = Pull(_Request(m, options), rp, number, links, transport,
                  after=self._state.version)
      if number is None and (len(rp.requests) != 1 or not transport.early_fetch or
                             engine.plan_key(rp) not in links[next(iter(links))].plans):
        raise Unconfirmed  # (a first pull of this plan, or from several processes)
      try:
        tickets, opened = engine.request(pull, max(pulling.REQUEST_S, options.timeout_s))
        if not transport.early_fetch:
          engine.confirm(pull, opened, max(pulling.REQUEST_S, options.timeout_s))
        pending = []
        for k, groups in rp.packed_requests.items():
          for ticket, packs in zip(tickets[k], groups):
            specs = [jax.ShapeDtypeStruct(
                pieces_shape(pack), rp.wire[pack[0].tensor], sharding=cpu)
                for pack in packs]
            pending.append((links[k].name, packs, transport.fetch(
                links[k].address, ticket, specs, timeout_s=options.timeout_s)))
        if transport.early_fetch:  # (a pull of the newest: bounded by 1.5 s)
          engine.confirm(pull, opened, max(pulling.REQUEST_S, options.timeout_s))
        for name, packs, fetch in pending:
          [arrays] = wait_arrived(pull, [(name, fetch)], "the pieces")
          copies.compose(packs, arrays, where, tensors, touched)
          written[:] = [rp.targets[i].name for i in sorted(touched)]
        return pull.number
      except PlanUnknown:
        if attempt:
          raise


def _dtypes_of(api: str, m: manifest_lib.Manifest, names, dtype) -> dict[str, torch.dtype]:
  """Per torch name the mapping gives, the dtype delivered: `dtype` (one, or per name),
  else the published dtype of its first part."""
  out: dict[str, torch.dtype] = {}
  for leaf in m.leaves:
    into = names(dotted(leaf.path))
    name = into if isinstance(into, str) else getattr(into, "name", None)
    if name is None or name in out:
      continue
    d = dtype.get(name) if isinstance(dtype, Mapping) else dtype
    if d is None:
      d = TORCH_OF.get(manifest_lib.dtype_of(leaf.dtype))
    if not isinstance(d, torch.dtype):
      raise ReshardTypeError(f"{api}: dtype must be None, a torch.dtype or a mapping of "
                             f"them; got {d!r} for {name!r}.")
    out[name] = d
  return out


def _shut(state: pulling.State, mapped: dict, sources: dict) -> None:
  sources.clear()
  mapped.clear()
  state.close()  # (closes the imports)
