"""Python's cyclic garbage collector paused around work that makes objects by the
hundred thousand and no cycles: routing a large model's tensors, a process's ops of a
large plan, an eager call's per-device outputs (a 64-device call of 856 leaves makes
55,000 arrays: the collections it triggered took a quarter of the call).

Imports nothing of jax_m2n: every room may use it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused(*, promote: bool = False) -> Iterator[None]:
  """The cyclic GC off inside; with `promote`, what was allocated meanwhile handed to
  the oldest generation on the way out.

  `promote` is for work whose objects outlive it (a plan and its schedules, built
  programs): left in the young generation they would be rescanned by the collections
  that follow (a third of the planning time of a DeepSeek-V3-sized model even with the
  GC off while routing). `gc.freeze` then `gc.unfreeze` moves every tracked object to
  the oldest generation in O(1), so only the next full collection visits them, once.
  Not for a call made every step (an eager reshard's dispatch): it would promote the
  application's young garbage too and keep it until a full collection (a publisher and
  subscriber made and closed in a loop: RSS 3 -> 6 MiB above its warm level).
  Skipped (plain disable) when the application froze objects itself: unfreezing would
  undo its freeze. Nested or concurrent pauses leave the GC enabled-state to the
  outermost one that found it enabled.
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if promote and gc.get_freeze_count() == 0:
      gc.freeze()
      gc.unfreeze()
    if enabled:
      gc.enable()
