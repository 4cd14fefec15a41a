"""Separate jobs: a trainer job publishes versions of a pytree, generator jobs pull them.

The two sides share no `jax.distributed` cluster; they meet at an address. One concern
per module, dependencies one way (each line uses only the lines above it):
  messages.py    the control messages: a versioned JSON format, size limits, schemas;
  records.py     what a person can see, as values: PullRecord, PullFailure,
                 PublisherStats; a pull's Trace (its phases, as pulling.py laps them);
  auth.py        the token: its rules, new_token, the CurveZMQ keys derived from it;
  handshake.py   before authentication: the ZAP gate, per-address budgets, named
                 handshake failures;
  outbox.py      what a control server sends: replies and notices posted from any
                 thread, queued, sent by the server thread;
  exchange.py    a control client's messages: requests sent in chunks, replies read
                 back (their errors raised by kind), notices kept aside;
  channel.py     the zmq endpoints (a CURVE server loop, a client with bounded
                 requests and notices);
  transport.py   the transport interface (offer / fetch / cancel arrays between
                 processes), JAX's transfer server behind it: the one seam bytes
                 cross between processes;
  net/           the "net" transport: our own over ZeroMQ (bounded, optionally
                 CurveZMQ-encrypted), for bytes that cross a network;
  transports.py  the registry of transport kinds, one per (kind, host) and process;
  exports.py     a publisher process's versions in memory a reader on its host maps
                 (keep slots per layout set, a seqlock header);
  manifest.py    what a version is made of: paths, shapes, dtypes, layouts, addresses;
  request.py     a pull as values: PullOptions (reshard's Options extended) and the
                 checked PullRequest (reshard's rules: checks.py);
  planning.py    a pull's plan (call_plan.plan_call, reshard's), cached;
  connections.py a subscriber process's control clients and transport;
  pull.py        one pull in flight (`Pull`), passed whole to what moves its bytes;
  pieces.py      the compiled programs that cut, pack and compose boxes;
  engine.py      a full pull on a subscriber process: waves, forwards, compose;
  local.py       a pull on the publisher's host: its exports read in place;
  codec.py       the delta codec: change test, encoding, decoding, applying;
  delta.py       delta sync's requests: serving (publisher) and pulling (subscriber);
  membership.py  relays: who forwards a version to whom (on the publisher);
  relay.py       relays: a member's data path (chunks, forwarding, re-routing);
  versions.py    a publisher process's held versions (snapshots, manifests);
  counters.py    a publisher process's counts as it answers, and its PublisherStats;
  status.py      the `status` call: its answer, the asking side, the summary;
  metrics.py     Prometheus metrics in a registry the user passes (optional);
  offering.py    a publisher process's offers: plans registered, pieces cut and offered;
  serving.py     a publisher process's answers to subscribers (server thread);
  lifetime.py    how both ends close (close(), with, garbage collection);
  publisher.py   `Publisher`, the trainer's API;
  pulling.py     a pull's lifecycle (version, manifest, plan, data path, result);
  watch.py       a subscriber's records of its pulls, their log lines and metrics;
  subscriber.py  `Subscriber`, the generator's API.
It never plans except through call_plan, reads shardings only through
`Layout.from_sharding`, checks arguments with checks.py's rules, and moves bytes only
through transport.py.
"""
