"""cuda_library(): compile CUDA sources with nvcc (one genrule per file) into
an alwayslink cc_library linked with the static CUDA runtime.

A `.cu.cc` file is compiled as CUDA (`-x cu`), exactly like a `.cu` file.
Zero sources gives an empty library; so does a build without CUDA (see
local_cuda.bzl: no toolkit, no NCCL headers, or JAX_M2N_NO_CUDA=1).
"""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")

def cuda_library(
        name,
        srcs,
        hdrs = [],
        isystem = [],
        archs = ["80", "90", "100"],
        copts = [],
        visibility = None):
    """Args:
      srcs: .cu / .cu.cc files, each compiled to its own object.
      hdrs: everything the sources may #include (inputs of every nvcc action).
      isystem: directories passed with -isystem (third-party headers).
      archs: SM versions, oldest first; each gets real code (sm_XX), and the
        last also PTX (compute_XX), which the driver compiles for newer GPUs.
      copts: extra nvcc flags.
    """
    if not CUDA_ENABLED:
        srcs = []
    gencode = " ".join([
        "-gencode arch=compute_%s,code=sm_%s" % (a, a)
        for a in archs
    ] + ["-gencode arch=compute_%s,code=compute_%s" % (archs[-1], archs[-1])] if archs else [])
    objs = []
    for src in srcs:
        stem = src[:-len(".cu.cc")] if src.endswith(".cu.cc") else src[:-len(".cu")]
        obj = "_nvcc/%s/%s.pic.o" % (name, stem)  # .pic.o: linked into shared objects
        native.genrule(
            name = "%s_nvcc_%s" % (name, stem.replace("/", "_")),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-x cu -c -std=c++17 -O2",
                "-Xcompiler -fPIC,-fvisibility=hidden,-fno-strict-aliasing",
                gencode,
                "-I.",  # project headers: #include "xla_ffi/..."
            ] + ["-isystem " + i for i in isystem] + copts + [
                "$(location %s) -o $@" % src,
            ]),
            message = "nvcc %s" % src,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        alwayslink = True,
        deps = ["@local_cuda//:cudart_static"],
        visibility = visibility,
    )
