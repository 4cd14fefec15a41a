"""The PEP 517 build backend of pyproject.toml: scikit-build-core, plus NCCL's headers.

Owns one decision: whether the CUDA extension will be built, so that an isolated
`pip install .` / `pip wheel .` gets the nvidia-nccl-cu13 wheel (nccl.h; about 300 MB)
only where it is needed. Mirrors CMakeLists.txt's JAX_M2N_CUDA: OFF never, ON always,
AUTO (default) when nvcc is found ($CUDACXX, $CUDA_PATH/bin, /usr/local/cuda/bin,
PATH). Everything else is scikit-build-core's.
"""

from __future__ import annotations

import os
import re
import shutil

from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)
from scikit_build_core import build as _skbuild

NCCL_REQUIREMENT = "nvidia-nccl-cu13>=2.28,<3"


def _cuda_setting(config_settings) -> str:
  """JAX_M2N_CUDA as pip (-C cmake.define.X=), SKBUILD_CMAKE_DEFINE or CMAKE_ARGS set it."""
  value = (config_settings or {}).get("cmake.define.JAX_M2N_CUDA")
  if isinstance(value, list):
    value = value[-1] if value else None
  if value is None:
    for name, pattern in (("SKBUILD_CMAKE_DEFINE", r"(?:^|;)JAX_M2N_CUDA=([^;]*)"),
                          ("CMAKE_ARGS", r"-DJAX_M2N_CUDA(?::\w+)?=(\S+)")):
      m = re.search(pattern, os.environ.get(name, ""))
      if m:
        value = m.group(1)
  return str(value or "AUTO").upper()


def _nvcc_found() -> bool:
  candidates = [os.environ.get("CUDACXX", "")]
  if os.environ.get("CUDA_PATH"):
    candidates.append(os.path.join(os.environ["CUDA_PATH"], "bin", "nvcc"))
  candidates += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc") or ""]
  return any(c and os.access(c, os.X_OK) for c in candidates)


def _with_nccl(requires: list[str], config_settings) -> list[str]:
  setting = _cuda_setting(config_settings)
  if setting in ("OFF", "0", "FALSE", "NO") or (setting == "AUTO" and not _nvcc_found()):
    return requires
  return [*requires, NCCL_REQUIREMENT]


def get_requires_for_build_wheel(config_settings=None):
  return _with_nccl(_skbuild.get_requires_for_build_wheel(config_settings), config_settings)


def get_requires_for_build_editable(config_settings=None):
  return _with_nccl(_skbuild.get_requires_for_build_editable(config_settings),
                    config_settings)
