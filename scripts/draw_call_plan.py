"""Draws docs/call_plan_flow.svg, the figure of docs/dev_contracts.md "From a call to its
plan": every path's one way from a reshard call to its plan (the checked options, then
call_plan.plan_call's steps, then what each path does with the CallPlan).
Owns the figure only; rerun after changing the flow:
  .venv/bin/python scripts/draw_call_plan.py [OUT.svg]
"""

import sys

import flow_figure
from matplotlib.patches import FancyArrowPatch

CALL, CHECK, PLAN, USE = "#dbe9f6", "#fde9c8", "#e2f0d9", "#f2f2f2"

# name: (x, y, width, height, colour, title, detail)
BOXES = {
    "eager": (0.2, 8.0, 2.3, 1.1, CALL, "eager call", "api.reshard outside jit\n"
              "(eager/programs.py)"),
    "jit": (2.7, 8.0, 2.3, 1.1, CALL, "in jit", "the primitive's lowering\n"
            "(traced.py)"),
    "procs": (5.2, 8.0, 2.3, 1.1, CALL, "across processes", "an eager call over\n"
              "several processes"),
    "plan": (7.7, 8.0, 2.3, 1.1, CALL, "jax_m2n.plan", "no data moves\n(api.py)"),
    "options": (0.2, 6.2, 9.8, 1.2, CHECK, "checks.options(api, route, topology, timeout_s, "
                "chunk_bytes) -> Options",
                "each per-call rule once; frozen, hashable: the eager cache key, the "
                "primitive's one `options` parameter, the fingerprint"),
    "plan_call": (0.2, 2.6, 9.8, 3.0, PLAN, "call_plan.plan_call(shapes, dtypes, srcs, "
                  "dsts, options, out_dtypes, path=...) -> CallPlan",
                  "1 devices and platform (every source and destination device)\n"
                  "2 topology: as_topology(options.topology, devices)\n"
                  "3 layouts: Layout.from_sharding per leaf and side\n"
                  "4 wire itemsizes and conversion codes (schedule.wire_itemsizes)\n"
                  "5 chunking for the platform's transport, options.chunk_bytes\n"
                  "6 planner.plan_reshard (cached)   7 the debug line naming the path"),
    "u_eager": (0.2, 0.4, 2.3, 1.6, USE, "per-device programs",
                "schedule.encode per\ndevice; one jitted\ncustom call each"),
    "u_jit": (2.7, 0.4, 2.3, 1.6, USE, "shard_map body", "schedule.encode (SPMD);\n"
              "one custom call\nper device"),
    "u_procs": (5.2, 0.4, 2.3, 1.6, USE, "CrossProcessReshard", "fingerprint, waves\n"
                "of the transfer\nengine"),
    "u_plan": (7.7, 0.4, 2.3, 1.6, USE, "Plan", "returned to the\ncaller"),
}

ARROWS = [("eager", "options"), ("jit", "options"), ("procs", "options"),
          ("plan", "options")]
DOWN = [("eager", "u_eager"), ("jit", "u_jit"), ("procs", "u_procs"), ("plan", "u_plan")]


def draw(out):
  fig, ax = flow_figure.figure((8.6, 7.6), 10.2, 9.3)
  flow_figure.boxes(ax, BOXES.values(), 8.6, 7.4, 0.28, 0.5)
  for a, _ in ARROWS:
    x, y, w, _h = BOXES[a][:4]
    top = BOXES["options"][1] + BOXES["options"][3]
    ax.add_patch(FancyArrowPatch((x + w / 2, y), (x + w / 2, top), arrowstyle="-|>",
                                 mutation_scale=12, lw=1.2, color="#333333"))
  for y0, y1 in ((BOXES["options"][1], BOXES["plan_call"][1] + BOXES["plan_call"][3]),):
    ax.add_patch(FancyArrowPatch((5.1, y0), (5.1, y1), arrowstyle="-|>",
                                 mutation_scale=12, lw=1.2, color="#333333"))
  for _, b in DOWN:
    x, y, w, h = BOXES[b][:4]
    ax.add_patch(FancyArrowPatch((x + w / 2, BOXES["plan_call"][1]), (x + w / 2, y + h),
                                 arrowstyle="-|>", mutation_scale=12, lw=1.2,
                                 color="#333333"))
  flow_figure.save(fig, out)


if __name__ == "__main__":
  draw(sys.argv[1] if len(sys.argv) > 1 else "docs/call_plan_flow.svg")
