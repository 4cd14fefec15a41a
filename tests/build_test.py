"""The two build descriptions agree, and the extensions they build are sound.

Bazel (xla_ffi/BUILD) finds sources by glob; CMakeLists.txt (the pip / GPU
machine build) lists them by name. These tests fail, naming the CMake list to
edit, when a file is added or removed on one side only. Runs under Bazel
(//tests:build_test) and with plain pytest from the repository root.
"""

import os
import re
from pathlib import Path

import pytest

# Not resolved: under Bazel the runfiles tree (with the built .so files) is the root.
ROOT = Path(os.path.abspath(__file__)).parent.parent
XLA_FFI = ROOT / "xla_ffi"
# Built without CUDA (no toolkit, no NCCL headers, or JAX_M2N_NO_CUDA=1; see
# bazel/local_cuda.bzl): //jax_m2n carries no _ffi_cuda.so.
NO_CUDA = (os.environ.get("JAX_M2N_NO_CUDA", "0") not in ("", "0")
           or not (ROOT / "jax_m2n" / "_ffi_cuda.so").exists())
# SASS for each, PTX for the last (bazel/cuda.bzl, CMakeLists.txt).
CUDA_ARCHS = ("80", "90", "100")


def _cmake_lists():
    """{name: [items]} for every `set(NAME item...)` in CMakeLists.txt."""
    text = (ROOT / "CMakeLists.txt").read_text()
    text = re.sub(r"#[^\n]*", "", text)
    return {
        m.group(1): m.group(2).split()
        for m in re.finditer(r"\bset\(\s*(JAX_M2N_\w+)\s+([^)]*)\)", text)
    }


def _rel(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def _bazel_sources():
    """What xla_ffi/BUILD's globs select, per target (see the table there)."""
    cuda_dir = XLA_FFI / "cuda"
    kernels = list(cuda_dir.glob("*.cu.cc")) + list(cuda_dir.glob("*.cu"))
    return {
        "JAX_M2N_CPU_SRCS": _rel(p for p in XLA_FFI.glob("*.cc")
                                 if not p.name.startswith("module")),
        "JAX_M2N_MODULE_CPU_SRCS": _rel(XLA_FFI.glob("module_cpu.cc")),
        "JAX_M2N_CUDA_SRCS": _rel(kernels),
        "JAX_M2N_MODULE_CUDA_SRCS": _rel(p for p in cuda_dir.glob("*.cc")
                                         if not p.name.endswith(".cu.cc")),
    }


@pytest.mark.parametrize("list_name", sorted(_bazel_sources()))
def test_cmake_lists_same_sources_as_bazel(list_name):
    expected = _bazel_sources()[list_name]
    listed = _cmake_lists().get(list_name)
    assert listed is not None, f"CMakeLists.txt: set({list_name} ...) not found."
    missing = sorted(set(expected) - set(listed))
    extra = sorted(set(listed) - set(expected))
    assert not missing and not extra, (
        f"CMakeLists.txt: {list_name} must list exactly the files Bazel builds "
        f"(globs in xla_ffi/BUILD); add {missing}, remove {extra}.")


def test_module_files_are_not_in_the_cpu_library():
    # module*.cc hold NB_MODULE; only the extension targets may compile them.
    assert not any("module" in Path(p).name
                   for p in _cmake_lists().get("JAX_M2N_CPU_SRCS", []))


def test_cmake_copts_match_bazel():
    bzl = (ROOT / "bazel" / "defs.bzl").read_text()
    bazel = re.findall(r'"([^"]+)"', re.search(r"COPTS = \[(.*?)\]", bzl, re.S).group(1))
    assert _cmake_lists().get("JAX_M2N_COPTS") == bazel, (
        "CMakeLists.txt: JAX_M2N_COPTS must equal COPTS in bazel/defs.bzl.")


def _extension(name):
    path = ROOT / "jax_m2n" / f"{name}.so"
    if not path.exists():
        pytest.skip(f"{path} not built (run ./scripts/setup.sh)")
    return path.read_bytes()


@pytest.mark.skipif(not (XLA_FFI / "module_cpu.cc").exists(),
                    reason="xla_ffi/module_cpu.cc not written yet")
def test_cpu_extension_is_the_module_its_file_names():
    # The file name must match NB_MODULE(_ffi, m) or the import fails.
    assert b"PyInit__ffi\0" in _extension("_ffi")


@pytest.mark.skipif(not (XLA_FFI / "cuda" / "module_cuda.cc").exists(),
                    reason="xla_ffi/cuda/module_cuda.cc not written yet")
@pytest.mark.skipif(NO_CUDA, reason="built without CUDA")
def test_cuda_extension_is_the_module_its_file_names():
    assert b"PyInit__ffi_cuda\0" in _extension("_ffi_cuda")


@pytest.mark.skipif(not _bazel_sources()["JAX_M2N_CUDA_SRCS"],
                    reason="no CUDA kernels (xla_ffi/cuda/*.cu.cc) yet")
@pytest.mark.skipif(NO_CUDA, reason="built without CUDA")
def test_cuda_kernels_are_compiled_for_every_arch():
    data = _extension("_ffi_cuda")
    # No cuobjdump in this toolkit; the embedded fatbin records ptxas options.
    assert b".nv_fatbin" in data
    for arch in CUDA_ARCHS:
        assert f"-arch sm_{arch} ".encode() in data, f"no sm_{arch} code in _ffi_cuda.so"


def _cmake_cuda_archs():
    text = re.sub(r"#[^\n]*", "", (ROOT / "CMakeLists.txt").read_text())
    m = re.search(r'set\(JAX_M2N_CUDA_ARCHITECTURES "([^"]*)"', text)
    assert m, "CMakeLists.txt: set(JAX_M2N_CUDA_ARCHITECTURES \"...\" CACHE ...) not found."
    return m.group(1).split(";")


def test_cmake_and_bazel_build_the_same_cuda_archs():
    build = (XLA_FFI / "BUILD").read_text()
    bazel = re.findall(r'"(\d+)"', re.search(r"archs = \[(.*?)\]", build).group(1))
    assert tuple(bazel) == CUDA_ARCHS, f"xla_ffi/BUILD: archs must be {CUDA_ARCHS}."
    cmake = [f"{a}-real" for a in CUDA_ARCHS[:-1]] + [CUDA_ARCHS[-1]]
    assert _cmake_cuda_archs() == cmake, (
        f"CMakeLists.txt: JAX_M2N_CUDA_ARCHITECTURES must be {';'.join(cmake)} "
        "(SASS for each, PTX for the newest, as xla_ffi/BUILD).")


def _requirements(path):
    """The requirement lines of a requirements file, `-r` includes followed."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out += _requirements(path.parent / line[3:].strip())
        elif line:
            out.append(line.replace(" ", ""))
    return out


@pytest.mark.parametrize("extra", ["cuda", "qwix", "tunix", "jobs", "metrics", "ray"])
def test_pip_extras_match_the_requirement_sets_the_scripts_install(extra):
    """`pip install jax_m2n[extra]` and the set scripts/setup.sh installs for it
    (requirements/<extra>.txt) name the same ranges."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [r.replace(" ", "") for r in project["optional-dependencies"][extra]]
    have = _requirements(ROOT / "requirements" / f"{extra}.txt")
    assert set(wanted) <= set(have), (extra, sorted(set(wanted) - set(have)))


def test_the_test_set_includes_the_main_jobs_and_every_extra():
    have = set(_requirements(ROOT / "requirements.txt"))
    for name in ("runtime", "cuda", "qwix", "tunix", "jobs", "metrics"):
        missing = set(_requirements(ROOT / "requirements" / f"{name}.txt")) - have
        assert not missing, (name, sorted(missing))
