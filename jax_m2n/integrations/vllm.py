"""vLLM's weight transfer through jax_m2n: `register()`, and JAX arrays as a WeightSource.

Owns the registration of the "jax_m2n" backend in vLLM's two registries
(`WeightTransferEngineFactory`: the worker engine that pulls a Publisher's version into
the worker's model; `WeightTransferTrainerFactory`: the trainer engine that publishes a
JAX pytree and drives start / update / finish through vLLM's `VLLMWeightSyncClient`),
by module path, so vLLM imports the engines only when one is made. `import jax_m2n`
(and this module) never imports vLLM or torch; `register()` and `source()` do. The
engines themselves are jax_m2n/integrations/vllm_engines.py (docs/torch.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "register", "source"]

BACKEND = "jax_m2n"
_ENGINES = "jax_m2n.integrations.vllm_engines"


def register() -> None:
  """Registers the "jax_m2n" worker and trainer engines with vLLM (idempotent). Call
  it in the trainer and in each vLLM worker process before its engine is made (e.g.
  from a vLLM plugin, or at the top of the program that starts the workers)."""
  from vllm.distributed.weight_transfer import (WeightTransferEngineFactory,
                                                WeightTransferTrainerFactory)
  if BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001 - vLLM's registry
    WeightTransferEngineFactory.register_engine(BACKEND, _ENGINES,
                                                "JaxM2NWeightTransferEngine")
  if BACKEND not in WeightTransferTrainerFactory._registry:  # noqa: SLF001
    WeightTransferTrainerFactory.register_engine(BACKEND, _ENGINES,
                                                 "JaxM2NTrainerWeightTransferEngine")


def source(tree: Any, names: Any = None) -> Any:
  """A JAX pytree as a vLLM `WeightSource` (`vllm_engines.JaxWeightSource`): metadata
  and placements from the JAX shardings, `iter_local` / `iter_full` through dlpack."""
  from jax_m2n.integrations import vllm_engines
  return vllm_engines.JaxWeightSource(tree, names)
