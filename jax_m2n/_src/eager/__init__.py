"""The eager path: one compiled program per participating device over every leaf of the
call, any device sets.

Owns building (and caching) the per-device programs of a reshard outside jit,
dispatching them concurrently (one thread per device), and assembling their outputs
into global arrays. Argument rules live in checks.py; it never decides what moves.

One concern per module, dependencies one way (each imports only those above it):
  dispatch.py   device worker threads and the waits on them
  calls.py      a call's lifecycle: dispatch lock, CPU generations, the failure watcher
  programs.py   building, compiling (shared per device schedule) and running the
                per-device programs of one call's layouts
  cache.py      the built calls' cache, its key and the checks before an entry is used
  delegate.py   which leaves jax.device_put keeps; the eager reshard of a list of leaves

The names below are the ones the rest of jax_m2n (and its tests) use as `eager.<name>`.
Module state that tests set (`dispatch._fault_hook`, `programs._CPU_ASYNC`) is set on
the module that reads it, not here.
"""

from jax_m2n._src.eager.cache import (EAGER_CACHE_SIZE, HashedKey, LruCache,
                                      check_request, eager_cache, eager_key,
                                      lookup_or_build)
from jax_m2n._src.eager.calls import (TICKETS, site_states, state_of_site,
                                      stop_threads_at_exit, tickets_of)
from jax_m2n._src.eager.delegate import (astype, default_memory, delegated_because,
                                         dtype_delegated_because, reshard)
from jax_m2n._src.eager.programs import EagerReshard, build_programs
