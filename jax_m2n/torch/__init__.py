"""jax_m2n for PyTorch generators: pull a JAX trainer's `jax_m2n.Publisher` versions into
torch tensors (docs/torch.md). Importing it imports torch; `import jax_m2n` does not.

    >>> import jax_m2n.torch as jt                                    # doctest: +SKIP
    >>> sub = jt.Subscriber("trainer:7000", token=token, rank=r, world_size=tp)  # doctest: +SKIP
    >>> sub.pull_into(tensors, names=..., placements={"qkv": jt.Shard(0)})     # doctest: +SKIP
"""

from jax_m2n._src.torch.subscriber import Subscriber as Subscriber
from jax_m2n._src.torch.pull import TorchPull as TorchPull
from jax_m2n._src.torch.targets import Into as Into
from jax_m2n._src.torch.targets import Replicate as Replicate
from jax_m2n._src.torch.targets import Shard as Shard
from jax_m2n._src.torch.targets import Slice as Slice
from jax_m2n._src.torch.targets import dotted as dotted

__all__ = ["Into", "Replicate", "Shard", "Slice", "Subscriber", "TorchPull", "dotted"]
