"""The box-and-arrow figures of docs/design.md (draw_design.py, draw_processes.py).

Owns what the figures share: an empty figure in figure units, rounded boxes with a bold
title and a smaller detail text, and saving as SVG with text kept as text.
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
from matplotlib.patches import FancyBboxPatch  # pylint: disable=g-import-not-at-top,wrong-import-position


def figure(size, xmax, ymax):
  """An empty figure of `size` inches whose axes run 0..xmax and 0..ymax, hidden."""
  plt.rcParams["svg.fonttype"] = "none"  # text stays text: small, diffable
  fig, ax = plt.subplots(figsize=size)
  ax.set_xlim(0, xmax)
  ax.set_ylim(0, ymax)
  ax.axis("off")
  return fig, ax


def boxes(ax, specs, title_size, detail_size, title_drop, detail_drop):
  """Draws each (x, y, width, height, colour, title, detail) of `specs`: the title
  `title_drop` below the top edge, the detail (if any) centred in the rest."""
  for x, y, w, h, colour, title, detail in specs:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                fc=colour, ec="#444444", lw=1.0))
    ax.text(x + w / 2, y + h - title_drop, title, ha="center", va="center",
            fontsize=title_size, fontweight="bold")
    if detail:
      ax.text(x + w / 2, y + (h - detail_drop) / 2, detail, ha="center", va="center",
              fontsize=detail_size, linespacing=1.3)


def save(fig, out):
  fig.savefig(out, bbox_inches="tight", metadata={"Date": None})
  print(f"wrote {out}")
