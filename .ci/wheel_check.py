"""CI check of the installed wheel: run by .ci/run with a fresh venv's python, from a
directory outside the repository, so `import jax_m2n` can only find the wheel.

Each check prints `PASS <name>` or `FAIL <name>: <why>`, then one closing line
"wheel checks: N passed, N failed"; the exit status is 1 if any failed.
"""

import importlib.metadata as md
import os
import sys
import traceback

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.realpath(sys.argv[1]) if len(sys.argv) > 1 else None


def check_imported_from_the_wheel():
  import jax_m2n
  path = os.path.realpath(jax_m2n.__file__)
  assert "site-packages" in path, f"jax_m2n from {path}, not an installed wheel"
  assert REPO is None or not path.startswith(REPO + os.sep), f"jax_m2n from the repo: {path}"


def check_metadata():
  import jax_m2n
  meta = md.metadata("jax_m2n")
  assert md.version("jax_m2n") == jax_m2n.__version__, (
      f"dist {md.version('jax_m2n')} != __version__ {jax_m2n.__version__}")
  # License-Expression (metadata 2.4) or License, depending on scikit-build-core.
  license_ = meta.get("License-Expression") or meta.get("License")
  assert license_ == "Apache-2.0", license_
  requires = md.requires("jax_m2n") or []
  assert any(r.startswith("jax") and "<0.12" in r for r in requires), requires
  files = [str(f) for f in md.files("jax_m2n") or []]
  assert "jax_m2n/py.typed" in files, "no py.typed in the wheel"
  assert any(f.endswith("licenses/LICENSE") for f in files), "no LICENSE in the wheel"


def check_cpu_extension_and_reshard():
  import jax_m2n
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devices = jax.devices()
  assert len(devices) == 8, devices
  src = Mesh(np.array(devices[:4]).reshape(2, 2), ("fsdp", "tp"))
  dst = Mesh(np.array(devices[4:]).reshape(2, 2), ("dp", "tp"))
  host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  x = jax.device_put(host, NamedSharding(src, P("fsdp", "tp")))
  out = jax_m2n.reshard(x, NamedSharding(dst, P(None, "tp")))
  assert out.sharding == NamedSharding(dst, P(None, "tp")), out.sharding
  np.testing.assert_array_equal(np.asarray(out), host)


def check_cuda_extension_when_built():
  files = [str(f) for f in md.files("jax_m2n") or []]
  cuda = [f for f in files if f.startswith("jax_m2n/_ffi_cuda")]
  if not cuda:
    print("  (the wheel has no CUDA extension: built without nvcc)")
    return
  import importlib
  module = importlib.import_module("jax_m2n._ffi_cuda")  # loads without a GPU
  assert module is not None


def main():
  passed = failed = 0
  for name, check in list(globals().items()):
    if name.startswith("check_") and callable(check):
      try:
        check()
        print(f"PASS {name}")
        passed += 1
      except Exception as e:  # pylint: disable=broad-except
        print(f"FAIL {name}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        failed += 1
  print(f"wheel checks: {passed} passed, {failed} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
