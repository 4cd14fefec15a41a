"""Offline repository rule for the local CUDA toolkit: nvcc, headers, static
cudart. No GPU needed (compile and link only).

Detects what the machine has and never fails for lack of CUDA: without nvcc,
the CUDA runtime headers/static library, or NCCL's headers (nccl.h from the
nvidia-nccl-cu13 wheel in the project's Python, found by @local_py), the rule
sets CUDA_ENABLED = False; the CUDA targets then build empty and the CPU
extension alone is built. status.txt (exported) says which and why, in one line;
scripts/setup.sh prints it.

Toolkit: $CUDA_PATH, else /usr/local/cuda, else the toolkit of the `nvcc` on
PATH (found with `nvcc --dryrun`, so wrapper scripts such as /usr/local/bin/nvcc
resolve to the real toolkit). JAX_M2N_NO_CUDA=1 turns CUDA off; JAX_M2N_CUDA=1
makes its absence an error instead of a skip (for machines that must build it).
"""

_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl", "status.txt"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_import(
    name = "cudart_static_lib",
    static_library = "lib64/libcudart_static.a",
)

cc_library(
    name = "cudart_static",
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers", ":cudart_static_lib"],
)
"""

_NO_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl", "status.txt"])

cc_library(name = "cuda_headers")

cc_library(name = "cudart_static")
"""

def _flag(rctx, name):
    return rctx.os.environ.get(name, "0") not in ("", "0")

def _find_toolkit(rctx):
    """The toolkit root (a string), or None."""
    if rctx.os.environ.get("CUDA_PATH"):
        return rctx.os.environ["CUDA_PATH"]
    if rctx.path(rctx.attr.path + "/bin/nvcc").exists:
        return rctx.attr.path
    nvcc = rctx.which("nvcc")
    if nvcc == None:
        return None

    # `nvcc --dryrun` prints "#$ _HERE_=<toolkit>/bin" (resolves wrapper scripts).
    res = rctx.execute(
        [nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
        quiet = True,
    )
    for line in (res.stdout + res.stderr).split("\n"):
        if line.startswith("#$ _HERE_="):
            return line[len("#$ _HERE_="):].strip()[:-len("/bin")]
    return str(nvcc.dirname.dirname)

def _local_cuda_impl(rctx):
    py_defs = rctx.read(rctx.path(Label("@local_py//:defs.bzl")))
    has_nccl = "HAS_NCCL = True" in py_defs
    reason = None
    cuda = None
    if _flag(rctx, "JAX_M2N_NO_CUDA"):
        reason = "JAX_M2N_NO_CUDA=1"
    else:
        cuda = _find_toolkit(rctx)
        if cuda == None:
            reason = "no nvcc (not at $CUDA_PATH, /usr/local/cuda or on PATH)"
        elif not rctx.path(cuda + "/bin/nvcc").exists:
            reason = "no nvcc at %s/bin/nvcc" % cuda
        elif not rctx.path(cuda + "/include/cuda_runtime_api.h").exists:
            reason = "no cuda_runtime_api.h in %s/include" % cuda
        elif not rctx.path(cuda + "/lib64/libcudart_static.a").exists:
            reason = "no libcudart_static.a in %s/lib64" % cuda
        elif not has_nccl:
            reason = ("no NCCL headers in the project's Python " +
                      "(pip install nvidia-nccl-cu13)")
    if reason != None:
        if _flag(rctx, "JAX_M2N_CUDA"):
            fail("local_cuda: JAX_M2N_CUDA=1 but the CUDA extension cannot be built: " +
                 reason)
        rctx.file("BUILD.bazel", _NO_CUDA_BUILD)
        rctx.file("defs.bzl", "CUDA_ENABLED = False\nNVCC = None\n")
        rctx.file("status.txt", "CPU extension only; CUDA extension skipped: %s\n" % reason)
        return
    nvcc = cuda + "/bin/nvcc"
    rctx.symlink(cuda + "/include", "include")
    rctx.symlink(cuda + "/lib64", "lib64")
    rctx.file("BUILD.bazel", _CUDA_BUILD)
    rctx.file("defs.bzl", "CUDA_ENABLED = True\nNVCC = %r\n" % nvcc)
    rctx.file("status.txt", "CPU and CUDA extensions (toolkit %s)\n" % cuda)

local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    attrs = {"path": attr.string(default = "/usr/local/cuda")},
    environ = ["CUDA_PATH", "JAX_M2N_NO_CUDA", "JAX_M2N_CUDA", "PATH"],
    local = True,
)
