"""Relay membership: who forwards a version to whom, on the trainer's process 0.

Owns the `Coordinator`: per (version, group), the members in the order they joined and
whom each pulls from (a chain, or a tree of a given fanout), their children, re-routes
around dead members, leaves, and closing a relay when its version is dropped or the
group starts a newer one. Driven by the publisher's server thread (it hands over the
relay calls and ticks it). Knows no arrays, transports or plans (relay.py is a
member's data path).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import time
from typing import Any, Callable

from jax_m2n._src.jobs import channel, messages

logger = logging.getLogger("jax_m2n")

# The control calls a Coordinator answers (the publisher hands them over).
OPS = ("relay_join", "relay_children", "relay_reroute", "relay_done", "relay_leave")
MAX_FANOUT = 8
# Bounds on the coordinator's state (a member is a few hundred bytes).
MAX_RELAYS = 256
MAX_MEMBERS = 1024


@dataclasses.dataclass
class _Entry:
  member: str
  address: str
  upstream: str | None
  slot: int
  children: list[tuple[str, int]] = dataclasses.field(default_factory=list)
  done: bool = False
  dead: bool = False


@dataclasses.dataclass
class _Relay:
  salt: str
  fanout: int
  members: dict[str, _Entry] = dataclasses.field(default_factory=dict)
  closed: bool = False


class Coordinator:
  """Who relays to whom, per (version, group): run by the publisher's server thread
  (process 0), which hands it the relay calls and ticks it.

  A member joins when it starts pulling a version; it is the child of the first member
  (in joining order) that is alive, not leaving and has a free slot (fanout 1: the
  chain's tail), or, if none, of the trainer. A relay closes when its version is no
  longer held, or when the same group starts relaying a newer version (later pulls of
  the old one go straight to the trainer): members then stop waiting for children.
  """

  def __init__(self, held: Callable[[], list[int]]):
    self._held = held
    self._relays: collections.OrderedDict[tuple[int, str], _Relay] = (
        collections.OrderedDict())
    self._leaving: set[str] = set()
    self._polls: list[tuple[channel.Caller, tuple[int, str], str, int, float]] = []

  def handle(self, caller: channel.Caller, body: dict[str, Any]) -> None:
    op = body["op"]
    if op == "relay_leave":
      member = messages.field(body, "member", str, max_len=32)
      # The versions it still forwards (absent: every one): its children of those that
      # have not said they are done.
      versions = (set(messages.int_list(body["versions"], "relay_leave: field 'versions'",
                                        1, 1 << 62, MAX_RELAYS))
                  if "versions" in body else None)
      self._leaving.add(member)
      if len(self._leaving) > MAX_MEMBERS:
        self._leaving.pop()
      pending = sum(1 for (v, _), r in self._relays.items() if not r.closed
                    and (versions is None or v in versions)
                    for e in r.members.values() if e.upstream == member
                    and not (e.done or e.dead))
      caller.reply({"pending": pending})
      return
    key = (messages.field(body, "version", int, lo=1, hi=1 << 62),
           messages.field(body, "group", str, max_len=32))
    member = messages.field(body, "member", str, max_len=32)
    if op == "relay_join":
      caller.reply(self._join(key, member, body))
      return
    relay = self._relays.get(key)
    entry = relay.members.get(member) if relay is not None else None
    if entry is None:
      caller.reply({"error": "relay: the member must have joined this version's relay; "
                    "got an unknown one.", "kind": "value"})
    elif op == "relay_children":
      known = messages.field(body, "known", int, lo=0, hi=MAX_MEMBERS)
      wait_ms = messages.field(body, "wait_ms", int, lo=0, hi=60_000)
      self._polls.append((caller, key, member, known, time.monotonic() + wait_ms / 1000))
    elif op == "relay_reroute":
      upstream = messages.field(body, "upstream", str, max_len=32)
      if entry.upstream == upstream and upstream in relay.members:
        relay.members[upstream].dead = True
        logger.info("jax_m2n relay: version %d: member %s lost its upstream %s; it "
                    "pulls the rest from the trainer", key[0], member, upstream)
      entry.upstream = None
      caller.reply({"upstream": None})
    else:  # relay_done
      entry.done = True
      caller.reply({})
    self.tick()

  def _join(self, key: tuple[int, str], member: str, body: dict[str, Any]
            ) -> dict[str, Any]:
    address = messages.field(body, "address", str, max_len=256)
    fanout = messages.field(body, "fanout", int, lo=1, hi=MAX_FANOUT)
    version, group = key
    if version not in self._held():
      return {"error": f"version {version} must be held to be relayed.", "kind": "gone"}
    relay = self._relays.get(key)
    if relay is None:
      if any(v > version for v, g in self._relays if g == group):
        return {"direct": True}  # the group relays a newer version now
      for (v, g), old in self._relays.items():
        if g == group:
          old.closed = True
      relay = self._relays[key] = _Relay(secrets.token_hex(16), fanout)
      while len(self._relays) > MAX_RELAYS:
        self._relays.popitem(last=False)
    if relay.closed or len(relay.members) >= MAX_MEMBERS or relay.fanout != fanout:
      return {"direct": True}
    old = relay.members.get(member)
    if old is not None:  # a retry of the same pull: it keeps its place
      up = relay.members.get(old.upstream) if old.upstream else None
      return {"salt": relay.salt, "upstream": None if up is None else
              [up.member, up.address], "slot": old.slot}
    up = next((e for e in relay.members.values()
               if not e.dead and e.member not in self._leaving
               and len(e.children) < relay.fanout), None)
    slot = 0
    if up is not None:
      slot = len(up.children)
      up.children.append((member, slot))
    relay.members[member] = _Entry(member, address, up.member if up else None, slot)
    return {"salt": relay.salt, "upstream": None if up is None else
            [up.member, up.address], "slot": slot}

  def tree(self) -> list[dict[str, Any]]:
    """Per relay (version, group), oldest first: its members in joining order, whom
    each pulls from (None: the trainer) and its state; no salts (what `status` shows).
    On the server thread, as every other call."""
    return [{"version": v, "group": g, "fanout": r.fanout, "closed": r.closed,
             "members": [{"member": e.member, "address": e.address,
                          "upstream": e.upstream, "children": [c for c, _ in e.children],
                          "done": e.done, "dead": e.dead,
                          "leaving": e.member in self._leaving}
                         for e in r.members.values()]}
            for (v, g), r in self._relays.items()]

  def tick(self, closing: bool = False) -> None:
    """Answers the children polls that have news, expired or whose relay closed; drops
    the relays of versions no longer held."""
    held = set(self._held())
    for key in [k for k in self._relays if k[0] not in held]:
      del self._relays[key]
    now = time.monotonic()
    keep = []
    for caller, key, member, known, deadline in self._polls:
      relay = self._relays.get(key)
      closed = closing or relay is None or relay.closed
      children = relay.members[member].children if relay is not None else []
      if closed or len(children) > known or now >= deadline:
        caller.reply({"children": [list(c) for c in children], "closed": closed})
      else:
        keep.append((caller, key, member, known, deadline))
    self._polls = keep
