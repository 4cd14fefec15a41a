"""PyTorch generators: a JAX trainer's published versions pulled into torch tensors.

One concern per module, dependencies one way (each line uses only the lines above it):
  targets.py     what a torch rank holds (Shard / Replicate / Slice placements, the
                 name mapping's Into), resolved against a manifest, checked;
  planning.py    a rank's plan: reshard's planner from the publisher's layouts to the
                 rank's boxes, in the jobs protocol's terms;
  copies.py      the torch copies of both data paths (the mapped export; the packs a
                 network fetch delivered);
  pull.py        one pull on a torch rank (version, manifest, targets, plan, data
                 path), and what a Subscriber holds between pulls;
  subscriber.py  `Subscriber`, the torch rank's API.
Imported only through `jax_m2n.torch` (importing jax_m2n never imports torch). Uses the
jobs layer's control channel, token, manifests, exports and transports as they are.
"""
