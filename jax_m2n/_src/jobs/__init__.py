"""Separate jobs: a trainer job publishes versions of a pytree, generator jobs pull them.

The two sides share no `jax.distributed` cluster; they meet at an address. One concern
per module, one way (messages <- auth <- channel <- publisher / subscriber):
  messages.py   the control messages: a versioned JSON format, size limits, schemas;
  auth.py       the token: challenge-response, session keys, per-message MACs;
  channel.py    the zmq endpoints (a server loop, a client with bounded requests);
  manifest.py   what a version is made of: paths, shapes, dtypes, layouts, addresses;
  planning.py   a pull's plan (the publisher's layouts -> the dst layouts), cached;
  publisher.py  `Publisher`: snapshots, the server, cutting pieces for the engine;
  subscriber.py `Subscriber`: versions, checks, the pull's lifecycle;
  engine.py     a subscriber process's part of a plan: pulls from the publisher's
                transfer servers, forwards and fan-out inside its job;
  delta.py      delta sync: the change test, the per-chunk encoding, both sides of a
                delta pull and the subscriber's base.
  relay.py      relays among one-process subscriber jobs: who forwards a version to
                whom (on the publisher), chunks, forwarding, re-routing.
It never plans except through the planner, and reads shardings only through
`Layout.from_sharding`; the bytes move through JAX's transfer server.
"""
