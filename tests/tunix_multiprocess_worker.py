"""One process of tests/tunix_multiprocess_test.py: tunix's reshard_pytree with the adapter
installed, trainer weights (the toy transformer's every nnx.Param) on process 0's CPU
devices, the rollout's on process 1's, three syncs under tunix's transfer guard.

Not a test by itself. Usage, one per process, started together:
  python tests/tunix_multiprocess_worker.py PROCESS_ID PORT [fsdp2xtp2|fsdp4]
Prints "RESULT process=I step=S ... bitwise=B" per sync and "DONE process=I ok=B";
exits non-zero on a mismatch.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pid, port = int(sys.argv[1]), int(sys.argv[2])
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
import numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tunix.rl import reshard as tunix_reshard
from tunix.tests import test_common as tc
from jax_m2n.integrations import tunix as m2n_tunix

m2n_tunix.install()
devs = jax.devices()
p0 = [d for d in devs if d.process_index == 0]
p1 = [d for d in devs if d.process_index == 1]
layout = sys.argv[3] if len(sys.argv) > 3 else "fsdp2xtp2"
fsdp = {"fsdp2xtp2": 2, "fsdp4": 4}[layout]
trainer = Mesh(np.array(p0).reshape(fsdp, 4 // fsdp), ("fsdp", "tp"))
rollout = Mesh(np.array(p1).reshape(1, 4), ("fsdp", "tp"))
config = tc.ModelConfig(vocab_size=tc.MockVocab().GetPieceSize())
abstract = nnx.eval_shape(lambda: tc.ToyTransformer(config=config, rngs=nnx.Rngs(0)))
state = nnx.state(abstract, nnx.Param)
specs = nnx.get_partition_spec(state)
leaves, treedef = jax.tree.flatten(state)
spec_leaves = treedef.flatten_up_to(specs)
spec_leaves = [s if isinstance(s, P) else P() for s in spec_leaves]
rng = np.random.default_rng(0)
hosts = [rng.standard_normal(l.shape).astype(l.dtype) for l in leaves]

def put(host, sharding):
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i], dtype=host.dtype)

dst_shardings = jax.tree.unflatten(treedef, [NamedSharding(rollout, s) for s in spec_leaves])
ok = True
for step in range(3):
  src = jax.tree.unflatten(treedef, [put(h * (step + 1), NamedSharding(trainer, s))
                                    for h, s in zip(hosts, spec_leaves)])
  start = time.perf_counter()
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    out = jax.block_until_ready(tunix_reshard.reshard_pytree(src, dst_shardings))
  secs = time.perf_counter() - start
  for o, h, s in zip(jax.tree.leaves(out), hosts, spec_leaves):
    want = h * (step + 1)
    assert o.sharding == NamedSharding(rollout, s), (o.sharding, s)
    idx = o.sharding.addressable_devices_indices_map(h.shape)
    for sh in o.addressable_shards:
      if not np.array_equal(np.asarray(sh.data).view(np.uint8), want[idx[sh.device]].view(np.uint8)):
        ok = False
  print(f"RESULT process={pid} step={step} leaves={len(leaves)} seconds={secs:.4f} "
        f"bitwise={ok} local_out_shards={sum(len(o.addressable_shards) for o in jax.tree.leaves(out))}",
        flush=True)
print(f"DONE process={pid} ok={ok} reshard_calls={m2n_tunix.reshard_count()}", flush=True)
sys.exit(0 if ok else 1)
