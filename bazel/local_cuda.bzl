"""Offline repository rule for the local CUDA toolkit: nvcc, headers, static
cudart. No GPU needed (compile and link only).

Toolkit: $CUDA_PATH, else /usr/local/cuda. Without nvcc the build fails,
naming the fix, unless JAX_M2N_NO_CUDA=1: then CUDA_ENABLED is False and the
CUDA targets build empty (for machines without a toolkit; CI never sets it).
"""

_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

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

exports_files(["defs.bzl"])

cc_library(name = "cuda_headers")

cc_library(name = "cudart_static")
"""

def _local_cuda_impl(rctx):
    cuda = rctx.os.environ.get("CUDA_PATH", rctx.attr.path)
    nvcc = cuda + "/bin/nvcc"
    if rctx.os.environ.get("JAX_M2N_NO_CUDA", "0") not in ("", "0"):
        rctx.file("BUILD.bazel", _NO_CUDA_BUILD)
        rctx.file("defs.bzl", "CUDA_ENABLED = False\nNVCC = None\n")
        return
    if not rctx.path(nvcc).exists:
        fail("local_cuda: nvcc not found at %s. Set CUDA_PATH to the toolkit, " % nvcc +
             "or JAX_M2N_NO_CUDA=1 to build without the CUDA extension.")
    rctx.symlink(cuda + "/include", "include")
    rctx.symlink(cuda + "/lib64", "lib64")
    rctx.file("BUILD.bazel", _CUDA_BUILD)
    rctx.file("defs.bzl", "CUDA_ENABLED = True\nNVCC = %r\n" % nvcc)

local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    attrs = {"path": attr.string(default = "/usr/local/cuda")},
    environ = ["CUDA_PATH", "JAX_M2N_NO_CUDA"],
    local = True,
)
