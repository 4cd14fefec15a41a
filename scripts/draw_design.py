"""Draws docs/reshard_flow.svg, the figure in docs/design.md: how one reshard runs.

Planning (layouts, planner, chunks) -> the int64 schedule -> eager per-device programs
(across device sets) or the in-jit shard_map (one device set) -> the transports.
Owns the figure only; rerun after changing the flow:
  .venv/bin/python scripts/draw_design.py [OUT.svg]
"""

import sys

import flow_figure
from matplotlib.patches import FancyArrowPatch

PLAN, SCHED, RUN, XPORT = "#dbe9f6", "#fde9c8", "#e2f0d9", "#ead9f0"

# name: (x, y, width, height, colour, title, detail); coordinates in figure units.
BOXES = {
    "call": (0.5, 8.6, 4.2, 1.0, "#f2f2f2", "jax_m2n.reshard(x, dst)",
             "a pytree; jax_m2n.plan stops at the plan"),
    "check": (5.4, 8.6, 4.2, 1.0, "#f2f2f2", "validate",
              "ReshardError before data moves"),
    "layout": (0.5, 6.7, 2.9, 1.2, PLAN, "layout",
               "Sharding + shape\n-> per-device boxes"),
    "planner": (3.6, 6.7, 2.9, 1.2, PLAN, "planner",
                "transfers: route, owners,\nleaders, ring (topology)"),
    "chunks": (6.7, 6.7, 2.9, 1.2, PLAN, "chunks",
               "chunk_bytes -> steps"),
    "schedule": (2.6, 5.0, 5.0, 1.0, SCHED, "schedule (int64 FFI attribute)",
                 "docs/schedule_format.md; cached per plan"),
    "eager": (0.5, 2.9, 4.2, 1.4, RUN, "eager, across device sets",
              "one jitted program per device,\neach one custom call jax_m2n_reshard"),
    "jit": (5.4, 2.9, 4.2, 1.4, RUN, "inside jax.jit (one device set)",
            "shard_map: the custom call on\nevery device, no XLA collective"),
    "cpu": (0.5, 0.6, 4.2, 1.4, XPORT, "CPU transport",
            "in-process: box copies between\nhost buffers (xla_ffi/)"),
    "cuda": (5.4, 0.6, 4.2, 1.4, XPORT, "CUDA transport",
             "NCCL send/recv and peer copies on\nthe XLA stream, pack kernels (xla_ffi/cuda/)"),
}

ARROWS = [
    ("call", "check", "e", "w"), ("check", "layout", "s", "n"),
    ("layout", "planner", "e", "w"), ("planner", "chunks", "e", "w"),
    ("chunks", "schedule", "s", "n"), ("schedule", "eager", "s", "n"),
    ("schedule", "jit", "s", "n"), ("eager", "cpu", "s", "n"), ("eager", "cuda", "s", "n"),
    ("jit", "cpu", "s", "n"), ("jit", "cuda", "s", "n"),
]


def _anchor(name, side):
  x, y, w, h = BOXES[name][:4]
  return {"n": (x + w / 2, y + h), "s": (x + w / 2, y), "e": (x + w, y + h / 2),
          "w": (x, y + h / 2)}[side]


def draw(out):
  fig, ax = flow_figure.figure((8.0, 8.2), 10.1, 10.0)
  flow_figure.boxes(ax, BOXES.values(), 10, 8.5, 0.28, 0.45)
  for a, b, sa, sb in ARROWS:
    ax.add_patch(FancyArrowPatch(_anchor(a, sa), _anchor(b, sb), arrowstyle="-|>",
                                 mutation_scale=12, lw=1.1, color="#333333",
                                 shrinkA=2, shrinkB=2))
  for y, label in ((7.3, "planning\n(no devices)"), (5.5, "hand-off"),
                   (3.6, "execution"), (1.3, "transports")):
    ax.text(10.05, y, label, ha="right", va="center", fontsize=8, color="#666666",
            rotation=90)
  flow_figure.save(fig, out)


if __name__ == "__main__":
  draw(sys.argv[1] if len(sys.argv) > 1 else "docs/reshard_flow.svg")
