"""Benchmark suites: the cases (what moves from which layout to which) and the planner suite.

Owns the case tables of every suite, written device-free with the planner's compact
layout descriptors (`mesh(x=2) P(x, None) @0`), so the JAX process and the torch.distributed
workers build the same cases; and the planner suite (planning cost of a DeepSeek-V3-sized
refit, no devices). Never touches devices and never times data movement (runner.py does).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from typing import Sequence

from jax_m2n.bench import data as bench_data

MIB = 1 << 20

# The suites `--suite` accepts, in run order ("multiprocess" runs first, in processes of
# its own: jax_m2n/bench/multiprocess.py; then fig4 and memory, each with its own report).
SUITES = ("smoke", "refit", "colocated", "model", "emulated", "planner", "multiprocess",
          "network", "fig4", "memory", "dtype", "quantize", "jobs", "delta", "scale")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One leaf of a case: global shape, dtype and source/destination layout descriptors.

  Descriptors are `mesh(NAME=SIZE, ...) P(ENTRY, ...) @FIRST` (jax_m2n._src.layout):
  the mesh's devices are positions FIRST, FIRST+1, ... of `jax.devices()` (= CUDA
  ordinals on one GPU host).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  src: str
  dst: str

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * bench_data.np_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Case:
  """A benchmark case: one reshard call of a pytree of tensors.

  Attributes:
    suite, name: identity (`suite/name` is unique).
    title: what it is, in words (tables).
    tensors: the leaves.
    colocated: source and destination on the same devices (in-jit engines apply).
    layout_change: False when each destination shard is an exact copy of a source shard
      (jax.device_put's fast path); the CPU requirement compares layout-changing cases.
    domain_size: emulated NVLink domains (passed to jax_m2n as its topology), or None.
  """

  suite: str
  name: str
  title: str
  tensors: tuple[TensorSpec, ...]
  colocated: bool = False
  layout_change: bool = True
  domain_size: int | None = None

  @property
  def key(self) -> str:
    return f"{self.suite}/{self.name}"

  @property
  def payload_bytes(self) -> int:
    return sum(t.nbytes for t in self.tensors)

  @property
  def devices_needed(self) -> int:
    from jax_m2n._src.layout import parse_mesh_spec
    n = 0
    for t in self.tensors:
      for text in (t.src, t.dst):
        m = parse_mesh_spec(text)
        n = max(n, m.first + m.size)
    return n

  def to_json(self) -> dict:
    return {"suite": self.suite, "name": self.name, "title": self.title,
            "colocated": self.colocated, "layout_change": self.layout_change,
            "domain_size": self.domain_size, "payload_bytes": self.payload_bytes,
            "tensors": [dataclasses.asdict(t) for t in self.tensors]}


def _round_to(n: float, m: int) -> int:
  return max(m, int(round(n / m)) * m)


def _matrix(nbytes: int, dtype: str, cols: int = 8192) -> tuple[int, int]:
  """A [rows, cols] shape of about nbytes (rows a multiple of 24: splits 2, 3, 4, 8 ways)."""
  item = bench_data.np_dtype(dtype).itemsize
  cols = min(cols, max(24, _round_to(math.sqrt(nbytes / item), 24)))
  return _round_to(nbytes / (cols * item), 24), cols


def _two_d(case_suite: str, name: str, title: str, nbytes: int, dtype: str, src: str,
           dst: str, **kw) -> Case:
  return Case(case_suite, name, title,
              (TensorSpec("w", _matrix(nbytes, dtype), dtype, src, dst),), **kw)


def refit_cases(suite: str, nbytes: int, dtype: str, tree_bytes: int,
                tiny: bool = True) -> list[Case]:
  """Cross-device-set refit cases on 4 devices (trainer GPUs 0-1 -> generator 2-3)."""
  s2, r2 = "mesh(x=2) P(x, None) @0", "mesh(x=2) P(None, None) @2"
  cases = [
      _two_d(suite, "2to2_replicate", "2 devs P(x,None) -> 2 other devs P()", nbytes, dtype,
             s2, r2),
      _two_d(suite, "1to3_replicate", "1 dev -> 3 other devs P()", nbytes, dtype,
             "mesh(x=1) P(None, None) @0", "mesh(x=3) P(None, None) @1"),
      _two_d(suite, "2to2_dim0_to_dim1", "2 devs P(x,None) -> 2 other devs P(None,x)",
             nbytes, dtype, s2, "mesh(x=2) P(None, x) @2"),
      _two_d(suite, "2to2_same_layout", "2 devs P(x,None) -> 2 other devs P(x,None) "
             "(shard copies)", nbytes, dtype, s2, "mesh(x=2) P(x, None) @2",
             layout_change=False),
      Case(suite, "pytree64_fsdp2_to_tp2", "64-leaf transformer pytree, FSDP2 -> TP2 "
           "(other devs)", tuple(_transformer64(tree_bytes, dtype))),
  ]
  # On two devices (a 2-GPU machine) the only cross-set move is a whole-array copy.
  cases.append(_two_d(suite, "1to1_copy", "1 dev -> 1 other dev (point to point)", nbytes,
                      dtype, "mesh(x=1) P(None, None) @0", "mesh(x=1) P(None, None) @1",
                      layout_change=False))
  if tiny:
    cases.append(_two_d(suite, "tiny_2to2_replicate", "4 KiB, 2 devs -> 2 other devs P() "
                        "(fixed cost per call)", 4096, dtype, s2, r2))
    cases.append(_two_d(suite, "tiny_1to1", "4 KiB, 1 dev -> 1 other dev (fixed cost per "
                        "call)", 4096, dtype, "mesh(x=1) P(None, None) @0",
                        "mesh(x=1) P(None, None) @1", layout_change=False))
  return cases


def _transformer64(total: int, dtype: str) -> list[TensorSpec]:
  """8 layers x 8 leaves (norm, q, k, v, o, gate, up, down), about `total` bytes."""
  item = bench_data.np_dtype(dtype).itemsize
  # Per layer: q, o [h, h]; k, v [h, h/4]; gate, up [h, 3.5h]; down [3.5h, h]; norm [h].
  h = _round_to(math.sqrt(total / (8 * 13 * item)), 64)
  f = _round_to(3.5 * h, 64)
  fsdp, col, row = "mesh(x=2) P(x, None) @0", "mesh(x=2) P(None, x) @2", "mesh(x=2) P(x, None) @2"
  out = []
  for layer in range(8):
    p = f"layers.{layer}."
    out += [
        TensorSpec(p + "norm", (h,), dtype, "mesh(x=2) P(x) @0", "mesh(x=2) P(None) @2"),
        TensorSpec(p + "wq", (h, h), dtype, fsdp, col),
        TensorSpec(p + "wk", (h, h // 4), dtype, fsdp, col),
        TensorSpec(p + "wv", (h, h // 4), dtype, fsdp, col),
        TensorSpec(p + "wo", (h, h), dtype, fsdp, row),
        TensorSpec(p + "w_gate", (h, f), dtype, fsdp, col),
        TensorSpec(p + "w_up", (h, f), dtype, fsdp, col),
        TensorSpec(p + "w_down", (f, h), dtype, fsdp, row),
    ]
  return out


def colocated_cases(suite: str, nbytes: int, dtype: str) -> list[Case]:
  """In-jit layout changes on one device set of 4 (and of 2, for 2-GPU machines)."""
  src = "mesh(x=4) P(x, None) @0"
  pair = "mesh(x=2) P(x, None) @0"
  return [
      _two_d(suite, "2dev_dim0_to_dim1", "2 devs P(x,None) -> P(None,x) (all-to-all)",
             nbytes, dtype, pair, "mesh(x=2) P(None, x) @0", colocated=True),
      _two_d(suite, "2dev_dim0_to_replicated", "2 devs P(x,None) -> P() (all-gather)",
             nbytes, dtype, pair, "mesh(x=2) P(None, None) @0", colocated=True),
      _two_d(suite, "4dev_dim0_to_dim1", "4 devs P(x,None) -> P(None,x) (all-to-all)",
             nbytes, dtype, src, "mesh(x=4) P(None, x) @0", colocated=True),
      _two_d(suite, "4dev_dim0_to_replicated", "4 devs P(x,None) -> P() (all-gather)",
             nbytes, dtype, src, "mesh(x=4) P(None, None) @0", colocated=True),
  ]



def _attention(p: str, h: int, kv: int, dtype: str, norm: tuple[str, str],
               col: tuple[str, str], row: tuple[str, str]) -> list[TensorSpec]:
  """A layer's two norms and attention projections, the leaves Llama and MoE layers
  share: each (source, destination) layout pair given (norms, column and row
  parallel)."""
  return [TensorSpec(p + "attn_norm", (h,), dtype, *norm),
          TensorSpec(p + "wq", (h, h), dtype, *col),
          TensorSpec(p + "wk", (h, kv), dtype, *col),
          TensorSpec(p + "wv", (h, kv), dtype, *col),
          TensorSpec(p + "wo", (h, h), dtype, *row),
          TensorSpec(p + "mlp_norm", (h,), dtype, *norm)]


def llama_tensors(total: int, dtype: str, train: int, tp: int, dp: int,
                  layers: int = 32) -> list[TensorSpec]:
  """A Llama-3-8B-shaped pytree (2 + 9 * layers leaves), dims scaled to about `total`.

  Trainer: FSDP over devices [0, train) (every leaf sharded on dim 0). Generator: TP x DP
  on devices [train, train + tp * dp): column-parallel q/k/v/gate/up and lm_head,
  row-parallel o/down, vocab-parallel embedding, replicated norms.
  """
  item = bench_data.np_dtype(dtype).itemsize
  # Llama-3-8B: h 4096, kv 1024, ffn 14336, vocab 128256, 32 layers: 16.06 GB in bf16.
  full = (32 * (2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
          + 2 * 128256 * 4096 + 4096) * item * layers / 32
  k = math.sqrt(total / full)
  h, kv = _round_to(4096 * k, 128), _round_to(1024 * k, 128)
  f, v = _round_to(14336 * k, 128), _round_to(128256 * k, 128)
  mesh, at = f"mesh(dp={dp}, tp={tp})", f"@{train}"
  fsdp1, fsdp2 = f"mesh(fsdp={train}) P(fsdp) @0", f"mesh(fsdp={train}) P(fsdp, None) @0"
  col, row = f"{mesh} P(None, tp) {at}", f"{mesh} P(tp, None) {at}"
  rep1 = f"{mesh} P(None) {at}"
  out = [TensorSpec("embed", (v, h), dtype, fsdp2, row)]
  for layer in range(layers):
    p = f"layers.{layer}."
    out += _attention(p, h, kv, dtype, (fsdp1, rep1), (fsdp2, col), (fsdp2, row)) + [
        TensorSpec(p + "w_gate", (h, f), dtype, fsdp2, col),
        TensorSpec(p + "w_up", (h, f), dtype, fsdp2, col),
        TensorSpec(p + "w_down", (f, h), dtype, fsdp2, row),
    ]
  out += [TensorSpec("final_norm", (h,), dtype, fsdp1, rep1),
          TensorSpec("lm_head", (h, v), dtype, fsdp2, col)]
  return out


def moe_tensors(total: int, dtype: str, train: int, tp: int, dp: int, layers: int = 16,
                experts: int = 16) -> list[TensorSpec]:
  """A MoE pytree (Mixtral/DeepSeek-like, stacked experts), about `total` bytes.

  Trainer: EP over devices [0, train): experts [E, h, f] / [E, f, h] sharded on the
  expert dim, dense leaves FSDP on dim 0. Generator: TP x DP: experts column/row parallel
  on their ffn dim, attention as Llama, replicated router and norms.
  """
  item = bench_data.np_dtype(dtype).itemsize
  # Per layer: attention 2.5 h^2, experts 3 * E * h * 1.5h, router E*h; embed + head 64 h^2.
  per_h2 = layers * (2.5 + 4.5 * experts) + 64
  h = _round_to(math.sqrt(total / (per_h2 * item)), 128)
  f, kv, v = _round_to(1.5 * h, 128), h // 4, 32 * h
  mesh, at = f"mesh(dp={dp}, tp={tp})", f"@{train}"
  ep1, ep2 = f"mesh(ep={train}) P(ep) @0", f"mesh(ep={train}) P(ep, None) @0"
  ep3 = f"mesh(ep={train}) P(ep, None, None) @0"
  col, row = f"{mesh} P(None, tp) {at}", f"{mesh} P(tp, None) {at}"
  rep1, rep2 = f"{mesh} P(None) {at}", f"{mesh} P(None, None) {at}"
  out = [TensorSpec("embed", (v, h), dtype, ep2, row)]
  for layer in range(layers):
    p = f"layers.{layer}."
    out += _attention(p, h, kv, dtype, (ep1, rep1), (ep2, col), (ep2, row)) + [
        TensorSpec(p + "router", (h, experts), dtype, ep2, rep2),
        TensorSpec(p + "experts.w_gate", (experts, h, f), dtype, ep3,
                   f"{mesh} P(None, None, tp) {at}"),
        TensorSpec(p + "experts.w_up", (experts, h, f), dtype, ep3,
                   f"{mesh} P(None, None, tp) {at}"),
        TensorSpec(p + "experts.w_down", (experts, f, h), dtype, ep3,
                   f"{mesh} P(None, tp, None) {at}"),
    ]
  out += [TensorSpec("final_norm", (h,), dtype, ep1, rep1),
          TensorSpec("lm_head", (h, v), dtype, ep2, col)]
  return out


def model_cases(suite: str, total: int, dtype: str, n_devices: int) -> list[Case]:
  """Whole-model refits, trainer on the first half of the devices, generator on the rest."""
  train = max(1, min(n_devices, 8) // 2)
  tp = min(2, train)
  dp = train // tp
  gen = f"tp{tp}xdp{dp}"
  return [
      Case(suite, f"llama_fsdp{train}_to_{gen}",
           f"Llama-3-8B-shaped pytree (291 leaves), FSDP{train} -> TP{tp}xDP{dp} (other devs)",
           tuple(llama_tensors(total, dtype, train, tp, dp))),
      Case(suite, f"moe_ep{train}_to_{gen}",
           f"MoE pytree (163 leaves, 16 stacked experts), EP{train} -> TP{tp}xDP{dp} "
           "(other devs)", tuple(moe_tensors(total, dtype, train, tp, dp))),
  ]


def emulated_cases(suite: str, nbytes: int, dtype: str) -> list[Case]:
  """8 devices in emulated NVLink domains of 2 (jax_m2n's topology=2): ring + fan-out."""
  src = "mesh(x=4) P(x, None) @0"
  return [
      _two_d(suite, "4to2x2_domains2", "4 devs P(x,None) -> TP2xDP2 on 4 others, domains "
             "of 2 (ring forwarding)", nbytes, dtype, src,
             "mesh(dp=2, tp=2) P(tp, None) @4", domain_size=2),
      _two_d(suite, "4to4_replicate_domains2", "4 devs P(x,None) -> 4 others P(), domains "
             "of 2 (ring + fan-out)", nbytes, dtype, src, "mesh(x=4) P(None, None) @4",
             domain_size=2),
  ]


def smoke_cases(dtype: str) -> list[Case]:
  """Tiny versions of every kind of case (CI: validates the harness and every engine)."""
  nbytes = 256 << 10
  s2 = "mesh(x=2) P(x, None) @0"
  mixed = (
      TensorSpec("a", (48, 64), "float32", s2, "mesh(x=2) P(None, x) @2"),
      TensorSpec("b", (24, 32), dtype, s2, "mesh(x=2) P(None, None) @2"),
      TensorSpec("c", (96,), "int32", "mesh(x=2) P(x) @0", "mesh(x=3) P(None) @1"),
  )
  return [
      _two_d("smoke", "2to2_replicate", "2 devs -> 2 other devs P()", nbytes, dtype, s2,
             "mesh(x=2) P(None, None) @2"),
      _two_d("smoke", "2to2_dim0_to_dim1", "2 devs P(x,None) -> 2 other devs P(None,x)",
             nbytes, dtype, s2, "mesh(x=2) P(None, x) @2"),
      _two_d("smoke", "1to3_replicate", "1 dev -> 3 other devs P()", nbytes, dtype,
             "mesh(x=1) P(None, None) @0", "mesh(x=3) P(None, None) @1"),
      Case("smoke", "pytree_mixed", "3 leaves, mixed dtypes and layouts", mixed),
      _two_d("smoke", "4dev_dim0_to_dim1", "4 devs P(x,None) -> P(None,x) (in jit)", nbytes,
             dtype, "mesh(x=4) P(x, None) @0", "mesh(x=4) P(None, x) @0", colocated=True),
  ]


def build_cases(suites: Sequence[str], size_bytes: int, model_bytes: int, dtype: str,
                n_devices: int) -> list[Case]:
  """The data-movement cases of the chosen suites, in run order."""
  out: list[Case] = []
  for suite in suites:
    if suite == "smoke":
      out += smoke_cases(dtype)
    elif suite == "refit":
      out += refit_cases("refit", size_bytes, dtype, 2 * size_bytes)
    elif suite == "colocated":
      out += colocated_cases("colocated", size_bytes, dtype)
    elif suite == "model":
      out += model_cases("model", model_bytes, dtype, n_devices)
    elif suite == "emulated":
      out += emulated_cases("emulated", size_bytes, dtype)
  return out


# ---------------------------------------------------------------------------------------
# The planner suite: planning cost of a DeepSeek-V3-sized refit (no devices)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlannerModel:
  """A DeepSeek-V3-shaped refit: trainer EP x PP (one plan per stage) -> generator TP x DP.

  Stage s of the trainer holds its layers on `mesh(dp=trainer_dp, ep=ep)` (plain
  `mesh(ep)` when trainer_dp is 1), devices [n*s, n*s + n) with n = trainer_dp * ep; the
  generator is `mesh(dp, tp)` on the devices after the trainer's, or on the trainer's
  own devices from 0 when `colocated`. Every layer is MoE (stacked routed
  experts [E, ffn, hidden] x2 and [E, hidden, ffn]), with MLA attention, a shared expert,
  router and norms (HF `[out, in]` weight shapes).
  """

  name: str = "deepseek_v3"
  layers: int = 61
  ep: int = 16
  pp: int = 8
  tp: int = 16
  dp: int = 8
  hidden: int = 7168
  experts: int = 256
  moe_ffn: int = 2048
  vocab: int = 129280
  domain_size: int = 64
  nic_gbps: float = 50.0
  nvlink_gbps: float = 900.0
  dtype: str = "bfloat16"
  trainer_dp: int = 1
  colocated: bool = False

  @property
  def devices(self) -> int:
    trainer = self.trainer_dp * self.ep * self.pp
    return max(trainer, self.dp * self.tp) if self.colocated else trainer + self.dp * self.tp

  def stage_of(self, layer: int) -> int:
    return layer // -(-self.layers // self.pp)

  def descriptors(self) -> list[list[tuple[str, tuple[int, ...], str, str]]]:
    """Per stage: (name, shape, trainer descriptor, generator descriptor)."""
    h, E, F, V = self.hidden, self.experts, self.moe_ffn, self.vocab
    per_stage = self.trainer_dp * self.ep
    gen_first = 0 if self.colocated else per_stage * self.pp
    gmesh = f"mesh(dp={self.dp}, tp={self.tp})"
    tmesh = (f"mesh(ep={self.ep})" if self.trainer_dp == 1 else
             f"mesh(dp={self.trainer_dp}, ep={self.ep})")

    def t(stage, spec):
      return f"{tmesh} P({spec}) @{per_stage * stage}"

    def g(spec):
      return f"{gmesh} P({spec}) @{gen_first}"

    stages: list[list] = [[] for _ in range(self.pp)]
    stages[0].append(("embed_tokens", (V, h), t(0, "ep, None"), g("tp, None")))
    for layer in range(self.layers):
      s = self.stage_of(layer)
      p = f"layers.{layer}."
      rows = [
          ("input_layernorm", (h,), "ep", "None"),
          ("self_attn.q_a_proj", (1536, h), "ep, None", "None, None"),
          ("self_attn.q_a_layernorm", (1536,), "ep", "None"),
          ("self_attn.q_b_proj", (128 * 192, 1536), "ep, None", "tp, None"),
          ("self_attn.kv_a_proj_with_mqa", (576, h), "ep, None", "None, None"),
          ("self_attn.kv_a_layernorm", (512,), "ep", "None"),
          ("self_attn.kv_b_proj", (128 * 256, 512), "ep, None", "tp, None"),
          ("self_attn.o_proj", (h, 128 * 128), "ep, None", "None, tp"),
          ("post_attention_layernorm", (h,), "ep", "None"),
          ("mlp.gate.weight", (E, h), "ep, None", "None, None"),
          ("mlp.gate.e_score_correction_bias", (E,), "ep", "None"),
          ("mlp.experts.gate_proj", (E, F, h), "ep, None, None", "None, tp, None"),
          ("mlp.experts.up_proj", (E, F, h), "ep, None, None", "None, tp, None"),
          ("mlp.experts.down_proj", (E, h, F), "ep, None, None", "None, None, tp"),
          ("mlp.shared_experts.gate_proj", (F, h), "ep, None", "tp, None"),
          ("mlp.shared_experts.up_proj", (F, h), "ep, None", "tp, None"),
          ("mlp.shared_experts.down_proj", (h, F), "ep, None", "None, tp"),
      ]
      stages[s] += [(p + n, shape, t(s, ts), g(gs)) for n, shape, ts, gs in rows]
    last = self.pp - 1
    stages[last] += [("norm", (h,), t(last, "ep"), g("None")),
                     ("lm_head", (V, h), t(last, "ep, None"), g("tp, None"))]
    return stages

  def topology(self):
    from jax_m2n._src.topology import Topology
    return Topology(domain_size=self.domain_size, nic_gbps=self.nic_gbps,
                    nvlink_gbps=self.nvlink_gbps)


# The planner at scale: DeepSeek-V3 trained EP64 x PP8 x DP8 on 4,096 devices, refit into
# TP16 x DP256 on the same devices (colocated), NVLink domains of 64. ~3M transfers per
# stage plan; planned once, cold, in a fresh process (time and peak memory).
PLANNER_4096 = PlannerModel(name="deepseek_v3_4096", ep=64, pp=8, trainer_dp=8, tp=16,
                            dp=256, colocated=True)

SMOKE_PLANNER = PlannerModel(name="deepseek_mini", layers=4, ep=4, pp=2, tp=4, dp=2,
                             hidden=512, experts=16, moe_ffn=256, vocab=4096, domain_size=4)


def _parse_stages(model: PlannerModel, stages) -> list[tuple[list, list]]:
  from jax_m2n._src.layout import parse_layout
  out = []
  for rows in stages:
    out.append(([parse_layout(src, shape) for _, shape, src, _ in rows],
                [parse_layout(dst, shape) for _, shape, _, dst in rows]))
  return out


def _clear_planner_caches() -> None:
  from jax_m2n._src import planner
  # The bench measures cold planning, the size check from the layouts included.
  planner.clear_caches()


def _plan_stages(model: PlannerModel, layouts, itemsize: int, topo, route="hierarchical"):
  from jax_m2n._src.planner import plan_reshard
  return [plan_reshard(src, dst, [itemsize] * len(src), topo, route)
          for src, dst in layouts]


def planner_cold_once(model: PlannerModel) -> dict:
  """One cold planning of every stage: fresh layouts, cleared caches. Seconds."""
  itemsize = bench_data.np_dtype(model.dtype).itemsize
  stages = model.descriptors()
  topo = model.topology()
  _clear_planner_caches()
  t0 = time.perf_counter()
  layouts = _parse_stages(model, stages)
  t1 = time.perf_counter()
  c1 = time.process_time()
  plans = _plan_stages(model, layouts, itemsize, topo)
  c2 = time.process_time()
  t2 = time.perf_counter()
  # CPU seconds beside the wall clock: on a shared machine the wall clock also counts
  # other jobs' time slices (planning is one thread).
  return {"layouts_s": t1 - t0, "plan_s": t2 - t1, "plan_cpu_s": c2 - c1, "plans": plans,
          "layouts": layouts}


def process_of_8_once(model: PlannerModel, per_process: int = 8,
                      staging: bool = True) -> dict:
  """One process's host work of a multi-process refit, simulated without devices: plan
  every stage's tensors in one plan (one reshard call over the whole model, as every
  process plans the global call), cold, then encode the schedule of the process's
  `per_process` devices (the first host of the generator: its devices receive every
  replicated leaf, the most ops of any host; only their ops are found, as a process
  of the job finds its own). `staging`: the CUDA transport's encoding.
  Seconds (wall and CPU) and what was built."""
  from jax_m2n._src import schedule
  from jax_m2n._src.planner import plan_reshard
  itemsize = bench_data.np_dtype(model.dtype).itemsize
  layouts = _parse_stages(model, model.descriptors())
  src = [s for stage, _ in layouts for s in stage]
  dst = [d for _, stage in layouts for d in stage]
  _clear_planner_caches()
  schedule.clear_caches()
  first = model.trainer_dp * model.ep * model.pp if not model.colocated else 0
  t0, c0 = time.perf_counter(), time.process_time()
  plan = plan_reshard(src, dst, [itemsize] * len(src), model.topology())
  local = range(first, first + per_process)
  encoded = [schedule.encode(plan, d, staging, local=local) for d in local]
  seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
  return {"s": seconds, "cpu_s": cpu, "tensors": len(src), "devices": len(plan.devices),
          "transfers": sum(len(tp.transfers) for tp in plan.tensors),
          "chunks": len(plan.chunks), "process_devices": per_process,
          "process_ops": sum(int(e[5]) for e in encoded),
          "process_schedule_bytes": sum(e.nbytes for e in encoded)}


def _fresh_process_main(model_json: str) -> None:
  """Entry point of the fresh-process cold measurement (prints one JSON line): seconds,
  transfers (of the distinct tensor routes) and peak RSS before and after planning."""
  import resource
  from jax_m2n._src.planner import plan_size
  model = PlannerModel(**json.loads(model_json))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  r = planner_cold_once(model)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  t0 = time.perf_counter()
  bounds = [plan_size(src, dst, [1] * len(src)).transfers for src, dst in r["layouts"]]
  size_s = time.perf_counter() - t0
  transfers = sum(len(tp.transfers) for p in r["plans"]
                  for tp in {id(tp): tp for tp in p.tensors}.values())
  print(json.dumps({"layouts_s": r["layouts_s"], "plan_s": r["plan_s"],
                    "plan_cpu_s": r["plan_cpu_s"],
                    "transfers": transfers, "size_bound_transfers": sum(bounds),
                    "size_s": size_s, "max_rss_before_bytes": before,
                    "max_rss_bytes": peak}))


def planner_fresh_process(model: PlannerModel, timeout_s: float = 300.0) -> dict:
  """Cold planning measured in a new Python process (first plan after import):
  {layouts_s, plan_s, plan_cpu_s, transfers, size_bound_transfers, size_s, max_rss_before_bytes,
  max_rss_bytes}."""
  import jax_m2n
  pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_m2n.__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
  code = ("import sys; from jax_m2n.bench import suites; "
          "suites._fresh_process_main(sys.argv[1])")
  proc = subprocess.run(
      [sys.executable, "-c", code, json.dumps(dataclasses.asdict(model))],
      capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"fresh-process planner run failed ({proc.returncode}): "
                       f"{proc.stderr.strip()[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_planner_scale(model: PlannerModel, timeout_s: float = 1200.0) -> dict:
  """Plans every stage of a large `model` once, cold, in a fresh process: the seconds,
  the transfers and the peak memory (what `run_planner` reports, minus the repetitions,
  the cached calls and the other routes' estimates, which would triple a minutes-long
  run). Same result layout as `run_planner`."""
  fresh = planner_fresh_process(model, timeout_s)
  grown = fresh["max_rss_bytes"] - fresh["max_rss_before_bytes"]
  stages = model.descriptors()
  itemsize = bench_data.np_dtype(model.dtype).itemsize
  details = {
      "model": dataclasses.asdict(model), "devices": model.devices,
      "tensors": sum(len(s) for s in stages),
      "payload_bytes": sum(math.prod(shape) * itemsize for s in stages
                           for _, shape, _, _ in s),
      "transfers": fresh["transfers"],
      "size_bound_transfers": fresh["size_bound_transfers"],
      "size_check_s": fresh["size_s"],
      "plan_cpu_s": fresh["plan_cpu_s"],
      "max_rss_bytes": fresh["max_rss_bytes"],
      "rss_growth_bytes": grown,
      "rss_bytes_per_transfer": grown / max(fresh["transfers"], 1),
  }
  return {"timings": {"plan_cold_fresh_process": [fresh["plan_s"]],
                      "layouts_fresh_process": [fresh["layouts_s"]]},
          "targets_ms": {"plan_cold_fresh_process": 10000.0},
          "details": details}


def run_planner(model: PlannerModel, iters: int, cold_reps: int = 3,
                fresh_process: bool = True) -> dict:
  """Times planning of every stage of `model`: cold (cleared caches), fresh process, cached.

  Returns {"timings": {what: [seconds...]}, "targets_ms": {...}, "details": {...}}.
  Planning = `plan_reshard` of each PP stage (one plan per stage); layout construction
  (`parse_layout`) is timed apart; the bound and route estimates (`sol_ms`,
  `estimate_ms`, which plans the other two routes) are timed once, cold, apart.
  """
  timings: dict[str, list[float]] = {"layouts": [], "plan_cold": []}
  last = None
  for _ in range(cold_reps):
    last = planner_cold_once(model)
    timings["layouts"].append(last["layouts_s"])
    timings["plan_cold"].append(last["plan_s"])
  if fresh_process:
    fresh = planner_fresh_process(model)
    timings["plan_cold_fresh_process"] = [fresh["plan_s"]]
    timings["layouts_fresh_process"] = [fresh["layouts_s"]]
  itemsize = bench_data.np_dtype(model.dtype).itemsize
  topo = model.topology()
  layouts = last["layouts"]
  plans = last["plans"]
  cached = []
  for _ in range(iters):
    t0 = time.perf_counter()
    again = _plan_stages(model, layouts, itemsize, topo)
    cached.append(time.perf_counter() - t0)
  timings["plan_cached"] = cached
  cache_hit = all(a is b for a, b in zip(again, plans))
  process = [process_of_8_once(model) for _ in range(cold_reps)]
  timings["process_of_8"] = [r["s"] for r in process]
  t0 = time.perf_counter()
  per_stage = []
  for s, (p, (src, _)) in enumerate(zip(plans, layouts)):
    per_stage.append({
        "stage": s, "tensors": len(p.tensors), "payload_bytes": p.payload_bytes,
        "transfers": sum(len(tp.transfers) for tp in p.tensors), "devices": len(p.devices),
        "bytes_by_link": p.bytes_by_link, "sol_ms": p.sol_ms,
        "estimate_ms": dict(p.estimate_ms)})
  timings["bound_and_estimates"] = [time.perf_counter() - t0]
  details = {
      "model": dataclasses.asdict(model),
      "tensors": sum(len(p.tensors) for p in plans),
      "payload_bytes": sum(p.payload_bytes for p in plans),
      "transfers": sum(x["transfers"] for x in per_stage),
      "cache_hit": cache_hit,
      # One process of 8 devices: one plan over every stage, cold, and its 8 encodings.
      "process_of_8": {k: v for k, v in process[-1].items() if k != "s"},
      "process_of_8_cpu_s": [r["cpu_s"] for r in process],
      "stages": per_stage,
      "sol_ms_max_stage": max(x["sol_ms"] for x in per_stage),
      "sol_ms_sum_stages": sum(x["sol_ms"] for x in per_stage),
      "estimate_ms_sum_stages": {
          r: sum(x["estimate_ms"][r] for x in per_stage) for r in per_stage[0]["estimate_ms"]},
  }
  return {"timings": timings,
          "targets_ms": {"plan_cold": 1000.0, "plan_cold_fresh_process": 1000.0,
                         "plan_cached": 10.0, "process_of_8": 500.0},
          "details": details}
