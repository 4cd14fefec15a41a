"""GPU detection shared by the GPU tests (they are skipped without GPUs, as on CI; a
helper module: tests/BUILD). Importing it first also keeps NVLink multicast off, before
JAX loads NCCL (docs/cuda_transport.md)."""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402


def devices() -> list:
  """This process's JAX GPU devices ([] without a GPU backend)."""
  import jax  # noqa: PLC0415 - after NCCL_NVLS_ENABLE is set
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def count_without_jax() -> int:
  """How many GPUs `nvidia-smi -L` lists: for a launcher that must not touch them
  itself (JAX would preallocate their memory); 0 without nvidia-smi."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def need(n: int, have: int) -> None:
  """Skips the test unless `have` >= n GPUs."""
  if have < n:
    pytest.skip(f"needs {n} GPUs; have {have}")
