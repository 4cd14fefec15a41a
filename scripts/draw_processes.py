"""Draws docs/processes_flow.svg, the "Across processes" figure in docs/design.md: one
reshard across CPU processes (the call sequence, plan fingerprints and liveness in the
jax.distributed key-value store; bytes through JAX's transfer server; in-process copies).
Owns the figure only; rerun after changing the flow:
  .venv/bin/python scripts/draw_processes.py [OUT.svg]
"""

import sys

import flow_figure
from matplotlib.patches import FancyArrowPatch

PROC, KV, DEV = "#e2f0d9", "#fde9c8", "#dbe9f6"

# name: (x, y, width, height, colour, title, detail)
BOXES = {
    "kv": (0.4, 7.6, 9.3, 1.3, KV, "jax.distributed key-value store (coordination service)",
           "per call n: fp/<p> (plan fingerprint)  outcome ('done' or the first failure)  "
           "done (a counter)\nper process: addr/<p> (transfer server)  beat/<p> "
           "(every 0.25 s: its count, the calls it finished)  gone/<p> (at exit)"),
    "p0": (0.4, 2.2, 2.9, 4.4, PROC, "process 0 (source)", ""),
    "p1": (3.6, 2.2, 2.9, 4.4, PROC, "process 1", ""),
    "p2": (6.8, 2.2, 2.9, 4.4, PROC, "process 2", ""),
    "d0": (0.7, 4.2, 1.1, 0.9, DEV, "dev 0", "src shard"),
    "d1": (1.9, 4.2, 1.1, 0.9, DEV, "dev 1", "src shard"),
    "d2": (3.9, 4.2, 1.1, 0.9, DEV, "dev 2048", "leader"),
    "d3": (5.1, 4.2, 1.1, 0.9, DEV, "dev 2049", "replica"),
    "d4": (7.1, 4.2, 1.1, 0.9, DEV, "dev 4096", "leader"),
    "d5": (8.3, 4.2, 1.1, 0.9, DEV, "dev 4097", "replica"),
    "note": (0.4, 0.2, 9.3, 1.5, "#f2f2f2", "one call, every process",
             "1 number it, post fp, pull everything (waits at the senders)  2 compare "
             "fingerprints (ReshardValueError before any\nbyte)  3 offer every chunk, "
             "copy in-process: ordered by data, no store round per chunk  4 assemble; done "
             "+1;\nwait for the outcome (then donate)  A peer's failure, or a silent beat / "
             "stalled data and a failed probe: fails, naming it"),
}

ARROWS = [
    ("d0", "d2", "inject (transfer server)", 0.25), ("d2", "d4", "forward", 0.25),
    ("d2", "d3", "fanout\n(in-process)", 0.0), ("d4", "d5", "fanout", 0.0),
]


def _centre(name):
  x, y, w, h = BOXES[name][:4]
  return x + w / 2, y + h / 2


def draw(out):
  fig, ax = flow_figure.figure((8.4, 7.6), 10.1, 9.2)
  flow_figure.boxes(ax, BOXES.values(), 9, 7.2, 0.25, 0.4)
  for a, b, label, rad in ARROWS:
    (xa, ya), (xb, yb) = _centre(a), _centre(b)
    ya, yb = ya - 0.45, yb - 0.45
    ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-|>", mutation_scale=12,
                                 lw=1.2, color="#333333", shrinkA=2, shrinkB=2,
                                 connectionstyle=f"arc3,rad={rad}"))
    ax.text((xa + xb) / 2, min(ya, yb) - 0.35 - 1.2 * rad, label, ha="center", va="top",
            fontsize=7.5)
  for name in ("p0", "p1", "p2"):
    x, y, w, h = BOXES[name][:4]
    ax.add_patch(FancyArrowPatch((x + w / 2, y + h), (x + w / 2, 7.6), arrowstyle="<|-|>",
                                 mutation_scale=10, lw=0.9, color="#996600", shrinkA=1,
                                 shrinkB=1))
  flow_figure.save(fig, out)


if __name__ == "__main__":
  draw(sys.argv[1] if len(sys.argv) > 1 else "docs/processes_flow.svg")
