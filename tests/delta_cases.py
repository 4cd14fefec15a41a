"""Which elements a delta test changes: the case table shared by tests/jobs_delta_test.py
and tests/jobs_delta_device_test.py (a helper module, not a test)."""

import numpy as np

from jax_m2n._src.jobs.codec import CHUNK


def changes(rng: np.random.Generator, n: int, how: str) -> np.ndarray:
  """A bool per element of a flat array of `n`: True where a test changes it. `how`:
  none, sparse (1 in 500), runs (9 runs of up to 300), half, most (97.5%: near where a
  dense chunk wins, so the mode depends on the element's width), all, or mixed (one
  chunk of each mode: sparse, runs, bitmap, dense)."""
  mask = np.zeros(n, bool)
  if how == "sparse":
    mask[rng.integers(0, n, max(1, n // 500))] = True
  elif how == "runs":
    for start in rng.integers(0, n, 9):
      mask[start:start + int(rng.integers(1, 300))] = True
  elif how == "half":
    mask = rng.random(n) < 0.5
  elif how == "most":
    mask = rng.random(n) < 0.975
  elif how == "all":
    mask[:] = True
  elif how == "mixed":
    mask[:CHUNK:700] = True
    mask[CHUNK:CHUNK + 40] = True
    mask[2 * CHUNK + 1:3 * CHUNK:2] = True
    mask[3 * CHUNK:4 * CHUNK] = True
  elif how != "none":
    raise ValueError(f"changes: how must be a case of the table; got {how!r}.")
  return mask
