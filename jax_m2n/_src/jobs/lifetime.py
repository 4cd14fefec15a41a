"""How the two ends (`Publisher`, `Subscriber`) end: `close()`, `with`, or garbage
collection of the last reference, all through one `weakref.finalize` the end makes over
what it holds (never over itself: no thread refers back to an end, so collection
reaches it). Owns nothing else.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


class Closing:
  """`close()` (at most once) and the context manager of an end; `_closed` says it
  closed. The end calls `_close_with(shut, *held)` once it holds everything."""

  _closed = False
  _finalizer: Any = None

  def _close_with(self, shut: Callable[..., None], *held: Any) -> None:
    self._finalizer = weakref.finalize(self, shut, *held)

  def close(self) -> None:
    self._closed = True
    if self._finalizer is not None:
      self._finalizer()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()
