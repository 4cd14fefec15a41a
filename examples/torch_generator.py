r"""A JAX trainer feeding a PyTorch generator: `jax_m2n.Publisher` -> `jax_m2n.torch`.

This program is the trainer: a small gated-MLP language-model policy in JAX, sharded
over its devices, trained a step at a time on a toy next-token task; after each step it
publishes the new version. A second program it starts (this file with --generator, a
PyTorch process: its weights are torch tensors, its policy a torch module) pulls each
version into its own tensors, in place, in torch's conventions: the JAX (in, out)
kernels transposed into torch (out, in) weights, the gate and up kernels fused into one
`gate_up` weight as vLLM's MergedColumnParallelLinear holds it. It then samples from
its policy. Each step the generator checks its weights equal the trainer's bitwise
(digests of the trainer's bytes) and that its logits on a fixed batch agree with the
trainer's JAX logits within float tolerance, and times the sync against torch's own
copy of the same bytes.

Usage (from the repository root):
  JAX_M2N_EXAMPLE=torch_generator ./scripts/run_example.sh   # installs requirements/torch.txt
  python examples/torch_generator.py --steps=10 --d_model=256 --layers=4
The last line: `torch generator: N steps, weights bitwise: True; per-step sync X ms;
torch's own copy of the same bytes Y ms`.
"""

# requirements: torch
# (The requirement sets this example needs beyond the main job's, files of
# requirements/: ./scripts/run_example.sh installs them when it runs this example.)

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

VOCAB = 512


def _digest(x: np.ndarray) -> str:
  return hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).hexdigest()


def _torch_names(path: str):
  """The trainer's leaf (dotted key path) -> the generator's torch parameter."""
  import jax_m2n.torch as jt
  parts = path.split(".")
  if parts[0] == "layers":
    i, k = parts[1], parts[2]
    if k in ("gate", "up"):
      return jt.Into(f"layers.{i}.gate_up.weight", ("gate", "up").index(k), 2, 0,
                     transpose=True)
    return jt.Into(f"layers.{i}.down.weight", transpose=True)
  return "embed.weight" if path == "embed" else jt.Into("head.weight", transpose=True)


# ---------------------------------------------------------------------------------------
# The generator program (torch; JAX only receives the network path's bytes)
# ---------------------------------------------------------------------------------------

def generator_main(address: str, token: str, d: int, f: int, layers: int) -> None:
  import torch
  import jax_m2n.torch as jt

  class Policy(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = torch.nn.Embedding(VOCAB, d)
      self.layers = torch.nn.ModuleList()
      for _ in range(layers):
        m = torch.nn.Module()
        m.gate_up = torch.nn.Linear(d, 2 * f, bias=False)
        m.down = torch.nn.Linear(f, d, bias=False)
        self.layers.append(m)
      self.head = torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens):
      h = self.embed(tokens)
      for m in self.layers:
        g, u = m.gate_up(h).chunk(2, dim=-1)
        h = h + m.down(torch.nn.functional.silu(g) * u)
      return self.head(h)

  policy = Policy().requires_grad_(False)
  tensors = dict(policy.named_parameters())
  sub = jt.Subscriber(address, token=token)
  n = sum(v.numel() for v in tensors.values())
  flat_src, flat_dst = torch.ones(n), torch.empty(n)  # the same bytes, in one buffer
  gen = torch.Generator().manual_seed(0)
  for line in sys.stdin:
    step = json.loads(line)
    if step.get("op") == "exit":
      break
    t0 = time.perf_counter()
    sub.pull_into(tensors, names=_torch_names, version=step["version"], timeout_s=120)
    sync_ms = (time.perf_counter() - t0) * 1e3
    copy_ms = float("inf")
    for _ in range(3):  # torch's own copy of the same bytes (the best of 3)
      t0 = time.perf_counter()
      flat_dst.copy_(flat_src)
      copy_ms = min(copy_ms, (time.perf_counter() - t0) * 1e3)
    # The trainer's bytes, from the torch tensors (undoing the transposes and fusion).
    mine = {"embed": tensors["embed.weight"], "head": tensors["head.weight"].t()}
    for i in range(layers):
      g, u = tensors[f"layers.{i}.gate_up.weight"].chunk(2, dim=0)
      mine.update({f"layers.{i}.gate": g.t(), f"layers.{i}.up": u.t(),
                   f"layers.{i}.down": tensors[f"layers.{i}.down.weight"].t()})
    bitwise = all(_digest(mine[k].contiguous().numpy()) == h
                  for k, h in step["digests"].items())
    tokens = torch.tensor(step["tokens"])
    logits = policy(tokens)
    err = float((logits - torch.tensor(step["logits"])).abs().max())
    sample = torch.multinomial(torch.softmax(logits[0, -1], -1), 4, generator=gen)
    print(json.dumps({"bitwise": bitwise, "max_abs": err, "sync_ms": sync_ms,
                      "copy_ms": copy_ms, "path": sub.last_pull.path,
                      "sample": sample.tolist()}), flush=True)
  sub.close()


# ---------------------------------------------------------------------------------------
# The trainer (this program)
# ---------------------------------------------------------------------------------------

def trainer_main(args) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_m2n

  d, f, layers = args.d_model, 2 * args.d_model, args.layers
  devs = np.array(jax.devices())
  mesh = Mesh(devs[:len(devs) // 2 * 2 or 1].reshape(-1, 2 if len(devs) > 1 else 1),
              ("fsdp", "tp"))
  rng = np.random.default_rng(args.seed)
  shardings = {"embed": P("fsdp", "tp"), "head": P("fsdp", "tp"), "gate": P("fsdp", "tp"),
               "up": P("fsdp", "tp"), "down": P("tp", "fsdp")}

  def put(x, spec):
    return jax.device_put(x.astype(np.float32), NamedSharding(mesh, spec))

  params = {"embed": put(rng.standard_normal((VOCAB, d)) * 0.02, shardings["embed"]),
            "head": put(rng.standard_normal((d, VOCAB)) * d ** -0.5, shardings["head"]),
            "layers": {str(i): {k: put(rng.standard_normal(s) * s[0] ** -0.5, shardings[k])
                                for k, s in (("gate", (d, f)), ("up", (d, f)),
                                             ("down", (f, d)))}
                       for i in range(layers)}}

  def forward(p, tokens):
    h = p["embed"][tokens]
    for i in range(layers):
      lp = p["layers"][str(i)]
      h = h + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
    return h @ p["head"]

  def loss(p, tokens):  # the toy task: the next token is the current one plus 1
    logits = forward(p, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         (tokens[:, 1:] % VOCAB)[..., None], -1))

  @jax.jit
  def train_step(p, tokens):
    value, grads = jax.value_and_grad(loss)(p, tokens)
    return jax.tree.map(lambda w, g: w - args.learning_rate * g, p, grads), value

  token = jax_m2n.new_token()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  with jax_m2n.Publisher(token=token) as pub:
    gen = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--generator",
                            pub.address, token, str(d), str(f), str(layers)], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe = (np.arange(2 * 8).reshape(2, 8) * 37) % VOCAB
    syncs, copies, ok = [], [], True
    try:
      for step in range(args.steps):
        start = rng.integers(0, VOCAB, (args.batch_size, 1))
        tokens = jnp.asarray((start + np.arange(9)) % VOCAB)
        params, value = train_step(params, tokens)
        version = pub.publish(params)
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        digests = {".".join(str(getattr(k, "key", k)) for k in path): _digest(np.asarray(x))
                   for path, x in flat}
        logits = np.asarray(forward(params, jnp.asarray(probe)))
        gen.stdin.write(json.dumps({"version": version, "digests": digests,
                                    "tokens": probe.tolist(),
                                    "logits": logits.tolist()}) + "\n")
        gen.stdin.flush()
        line = gen.stdout.readline()
        if not line:
          raise RuntimeError("torch_generator: the generator program exited")
        got = json.loads(line)
        ok = ok and got["bitwise"] and got["max_abs"] < 1e-3
        syncs.append(got["sync_ms"])
        copies.append(got["copy_ms"])
        print(f"step {step}: loss {float(value):.3f}, version {version} via "
              f"{got['path']}: sync {got['sync_ms']:.1f} ms, bitwise {got['bitwise']}, "
              f"logits max |diff| {got['max_abs']:.1e}, sampled {got['sample']}",
              flush=True)
      gen.stdin.write(json.dumps({"op": "exit"}) + "\n")
      gen.stdin.flush()
      gen.wait(timeout=60)
    finally:
      if gen.poll() is None:
        gen.kill()
  steady = syncs[1:] or syncs
  print(f"torch generator: {args.steps} steps, weights bitwise: {ok}; per-step sync "
        f"{statistics.median(steady):.1f} ms; torch's own copy of the same bytes "
        f"{statistics.median(copies[1:] or copies):.1f} ms")
  if not ok:
    sys.exit(1)


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--generator":
    address, token, d, f, layers = sys.argv[2:7]
    return generator_main(address, token, int(d), int(f), int(layers))
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--d_model", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch_size", type=int, default=16)
  ap.add_argument("--learning_rate", type=float, default=0.5)
  ap.add_argument("--seed", type=int, default=0)
  trainer_main(ap.parse_args())


if __name__ == "__main__":
  main()
