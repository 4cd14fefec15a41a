r"""RL weight refit with jax_m2n: a small policy learns to reverse digit strings.

The trainer updates a decoder-only transformer in float32, in its layout (default FSDP
x TP on one half of the devices); before every rollout `jax_m2n.reshard(params, dst,
dtype=...)` moves the whole parameter pytree, in one call, into the generator's layout
(default TP x DP on the other half) and dtype (bfloat16, or float8_e4m3fn), converting
on the way; with --quantize the linear kernels arrive as block-scaled FP8 QArrays
(`dtype=jax_m2n.Quantize(...)` in the pytree prefix of dtypes: quantized on the trainer,
FP8 values and scales on the wire) and the rollout dequantizes them in its matmuls;
jitted sampling then answers a batch of prompts. With --overlap (the
default) the refit runs behind the host's work that needs no new weights. Owns the demo
loop only: weights reach the generator through `jax_m2n.reshard` alone (`astype` +
`jax.device_put` runs only at the end, as the baseline it is timed against).

Usage (from the repository root; without a GPU it runs on 8 CPU devices):
  python -m examples.rl_refit                                   # fsdp2xtp2->tp2xdp2
  python -m examples.rl_refit --generator_dtype=float8_e4m3fn --nooverlap
  python -m examples.rl_refit --quantize=fp8       # FP8 kernels with 2-D tile scales
  python -m examples.rl_refit --layouts='fsdp4->tp2xdp2@same' --route=flat
  python -m examples.rl_refit --generator_mesh=data=2,model=2 \
      --generator_specs=batch=data,hidden=model,vocab=model
"""

from jax_m2n.testing import workers  # before JAX starts its backend

workers.default_to_cpu_devices()

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools
import itertools
import json
import math
import re
import sys
import time
from typing import Any, Optional

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import jax_m2n
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:  # rich draws the progress bar; plain lines are printed without it.
  import rich.progress
except ImportError:
  rich = None

ROUTES = ("hierarchical", "flat", "gather_bcast")
# Layout presets named in the docs; --layouts accepts any name of the same grammar.
PRESETS = ("fsdp2xtp2->tp2xdp2", "fsdp4->tp4", "tp2->tp2xdp2", "fsdp4->tp2xdp2@same")
# What each conventional mesh axis shards: logical axes of parameters and of the batch.
AXIS_ROLES = {"fsdp": ("batch", "model"), "tp": ("hidden", "vocab"), "dp": ("batch",)}
LOGICAL_AXES = ("batch", "model", "hidden", "vocab")
# Logical axes of each parameter, by leaf name (see init_params).
PARAM_AXES = {
    "embed": ("vocab", "model"), "pos": (None, "model"),
    "ln1": ("model",), "wq": ("model", "hidden"), "wk": ("model", "hidden"),
    "wv": ("model", "hidden"), "wo": ("hidden", "model"),
    "ln2": ("model",), "w1": ("model", "hidden"), "w2": ("hidden", "model"),
    "ln_f": ("model",), "unembed": ("model", "vocab"),
}
NUM_DIGITS = 10
SEP = NUM_DIGITS      # token between prompt and answer
VOCAB = 16            # 10 digits + SEP, padded so TP up to 16 divides it
# The generator's weight dtypes (the trainer keeps float32; float32 here: no conversion).
GENERATOR_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")
# --quantize: the kernels the generator receives quantized (the rest: --generator_dtype).
QUANTIZE = ("none", "fp8", "mxfp8")
KERNELS = ("wq", "wk", "wv", "wo", "w1", "w2")
TIMING_BLOCK = 5      # RL steps per timed block in the overlap comparison


def _option(default, help_text, choices=None):
  return dataclasses.field(default=default,
                           metadata={"help": help_text, "choices": choices})


@dataclasses.dataclass(frozen=True)
class RefitConfig:
  """Everything a run needs; each field is also a command-line flag."""
  layouts: str = _option(
      PRESETS[0], "trainer->generator layouts: mesh axes fsdp/tp/dp with sizes joined "
      "by 'x', '@same' puts the generator on the trainer's devices. Presets: "
      + ", ".join(PRESETS) + ".")
  trainer_mesh: str = _option(
      "", "explicit trainer mesh 'name=size,...' (replaces the preset's; devices "
      "must suffice, no fitting)")
  generator_mesh: str = _option("", "explicit generator mesh 'name=size,...'")
  trainer_specs: str = _option(
      "", "explicit trainer sharding rules 'logical=mesh_axis[+mesh_axis],...' over "
      "logical axes " + "/".join(LOGICAL_AXES) + " ('logical=' replicates); "
      "default: by axis name, " + ", ".join(
          f"{k}: {'+'.join(v)}" for k, v in AXIS_ROLES.items()))
  generator_specs: str = _option("", "explicit generator sharding rules, as above")
  devices_per_side: int = _option(
      0, "devices each side may use (0: half of all, or all with @same); a preset "
      "layout larger than that is halved from its rightmost axis")
  route: str = _option(ROUTES[0], "jax_m2n.reshard route", ROUTES)
  generator_dtype: str = _option(
      GENERATOR_DTYPES[0], "the generator's weight dtype; the refit converts the "
      "trainer's float32 weights on the way (jax_m2n.reshard(..., dtype=)); 8-bit "
      "weights are widened to bfloat16 where the generator uses them",
      GENERATOR_DTYPES)
  quantize: str = _option(
      "none", "quantize the linear kernels (" + ", ".join(KERNELS) + ") in the refit: "
      "fp8 (float8_e4m3fn, square tiles of up to 128 with bfloat16 scales, "
      "DeepSeek-style), mxfp8 (tiles of 32 along the input axis, power-of-two scales); "
      "they arrive as qwix QArrays (jax_m2n.QuantizedArray without qwix) and the "
      "rollout dequantizes them in its matmuls", QUANTIZE)
  overlap: bool = _option(
      True, "overlap the refit with the work that needs no new weights (drawing the "
      "step's prompts, enqueueing the generation) instead of waiting for it; the "
      "timing at the end measures both ways")
  layers: int = _option(2, "transformer layers")
  d_model: int = _option(64, "model width")
  heads: int = _option(4, "attention heads")
  d_ff: int = _option(0, "MLP width (0: 4 * d_model)")
  digits: int = _option(5, "digits per prompt (the answer reverses them)")
  batch_size: int = _option(512, "sampled answers per step")
  group_size: int = _option(8, "answers sampled per prompt (advantages are "
                            "normalized within each group)")
  steps: int = _option(400, "RL steps (refit + rollout + train)")
  learning_rate: float = _option(3e-3, "Adam learning rate")
  seed: int = _option(0, "seed of parameters, prompts and sampling")
  window: int = _option(20, "steps per moving average of the reward")
  log_every: int = _option(25, "print a progress line every this many steps")
  timing_reps: int = _option(10, "timed repetitions per way at the end: blocks of "
                             f"{TIMING_BLOCK} RL steps with and without overlap "
                             "(after one warm-up block each), and refits per engine "
                             "(jax_m2n.reshard with dtype= vs astype + "
                             "jax.device_put; after 3 warm-ups)")
  progress: bool = _option(True, "draw a progress bar (needs rich)")
  json_out: str = _option("", "write the metrics as JSON to this path")

  @property
  def ffn(self):
    return self.d_ff or 4 * self.d_model

  @property
  def seq_len(self):   # prompt, SEP, answer
    return 2 * self.digits + 1


# ---------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Side:
  """One side's layout: a mesh over its devices plus logical-axis rules."""
  mesh: Mesh
  rules: dict   # logical axis -> tuple of mesh axes

  def spec(self, logical_axes):
    return P(*(self._mesh_axes(a) for a in logical_axes))

  def sharding(self, logical_axes):
    return NamedSharding(self.mesh, self.spec(logical_axes))

  def _mesh_axes(self, logical):
    axes = self.rules.get(logical, ()) if logical else ()
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

  def describe(self):
    shape = ",".join(f"{n}={s}" for n, s in self.mesh.shape.items())
    ids = [d.id for d in self.mesh.devices.flat]
    rules = ", ".join(f"{k}->{'+'.join(v)}" for k, v in self.rules.items() if v)
    return f"mesh({shape}) on devices {ids}; {rules or 'replicated'}"


def _parse_mesh(text, what):
  """'fsdp2xtp2' (preset grammar) or 'fsdp=2,tp=2' -> [(name, size), ...]."""
  pattern = (r"([A-Za-z_]\w*)=(\d+)" if "=" in text else r"([a-z_]+?)(\d+)")
  separator = "," if "=" in text else "x"
  axes = []
  for term in text.split(separator):
    match = re.fullmatch(pattern, term.strip())
    if not match or int(match.group(2)) < 1:
      raise ValueError(f"rl_refit: {what} must be axes like 'fsdp2xtp2' or "
                       f"'fsdp=2,tp=2' with sizes >= 1; got {text!r}.")
    axes.append((match.group(1), int(match.group(2))))
  if len({n for n, _ in axes}) != len(axes):
    raise ValueError(f"rl_refit: {what} must name each axis once; got {text!r}.")
  return axes


def _fit(axes, devices, what):
  """Halves the rightmost axis > 1 until the layout fits on `devices` devices."""
  axes = list(axes)
  while math.prod(s for _, s in axes) > devices:
    i = max(i for i, (_, s) in enumerate(axes) if s > 1)
    name, size = axes[i]
    if size % 2:
      raise ValueError(f"rl_refit: {what} must fit on {devices} devices by halving "
                       f"axes; got axis {name}={size}. Pass --devices_per_side.")
    axes[i] = (name, size // 2)
  return axes


def _parse_rules(text, mesh_axes, what):
  """'batch=fsdp,model=fsdp,hidden=tp' -> {logical: (mesh axes...)}."""
  if not text:
    unknown = [n for n in mesh_axes if n not in AXIS_ROLES]
    if unknown:
      raise ValueError(f"rl_refit: {what} mesh axes must be among "
                       f"{sorted(AXIS_ROLES)} unless rules are given; got "
                       f"{unknown}. Pass the side's --*_specs.")
    return {logical: tuple(n for n in mesh_axes if logical in AXIS_ROLES[n])
            for logical in LOGICAL_AXES}
  rules = {logical: () for logical in LOGICAL_AXES}
  for term in text.split(","):
    logical, _, targets = term.partition("=")
    logical = logical.strip()
    targets = tuple(t.strip() for t in targets.split("+") if t.strip())
    if logical not in rules or any(t not in mesh_axes for t in targets):
      raise ValueError(f"rl_refit: {what} specs must map logical axes "
                       f"{LOGICAL_AXES} to mesh axes {tuple(mesh_axes)}; got "
                       f"{term!r}.")
    rules[logical] = targets
  return rules


def make_sides(cfg, devices):
  """Resolves the layout flags into (trainer Side, generator Side)."""
  match = re.fullmatch(r"\s*(\w+)\s*->\s*(\w+)\s*(@same)?\s*", cfg.layouts)
  if not match:
    raise ValueError("rl_refit: --layouts must read '<trainer>-><generator>[@same]' "
                     f"like {PRESETS[0]!r}; got {cfg.layouts!r}.")
  colocated = bool(match.group(3))
  if len(devices) == 1 and not colocated and not cfg.devices_per_side:
    # One device (a one-GPU workstation): both sides share it, as with '@same'.
    print("rl_refit: one device: the trainer and the generator share it ('@same')")
    colocated = True
  per_side = cfg.devices_per_side or (
      len(devices) if colocated else len(devices) // 2)
  sides = []
  for which, preset, explicit_mesh, specs in (
      ("trainer", match.group(1), cfg.trainer_mesh, cfg.trainer_specs),
      ("generator", match.group(2), cfg.generator_mesh, cfg.generator_specs)):
    axes = (_parse_mesh(explicit_mesh, f"--{which}_mesh") if explicit_mesh else
            _fit(_parse_mesh(preset, f"--layouts {which}"), per_side, which))
    rules = _parse_rules(specs, [n for n, _ in axes], which)
    sides.append((axes, rules))
  sizes = [math.prod(s for _, s in axes) for axes, _ in sides]
  first = (0, 0) if colocated else (0, sizes[0])
  needed = max(sizes) if colocated else sum(sizes)
  if needed > len(devices):
    raise ValueError(f"rl_refit: layouts must fit on the {len(devices)} devices; "
                     f"got {cfg.layouts!r} needing {needed} (trainer {sizes[0]}, "
                     f"generator {sizes[1]}).")
  return tuple(
      Side(Mesh(np.array(devices[f:f + n]).reshape([s for _, s in axes]),
                tuple(name for name, _ in axes)), rules)
      for (axes, rules), f, n in zip(sides, first, sizes))


def param_shardings(params, side):
  """Per-leaf NamedSharding of `params` in `side`'s layout (by PARAM_AXES)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: side.sharding(PARAM_AXES[path[-1].key]), params)


# ---------------------------------------------------------------- model


def init_params(key, cfg):
  """A pre-LayerNorm decoder-only transformer with learned positions."""
  keys = iter(jax.random.split(key, 4 + 6 * cfg.layers))
  d, f = cfg.d_model, cfg.ffn
  normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
  residual_scale = (2 * cfg.layers) ** -0.5   # keeps the residual stream O(1)
  layer = lambda: {
      "ln1": jnp.ones(d), "wq": normal((d, d), d ** -0.5),
      "wk": normal((d, d), d ** -0.5), "wv": normal((d, d), d ** -0.5),
      "wo": normal((d, d), d ** -0.5 * residual_scale),
      "ln2": jnp.ones(d), "w1": normal((d, f), d ** -0.5),
      "w2": normal((f, d), f ** -0.5 * residual_scale)}
  return {"embed": normal((VOCAB, d), 1.0), "pos": normal((cfg.seq_len, d), 0.1),
          "layers": [layer() for _ in range(cfg.layers)],
          "ln_f": jnp.ones(d), "unembed": normal((d, VOCAB), d ** -0.5)}


def _layer_norm(x, scale):
  x = x - x.mean(-1, keepdims=True)
  return scale * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def policy_logits(params, tokens, heads):
  """Logits over the next token, restricted to digits: [batch, time, VOCAB]."""
  _, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for p in params["layers"]:
    h = _layer_norm(x, p["ln1"])
    q, k, v = (jnp.reshape(h @ p[w], h.shape[:2] + (heads, -1))
               for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    x = x + attended.reshape(x.shape[:2] + (-1,)) @ p["wo"]
    x = x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]
  logits = _layer_norm(x, params["ln_f"]) @ params["unembed"]
  return jnp.where(jnp.arange(VOCAB) < NUM_DIGITS, logits, -1e9)


def sample(params, prompts, key, *, heads):
  """Answers each prompt autoregressively; returns [batch, seq_len] tokens.

  Computes in the weights' dtype; 8-bit weights are widened to bfloat16 first (JAX
  does not promote float8 implicitly), as weight-only fp8 inference does; quantized
  kernels (QArrays) are dequantized (qvalue times its tile's scale) the same way.
  """
  params = jax.tree.map(_dense, params, is_leaf=_is_quantized)
  batch, digits = prompts.shape
  tokens = jnp.zeros((batch, 2 * digits + 1), jnp.int32)
  tokens = tokens.at[:, :digits].set(prompts).at[:, digits].set(SEP)

  def next_token(i, tokens):
    # Recomputes the whole (short) sequence instead of keeping a KV cache.
    logits = policy_logits(params, tokens, heads)[:, digits + i].astype(jnp.float32)
    token = jax.random.categorical(jax.random.fold_in(key, i), logits)
    return tokens.at[:, digits + 1 + i].set(token.astype(jnp.int32))

  return jax.lax.fori_loop(0, digits, next_token, tokens)


def _is_quantized(w) -> bool:
  return hasattr(w, "qvalue") and hasattr(w, "scale")


def _dense(w):
  """A generator weight as the matmuls use it: QArrays dequantized, 8-bit widened."""
  if _is_quantized(w):
    if isinstance(w, jax_m2n.QuantizedArray):
      return w.dequantize()
    import qwix  # a QArray came back: qwix is installed
    return qwix.dequantize(w)
  return w.astype(jnp.bfloat16) if w.dtype.itemsize == 1 else w


def _kernel_spec(shape, quantize):
  """The Quantize spec of one kernel [in, out] for --quantize."""
  if quantize == "mxfp8":
    return jax_m2n.Quantize("mxfp8", tiled_axes={0: 32}, scale_dtype=jnp.bfloat16)
  tile = math.gcd(128, *shape)  # DeepSeek's 128 x 128 where it divides, else smaller
  while tile >= min(shape) and tile > 8:  # several tiles per kernel, not one
    tile //= 2
  return jax_m2n.Quantize("float8_e4m3fn", tiled_axes={0: tile, 1: tile},
                          scale_dtype=jnp.bfloat16)


def refit_dtypes(shapes, cfg):
  """`dtype=` of the refit: the generator dtype, or a pytree prefix of it with a
  Quantize spec for each kernel (--quantize)."""
  gen = jnp.dtype(cfg.generator_dtype)
  if cfg.quantize == "none":
    return gen
  return {k: [{n: _kernel_spec(w.shape, cfg.quantize) if n in KERNELS else gen
               for n, w in layer.items()} for layer in v] if k == "layers" else gen
          for k, v in shapes.items()}


def train_step(params, opt_state, tokens, advantages, *, heads, learning_rate):
  """One policy-gradient step: REINFORCE on per-digit advantages, then Adam."""
  digits = advantages.shape[1]

  def loss_fn(params):
    logits = policy_logits(params, tokens[:, :-1], heads)[:, digits:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits),
                               tokens[:, digits + 1:, None], axis=-1)[..., 0]
    return -(advantages * logp).sum(-1).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt_state = adam(params, grads, opt_state, learning_rate)
  return params, opt_state, loss


def adam(params, grads, state, learning_rate, b1=0.9, b2=0.99, eps=1e-8):
  """Adam (Kingma & Ba), bias-corrected; state = (m, v, step count)."""
  m, v, count = state
  count = count + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
  step = learning_rate * jnp.sqrt(1 - b2 ** count) / (1 - b1 ** count)
  params = jax.tree.map(lambda p, m, v: p - step * m / (jnp.sqrt(v) + eps),
                        params, m, v)
  return params, (m, v, count)


def rewards_and_advantages(prompts, tokens, group_size):
  """The verifier: per-digit reward 1 where the answer digit reverses the prompt.

  Advantages are GRPO-style, per digit position: each reward minus its group's
  mean (the answers sampled for the same prompt), over the group's std + 0.1.
  """
  digits = prompts.shape[1]
  correct = (tokens[:, digits + 1:] == prompts[:, ::-1]).astype(np.float32)
  grouped = correct.reshape(-1, group_size, digits)
  advantages = (grouped - grouped.mean(1, keepdims=True)) / (
      grouped.std(1, keepdims=True) + 0.1)
  return correct, advantages.reshape(correct.shape)


def checksums(params):
  """Per-leaf uint32 checksum of the bits (position-weighted, so order matters)."""
  def leaf(x):
    bits = jax.lax.bitcast_convert_type(
        x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)   # row-major element index, no reshape
    for dim in range(x.ndim):
      stride = np.uint32(math.prod(x.shape[dim + 1:]))
      index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * stride
    return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)
  return jnp.stack([leaf(x) for x in jax.tree.leaves(params)])


# ---------------------------------------------------------------- the loop


@dataclasses.dataclass
class RefitResult:
  """What a run produced; the test and the docs read these."""
  trainer_params: Any            # float32, the trainer's layout
  generator_params: Any          # the last refit's output: generator's layout and dtype
  generator_shardings: Any
  rewards: list                  # per step: mean per-digit reward
  exact: list                    # per step: fraction of exact answers
  checksums_equal: list          # per step: generator's vs astype of trainer's, every leaf
  times_ms: dict                 # per step: refit, rollout, train (see rl_step), step
  returned_early: list           # per step with overlap: the refit call returned before
                                 # its outputs were ready
  step_ms: dict                  # "waited", "overlapped": ms per RL step, per timed block
  waited_phase_ms: dict          # refit, rollout, train: ms per step in the waited blocks
  engine_ms: dict                # refit engine -> ms per refit (the final comparison)
  baseline_equal: bool           # astype + device_put's output bitwise equals the refit's
  reward_went_up: Optional[bool] = None   # last vs first window; None: too few steps


class _Display:
  """A rich progress bar on a terminal (when asked for), plain lines otherwise."""

  def __init__(self, cfg):
    self._bar = None
    if cfg.progress and rich is not None and sys.stdout.isatty():
      self._bar = rich.progress.Progress(
          rich.progress.TextColumn("[bold]RL refit"), rich.progress.BarColumn(),
          rich.progress.MofNCompleteColumn(),
          rich.progress.TextColumn("{task.fields[status]}"),
          rich.progress.TimeElapsedColumn())
      self._task = self._bar.add_task("", total=cfg.steps, status="")
      self._bar.start()

  def update(self, status):
    if self._bar is not None:
      self._bar.update(self._task, advance=1, status=status)

  def print(self, line):
    if self._bar is not None:
      self._bar.console.print(line, highlight=False, markup=False)
    else:
      print(line, flush=True)

  def close(self):
    if self._bar is not None:
      self._bar.stop()


def _ms_since(start):
  return 1e3 * (time.perf_counter() - start)


def _timed(fn, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, _ms_since(start)


def run(cfg: RefitConfig, devices: Optional[list] = None) -> RefitResult:
  """Trains the policy for cfg.steps RL steps; see the module docstring."""
  if cfg.batch_size % cfg.group_size:
    raise ValueError(f"rl_refit: --batch_size must be a multiple of --group_size "
                     f"({cfg.group_size}); got {cfg.batch_size}.")
  if cfg.d_model % cfg.heads:
    raise ValueError(f"rl_refit: --d_model must be a multiple of --heads "
                     f"({cfg.heads}); got {cfg.d_model}.")
  devices = list(devices or jax.devices())
  trainer, generator = make_sides(cfg, devices)
  log = _Display(cfg)
  log.print(f"trainer:   {trainer.describe()}")
  log.print(f"generator: {generator.describe()}")

  key = jax.random.key(cfg.seed)
  init = functools.partial(init_params, cfg=cfg)
  shapes = jax.eval_shape(init, key)
  train_shardings = param_shardings(shapes, trainer)
  gen_shardings = param_shardings(shapes, generator)
  params = jax.jit(init, out_shardings=train_shardings)(jax.random.fold_in(key, 0))
  zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p),
                  out_shardings=train_shardings)
  opt_state = (zeros(params), zeros(params),
               jax.device_put(jnp.zeros((), jnp.int32), trainer.sharding(())))
  gen_dtype = jnp.dtype(cfg.generator_dtype)
  converting = gen_dtype != jnp.float32
  quantizing = cfg.quantize != "none"
  dtypes = refit_dtypes(shapes, cfg)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  gen_nbytes = sum(x.size for x in jax.tree.leaves(params)) * gen_dtype.itemsize
  if quantizing:  # FP8 kernels plus bf16 scales: the plan's destination bytes
    gen_nbytes = sum(math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
                     for t in _quantized_shapes(shapes, dtypes))
  log.print(f"policy: {len(jax.tree.leaves(params))} tensors, {nbytes / 2**20:.2f} "
            f"MiB in float32 on the trainer, {gen_nbytes / 2**20:.2f} MiB in "
            f"{gen_dtype.name}{' + ' + cfg.quantize + ' kernels' if quantizing else ''} "
            f"on the generator; task: reverse {cfg.digits} digits; "
            f"refit route: {cfg.route}; overlap: {'on' if cfg.overlap else 'off'}")

  train_batch = trainer.sharding(("batch", None))
  gen_batch = generator.sharding(("batch", None))
  train_fn = jax.jit(
      train_step, static_argnames=("heads", "learning_rate"), donate_argnums=(0, 1),
      out_shardings=(train_shardings, jax.tree.map(lambda x: x.sharding, opt_state),
                     trainer.sharding(())))
  sample_fn = jax.jit(sample, static_argnames=("heads",), out_shardings=gen_batch)
  to_gen_dtype = lambda p: jax.tree.map(lambda x: x.astype(gen_dtype), p)
  astype = jax.jit(to_gen_dtype)   # the baselines' cast, on the trainer
  checksum_fn = jax.jit(checksums)
  trainer_checksum_fn = jax.jit(lambda p: checksums(to_gen_dtype(p)))

  # The refit: the whole parameter pytree in one call, one transfer plan, converted to
  # the generator's dtype on the way (narrowed before the bytes leave the trainer).
  refit = lambda p: jax_m2n.reshard(p, gen_shardings, dtype=dtypes, route=cfg.route)
  if quantizing:  # the trainer's own reference: the same quantization, in place
    trainer_ref = lambda p: jax_m2n.reshard(p, None, dtype=dtypes)  # noqa: E731
    trainer_checksum_fn = lambda p: checksum_fn(trainer_ref(p))  # noqa: E731

  rng = np.random.default_rng(cfg.seed)
  prompts_per_step = cfg.batch_size // cfg.group_size

  def check_equal(params, gen_params, when):
    """Verification: each side checksums its own copy (the trainer its astype)."""
    sums = jax.device_get((trainer_checksum_fn(params), checksum_fn(gen_params)))
    if not np.array_equal(*sums):
      raise RuntimeError(f"rl_refit: {when}: the generator's parameters must equal "
                         f"the trainer's cast to {gen_dtype.name} bitwise; the "
                         "checksums of leaves "
                         f"{np.flatnonzero(sums[0] != sums[1]).tolist()} differ.")

  def rl_step(params, opt_state, step, overlap, verify):
    """One RL step: refit, rollout (generation + the verifier), train.

    Without overlap the host waits for each phase before it starts the next. With
    overlap it waits only where it needs a value (the verifier needs the tokens):
    `jax_m2n.reshard` returns once the refit is enqueued on every device (as
    `jax.device_put` does), and while the weights stream to the generator the host
    draws the step's prompts, puts them on the generator's devices and enqueues the
    generation, which each device starts when its weights have landed; the train
    step is enqueued too, and the next step's refit waits for it on the devices.
    Verification (each side's checksums) is left out of the phase times. The first
    step's refit is waited for either way (its time is the whole first refit). Returns
    the trainer's new state, the generator's weights, the per-digit rewards, the phase
    times in ms and whether the refit returned before its outputs were ready.
    """
    wait = (lambda x: x) if overlap else jax.block_until_ready
    start = time.perf_counter()
    gen_params = refit(params)
    if not overlap or step == 0:  # the first refit (planning, programs) is waited for
      gen_params = jax.block_until_ready(gen_params)
    refit_ms = _ms_since(start)
    early = verify and not all(x.is_ready() for x in jax.tree.leaves(gen_params))

    start = time.perf_counter()
    # The step's data work, which needs no weights: prompts, on the generator's side.
    prompts = np.repeat(rng.integers(0, NUM_DIGITS, (prompts_per_step, cfg.digits)),
                        cfg.group_size, axis=0).astype(np.int32)
    tokens = np.asarray(sample_fn(gen_params, jax.device_put(prompts, gen_batch),
                                  jax.random.fold_in(key, step + 1), heads=cfg.heads))
    correct, advantages = rewards_and_advantages(prompts, tokens, cfg.group_size)
    rollout_ms = _ms_since(start)
    if verify:   # before train_fn donates params
      check_equal(params, gen_params, f"step {step}")

    start = time.perf_counter()
    params, opt_state, _ = wait(train_fn(
        params, opt_state, jax.device_put(tokens, train_batch),
        jax.device_put(advantages, train_batch), heads=cfg.heads,
        learning_rate=cfg.learning_rate))
    train_ms = _ms_since(start)
    return (params, opt_state, gen_params, correct, (refit_ms, rollout_ms, train_ms),
            early)

  times = {"refit": [], "rollout": [], "train": [], "step": []}
  rewards, exact, equal, returned_early = [], [], [], []
  log.print("per step, ms in each phase: " + (
      "the host's time; it waits for neither the refit nor the train step (a refit call "
      "that returns only once its weights have landed has also waited for the previous "
      "train step, whose output it reads)" if cfg.overlap else "each phase waited for"))
  for step in range(cfg.steps):
    params, opt_state, gen_params, correct, phase_ms, early = rl_step(
        params, opt_state, step, cfg.overlap, verify=True)
    equal.append(True)   # rl_step raised otherwise
    for phase, ms in zip(("refit", "rollout", "train", "step"),
                         phase_ms + (sum(phase_ms),)):
      times[phase].append(ms)
    if cfg.overlap:
      returned_early.append(early)
    rewards.append(float(correct.mean()))
    exact.append(float(correct.all(1).mean()))
    call = " call" if cfg.overlap else ""
    status = (f"reward {rewards[-1]:.3f} exact {exact[-1]:.3f} | step "
              f"{sum(phase_ms):.0f} ms: refit{call} {phase_ms[0]:.1f}, rollout "
              f"{phase_ms[1]:.0f}, train{call} {phase_ms[2]:.0f}")
    log.update(status)
    if step % cfg.log_every == 0 or step == cfg.steps - 1:
      log.print(f"step {step:4d}  {status} | checksums equal")
  start = time.perf_counter()
  jax.block_until_ready(params)   # with overlap the last train step may still run
  if times["train"]:
    times["train"][-1] += _ms_since(start)
    times["step"][-1] += _ms_since(start)
  log.close()

  # The step with and without overlap: blocks of real RL steps (they keep training),
  # interleaved, each block ending when its last train step is done.
  steps_done = itertools.count(cfg.steps)
  waited_phases = []

  def timed_block(overlap):
    nonlocal params, opt_state
    start = time.perf_counter()
    for _ in range(TIMING_BLOCK):
      params, opt_state, _, _, phase_ms, _ = rl_step(
          params, opt_state, next(steps_done), overlap, verify=False)
      if not overlap:
        waited_phases.append(phase_ms)
    jax.block_until_ready(params)
    return _ms_since(start) / TIMING_BLOCK

  step_ms = {"waited": [], "overlapped": []}
  for rep in range(1 + cfg.timing_reps):   # one warm-up block each
    for name, overlap in (("waited", False), ("overlapped", True)):
      ms = timed_block(overlap)
      if rep:
        step_ms[name].append(ms)
  waited_phase_ms = dict(zip(("refit", "rollout", "train"), np.mean(
      waited_phases[TIMING_BLOCK:], axis=0).tolist())) if cfg.timing_reps else {}

  gen_params = refit(params)
  check_equal(params, gen_params, "after the last step")
  if quantizing:
    return _finish_quantized(cfg, params, gen_params, gen_shardings, dtypes, refit,
                             rewards, exact, equal, times, returned_early, step_ms,
                             waited_phase_ms, nbytes, gen_nbytes)
  if converting:
    engines = {
        f"jax_m2n.reshard(dtype={gen_dtype.name})": refit,
        "astype + jax_m2n.reshard":
            lambda p: jax_m2n.reshard(astype(p), gen_shardings, route=cfg.route),
        "astype + jax.device_put": lambda p: jax.device_put(astype(p), gen_shardings)}
  else:
    engines = {"jax_m2n.reshard": refit,
               "jax.device_put": lambda p: jax.device_put(p, gen_shardings)}
  engine_ms = _compare_refits(params, engines, cfg.timing_reps)
  baseline = jax.device_put(astype(params), gen_shardings)
  baseline_equal = all(
      a.dtype == b.dtype and
      np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
      for a, b in zip(jax.tree.leaves(gen_params), jax.tree.leaves(baseline)))
  result = RefitResult(params, gen_params, gen_shardings, rewards, exact, equal,
                       times, returned_early, step_ms, waited_phase_ms, engine_ms,
                       baseline_equal)
  if len(rewards) >= 2 * cfg.window:
    result.reward_went_up = bool(
        np.mean(rewards[-cfg.window:]) > np.mean(rewards[:cfg.window]))
  _report(cfg, result, nbytes, gen_nbytes)
  return result


def _quantized_shapes(shapes, dtypes):
  """What the generator holds: per leaf its array, per quantized kernel values + scales."""
  out = []
  for shape, dtype in zip(jax.tree.leaves(shapes),
                          jax.tree.leaves(dtypes)):
    if isinstance(dtype, jax_m2n.Quantize):
      tiles = [dtype.tiled_axes.get(a, d) for a, d in enumerate(shape.shape)]
      out += [jax.ShapeDtypeStruct(shape.shape, jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct(tuple(d // t for d, t in zip(shape.shape, tiles)),
                                   dtype.scale_dtype)]
    else:
      out.append(jax.ShapeDtypeStruct(shape.shape, dtype))
  return out


def _finish_quantized(cfg, params, gen_params, gen_shardings, dtypes, refit, rewards,
                      exact, equal, times, returned_early, step_ms, waited_phase_ms,
                      nbytes, gen_nbytes):
  """--quantize: the refit against device_put + qwix.quantize on the generator (bytes
  between devices from jax_m2n.plan, times), and the QArrays against qwix's."""
  quantized = lambda d: isinstance(d, jax_m2n.Quantize)  # noqa: E731
  flat_dtypes = jax.tree.leaves(dtypes)
  wire = lambda p: sum(v for k, v in p.bytes_by_link.items() if k != "local")  # noqa
  refit_bytes = wire(jax_m2n.plan(params, gen_shardings, dtype=dtypes))
  put_bytes = wire(jax_m2n.plan(params, gen_shardings))  # float32, as device_put moves it
  engines = {f"jax_m2n.reshard(dtype=Quantize {cfg.quantize})": refit}
  baseline_equal = None
  try:
    import qwix
  except ImportError:
    qwix = None
    print("rl_refit: qwix is not installed: no device_put + qwix.quantize baseline")
  if qwix is not None:
    def quantize_tree(p):
      leaves, tree = jax.tree.flatten(p)
      return jax.tree.unflatten(tree, [
          qwix.quantize(x, d.qtype, tiled_axes=dict(d.tiled_axes),
                        scale_dtype=d.scale_dtype) if quantized(d) else x.astype(d)
          for x, d in zip(leaves, flat_dtypes)])
    on_generator = jax.jit(quantize_tree)
    engines["jax.device_put + qwix.quantize (jit, on the generator)"] = (
        lambda p: on_generator(jax.device_put(p, gen_shardings)))
    # qwix.quantize_api itself, op by op, on the generator's copy: the reference.
    reference = quantize_tree(jax.device_put(params, gen_shardings))
    baseline_equal = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip(jax.tree.leaves(gen_params), jax.tree.leaves(reference)))
  engine_ms = _compare_refits(params, engines, cfg.timing_reps)
  result = RefitResult(params, gen_params, gen_shardings, rewards, exact, equal, times,
                       returned_early, step_ms, waited_phase_ms, engine_ms,
                       baseline_equal)
  if len(rewards) >= 2 * cfg.window:
    result.reward_went_up = bool(
        np.mean(rewards[-cfg.window:]) > np.mean(rewards[:cfg.window]))
  _report(cfg, result, nbytes, gen_nbytes)
  print(f"\nrefit bytes between devices (jax_m2n.plan): {refit_bytes / 2**20:.3f} MiB "
        f"(FP8 kernels + bf16 scales + {cfg.generator_dtype} rest) vs "
        f"{put_bytes / 2**20:.3f} MiB of float32 for jax.device_put "
        f"({put_bytes / max(refit_bytes, 1):.2f}x); QArrays equal qwix.quantize of "
        f"jax.device_put(params) bitwise: {baseline_equal}")
  result.wire_bytes = {"reshard_quantized": refit_bytes, "device_put_float32": put_bytes}
  return result


def _compare_refits(params, engines, reps, warmups=3):
  """Times each engine, interleaved, after warm-ups, each call on a fresh copy of
  `params` (new buffers, as after a train step; the same bits)."""
  copy = jax.jit(lambda p, one: jax.tree.map(lambda x: x * one, p))  # not folded away
  timings = {name: [] for name in engines}
  for rep in range(warmups + reps):
    for name, engine in engines.items():
      _, ms = _timed(engine, jax.block_until_ready(copy(params, 1.0)))
      if rep >= warmups:
        timings[name].append(ms)
  return timings


def _line(what, ms, note=""):
  """One measurement: what it measures, its milliseconds, and how to read it."""
  print(f"{what + ':':<62} {ms:8.2f} ms" + (f"  ({note})" if note else ""))


def _report(cfg, result, nbytes, gen_nbytes):
  """Prints learning (first vs last moving average) and one line per measurement."""
  w = min(cfg.window, max(1, len(result.rewards) // 2))
  first, last = np.mean(result.rewards[:w]), np.mean(result.rewards[-w:])
  first_exact, last_exact = np.mean(result.exact[:w]), np.mean(result.exact[-w:])
  dtype = cfg.generator_dtype
  print(f"\nreward, mean per digit (moving average of {w} steps): {first:.3f} first -> "
        f"{last:.3f} last; exact answers {first_exact:.3f} -> {last_exact:.3f}")
  print(f"bitwise: the generator's {dtype} = astype of the trainer's float32 on all "
        f"{len(result.checksums_equal)} steps: {all(result.checksums_equal)}; the last "
        f"refit = astype + jax.device_put: {result.baseline_equal}")

  times = result.times_ms
  devices = jax.devices()
  print(f"\ntimes ({len(devices)} {devices[0].platform} devices, route {cfg.route}, "
        f"{nbytes / 2**20:.2f} MiB float32 -> {gen_nbytes / 2**20:.2f} MiB {dtype}; "
        f"overlap {'on' if cfg.overlap else 'off'} in the loop):")
  _line("first refit, waited for (plans, builds its programs, moves)", times["refit"][0])
  _line("first RL step (compiles the sampler and the train step)", times["step"][0])
  waited_train = None
  if cfg.timing_reps:
    waited, overlapped = (np.array(result.step_ms[k]) for k in ("waited", "overlapped"))
    blocks = f"median of {len(waited)} blocks"
    _line(f"RL step, refit waited for (--nooverlap), {blocks}", np.median(waited),
          f"blocks of {TIMING_BLOCK} steps, interleaved with the next line's; mean "
          f"{waited.mean():.2f}, min {waited.min():.2f}")
    change = np.median(overlapped) - np.median(waited)
    _line(f"RL step, refit overlapped (--overlap), {blocks}", np.median(overlapped),
          f"mean {overlapped.mean():.2f}, min {overlapped.min():.2f}; {change:+.2f} ms, "
          f"{100 * change / np.median(waited):+.1f}% against waited for")
    phases = result.waited_phase_ms
    waited_train = phases["train"]
    _line("  refit inside those waited-for steps, mean", phases["refit"],
          f"{100 * phases['refit'] / waited.mean():.1f}% of the step")
    _line("  rollout inside those waited-for steps, mean", phases["rollout"])
    _line("  train step inside those waited-for steps, mean", phases["train"])
  # The first step compiles everything; the loop's means start after it.
  skip = 1 if len(result.rewards) > 1 else 0
  mean = {k: float(np.mean(v[skip:])) for k, v in times.items()}
  steps = f"mean of steps {skip + 1}-{len(result.rewards)}"
  call = " call" if cfg.overlap else ""
  _line(f"RL step in the loop, {steps}", mean["step"],
        f"refit{call} {mean['refit']:.2f} + rollout {mean['rollout']:.2f} + "
        f"train{call} {mean['train']:.2f}; the checksums not counted")
  if cfg.overlap:
    early = result.returned_early[skip:]
    if any(early):
      why = (": the call enqueues the refit, which the devices run after the previous "
             "train step; the rollout waits for both")
    else:
      why = (": this reshard waits for its transfer, so each call also waited for what "
             "was left of the previous train step, whose output it reads" + (
                 "" if waited_train is None else
                 f"; a train step takes {waited_train:.2f} ms, above"))
    _line(f"refit call in the loop (not waited for), {steps}", mean["refit"],
          f"returned before its weights landed in {sum(early)} of {len(early)} "
          f"steps{why}")
  if cfg.timing_reps:
    print(f"refit alone, each call on a fresh copy of the weights and waited for, "
          f"engines interleaved, mean of {cfg.timing_reps} after 3 warm-ups:")
    for name, ms in result.engine_ms.items():
      _line(f"  {name}", np.mean(ms), f"min {min(ms):.2f}")
    names = list(result.engine_ms)
    ratio = np.mean(result.engine_ms[names[-1]]) / np.mean(result.engine_ms[names[0]])
    print(f"{names[-1]} takes {ratio:.2f}x the time of {names[0]}")

  if result.reward_went_up is not None:
    print("learning: " + ("reward went up" if result.reward_went_up
                          else "REWARD DID NOT GO UP"))
  if cfg.json_out:
    with open(cfg.json_out, "w") as f:
      json.dump({"version": 2, "config": dataclasses.asdict(cfg),
                 "platform": jax.devices()[0].platform,
                 "device_kind": jax.devices()[0].device_kind,
                 "param_bytes": nbytes, "generator_param_bytes": gen_nbytes,
                 "phase_ms": mean, "first_step_ms": {k: v[0] for k, v in times.items()},
                 "returned_early": result.returned_early,
                 "step_ms": result.step_ms,
                 "waited_phase_ms": result.waited_phase_ms,
                 "engine_ms": result.engine_ms,
                 "rewards": result.rewards, "exact": result.exact,
                 "reward_went_up": result.reward_went_up}, f, indent=1)

# ---------------------------------------------------------------- command line


def _define_flags():
  for field in dataclasses.fields(RefitConfig):
    name, default, meta = field.name, field.default, field.metadata
    if meta["choices"]:
      flags.DEFINE_enum(name, default, meta["choices"], meta["help"])
    elif isinstance(default, bool):
      flags.DEFINE_bool(name, default, meta["help"])
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, meta["help"])
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, meta["help"])
    else:
      flags.DEFINE_string(name, default, meta["help"])


_define_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"rl_refit: unexpected arguments {argv[1:]}")
  cfg = RefitConfig(**{f.name: getattr(flags.FLAGS, f.name)
                       for f in dataclasses.fields(RefitConfig)})
  start = time.perf_counter()
  result = run(cfg)
  print(f"wall time: {time.perf_counter() - start:.1f} s")
  if result.reward_went_up is False:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
