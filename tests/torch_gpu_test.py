"""jax_m2n.torch on one GPU: a JAX Publisher (a program of its own on the GPU, 0.3 of
its memory) and torch tensors on the same GPU in this process (JAX here on the CPU):
bitwise across a conversion and TP placements; the data path each pull took is
recorded (today the torch subscriber declines CUDA exports and crosses the host).
Skips where torch sees no CUDA device (CI); `.gpu/torch.sh` runs it on one GPU.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

import torch  # requirements/torch.txt (the test set)

import jax_m2n.torch as jt

# Marked, not skipped at import: a file whose every test is skipped at collection
# counts as collecting nothing, which tests/pytest_main.py fails.
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device torch can use (.gpu/torch.sh)")

TOKEN = "torch-gpu-test-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PUBLISHER = textwrap.dedent("""
    import os, sys, time
    import jax, numpy as np, jax_m2n
    d = sys.argv[1]
    pub = jax_m2n.Publisher(token=sys.argv[2], keep=2)
    x = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024) * 0.5
    for v in range(1, 4):
      pub.publish({"w": jax.device_put(x + v, jax.devices()[0])})
    with open(d + "/addr.tmp", "w") as f:
      f.write(pub.address + " " + jax.devices()[0].platform)
    os.replace(d + "/addr.tmp", d + "/addr")
    while not os.path.exists(d + "/done"):
      time.sleep(0.1)
""")


def test_a_gpu_publisher_into_torch_cuda_tensors_bitwise():
  d = tempfile.mkdtemp()
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.3",
             PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  env.pop("JAX_PLATFORMS", None)
  env.pop("XLA_FLAGS", None)
  p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, d, TOKEN], env=env)
  try:
    deadline = time.monotonic() + 180
    while not os.path.exists(d + "/addr"):
      assert p.poll() is None and time.monotonic() < deadline, "the publisher died"
      time.sleep(0.1)
    address, platform = open(d + "/addr").read().split()
    assert platform == "gpu" or platform == "cuda", platform
    x = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024) * 0.5
    for world in (1, 2):
      for rank in range(world):
        with jt.Subscriber(address, token=TOKEN, rank=rank, world_size=world) as sub:
          dst = torch.empty(1024 // world, 1024, dtype=torch.bfloat16, device="cuda")
          v = sub.pull_into({"w": dst}, placements={"w": jt.Shard(0)}, version=3,
                            timeout_s=120)
          torch.cuda.synchronize()
          want = (x + v)[rank * 1024 // world:(rank + 1) * 1024 // world].astype(
              ml_dtypes.bfloat16)
          np.testing.assert_array_equal(dst.cpu().view(torch.int16).numpy(),
                                        want.view(np.int16))
          print("path", sub.last_pull.path, "rank", rank, "of", world)
  finally:
    open(d + "/done", "w").close()
    p.wait(timeout=60)
