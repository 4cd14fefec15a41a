"""Offline repository rules: the project's Python venv, the CUDA toolkit, and
shims for what Bazel 4's WORKSPACE suffix would otherwise download.

Nothing here downloads anything and no absolute path is checked in: the venv
interpreter is <workspace root>/.venv/bin/python unless JAXFFI_PYTHON names
another one (`--repo_env=JAXFFI_PYTHON=/path/to/python`).
"""

# Run with the venv interpreter; prints key=value lines.
_PROBE = """
import importlib.metadata, importlib.util, os, sys, sysconfig
import jax, jax.ffi, nanobind
try:  # namespace package: no __init__.py; no "nvidia" at all raises
    nccl = importlib.util.find_spec("nvidia.nccl")
except ImportError:
    nccl = None
nccl_include = os.path.join(nccl.submodule_search_locations[0], "include") if nccl else ""
dists = sorted(set("%s==%s" % (d.metadata["Name"], d.version)
                   for d in importlib.metadata.distributions()))
for k, v in [
    ("py_include", sysconfig.get_paths()["include"]),
    ("ext_suffix", sysconfig.get_config_var("EXT_SUFFIX")),
    ("ffi_include", jax.ffi.include_dir()),
    ("nb_root", os.path.dirname(nanobind.source_dir())),
    ("nccl_include", nccl_include),
    ("versions", ";".join(["python==" + sys.version.split()[0]] + dists)),
]:
    print("%s=%s" % (k, v))
"""

_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl", "versions.txt"])

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

# XLA FFI headers shipped in jaxlib (xla/ffi/api/{c_api,api,ffi}.h).
filegroup(
    name = "xla_ffi_hdrs",  # for nvcc genrules: -isystem external/local_py/ffi_include
    srcs = glob(["ffi_include/xla/ffi/api/*.h"]),
)

cc_library(
    name = "xla_ffi",
    hdrs = [":xla_ffi_hdrs"],
    includes = ["ffi_include"],
)

# NCCL headers from the nvidia-nccl-cu13 wheel. Compile only: nothing links
# NCCL, it is dlopen'ed at run time (libnccl.so.2 from the same wheel).
filegroup(
    name = "nccl_hdrs",  # for nvcc genrules: -isystem external/local_py/nccl_include
    srcs = glob(["nccl_include/**/*.h"]),
)

cc_library(
    name = "nccl_headers",
    hdrs = [":nccl_hdrs"],
    includes = ["nccl_include"],
)

# nanobind's "linked static" mode (what nanobind_add_module does by default).
cc_library(
    name = "nanobind",
    srcs = glob(
        ["nanobind/src/*.cpp", "nanobind/src/*.h"],
        exclude = [
            "nanobind/src/nb_combined.cpp",  # unity build of the others
            "nanobind/src/nb_backend.cpp",   # split-mode backend module only
            "nanobind/src/nb_ft.cpp",        # free-threaded Python only
        ],
    ) + glob(["nanobind/ext/robin_map/include/**/*.h"]),
    hdrs = glob(["nanobind/include/**/*.h"]),
    includes = ["nanobind/include", "nanobind/ext/robin_map/include"],
    copts = ["-fno-strict-aliasing", "-fvisibility=hidden", "-Os", "-w"],
    local_defines = ["NB_BUILD", "NB_COMPACT_ASSERTIONS"],
    deps = [":python_headers"],
)

# Depend on this from py_test / py_binary: versions.txt lists every package in
# the venv, so the test cache key changes when the venv changes (the venv
# itself is invisible to Bazel).
py_library(
    name = "jax",
    data = ["versions.txt"],
)

py_runtime(
    name = "py3_runtime",
    interpreter_path = "%{python}",
    python_version = "PY3",
    # Bazel 4's default stub shebang is "#!/usr/bin/env python", which fails
    # under --incompatible_strict_action_env (no `python` in /bin:/usr/bin).
    stub_shebang = "#!%{python}",
)

py_runtime_pair(
    name = "py_runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":py_runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _local_python_env_impl(rctx):
    python = rctx.os.environ.get("JAXFFI_PYTHON", "")
    if not python:
        root = rctx.path(Label("//:WORKSPACE")).dirname
        python = str(root) + "/.venv/bin/python"
    if not rctx.path(python).exists:
        fail("local_python_env: no interpreter at %s; run ./scripts/setup.sh " % python +
             "(creates .venv) or pass --repo_env=JAXFFI_PYTHON=/path/to/python.")
    res = rctx.execute([python, "-c", _PROBE], quiet = True)
    if res.return_code != 0:
        fail("local_python_env: probing %s failed (needs jax, jaxlib, nanobind; " % python +
             "run ./scripts/setup.sh):\n%s%s" % (res.stdout, res.stderr))
    info = {}
    for line in res.stdout.strip().split("\n"):
        k, _, v = line.partition("=")
        info[k] = v
    rctx.symlink(info["py_include"], "python_include")
    rctx.symlink(info["ffi_include"], "ffi_include")
    rctx.symlink(info["nb_root"], "nanobind")
    if info["nccl_include"]:
        rctx.symlink(info["nccl_include"], "nccl_include")
    else:
        # Without the wheel, CUDA sources that include nccl.h fail to compile
        # with "nccl.h: No such file", which names the problem well enough.
        rctx.file("nccl_include/.missing_nvidia_nccl_cu13_wheel", "")
    rctx.file("BUILD.bazel", _BUILD.replace("%{python}", python))
    rctx.file("versions.txt", "\n".join(info["versions"].split(";")) + "\n")
    rctx.file("defs.bzl", "PYTHON = %r\nEXT_SUFFIX = %r\nHAS_NCCL = %r\n" % (
        python,
        info["ext_suffix"],
        bool(info["nccl_include"]) and rctx.path(info["nccl_include"] + "/nccl.h").exists,
    ))

local_python_env = repository_rule(
    implementation = _local_python_env_impl,
    # JAX_M2N_VENV_STAMP: scripts/setup.sh passes a digest of the venv's
    # site-packages listing so that a changed venv re-runs this rule.
    environ = ["JAXFFI_PYTHON", "JAX_M2N_VENV_STAMP"],
    local = True,
)

# ---------------------------------------------------------------------------
# Bazel 4's @bazel_tools loads @rules_cc//cc:defs.bzl (C++ toolchain, via the
# auto-configured @local_config_cc) and @rules_java//java:defs.bzl (the
# registered @bazel_tools//tools/jdk:all toolchains), which its built-in
# WORKSPACE suffix would http_archive(). In Bazel 4 both are thin forwarders
# to the native rules, so generate them locally. (Debian's bazel-rules-cc
# 0.0.4 is too new for Bazel 4.2.3: it needs `use_cpp_toolchain`.)
# ---------------------------------------------------------------------------

_NATIVE_RULES = {
    "cc": [
        "cc_binary", "cc_library", "cc_test", "cc_import", "cc_proto_library",
        "cc_toolchain", "cc_toolchain_suite", "fdo_profile",
        "fdo_prefetch_hints", "objc_library", "objc_import",
    ],
    "java": [
        "java_binary", "java_import", "java_library", "java_lite_proto_library",
        "java_proto_library", "java_test", "java_package_configuration",
        "java_plugin", "java_runtime", "java_toolchain",
    ],
}

_TOOLCHAIN_TYPE = {
    "cc": "@bazel_tools//tools/cpp:toolchain_type",
    "java": "@bazel_tools//tools/jdk:toolchain_type",
}

def _native_rules_shim_impl(rctx):
    lang = rctx.attr.lang
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD.bazel", "")
    rctx.file("%s/BUILD.bazel" % lang, "\n".join([
        'package(default_visibility = ["//visibility:public"])',
        'exports_files(["defs.bzl"])',
        'alias(name = "toolchain_type", actual = "%s")' % _TOOLCHAIN_TYPE[lang],
        "",
    ]))

    # Starlark in Bazel 4 has no lambda: one forwarding def per native rule.
    rctx.file("%s/defs.bzl" % lang, "".join([
        "def %s(**attrs):\n    native.%s(**attrs)\n\n" % (r, r)
        for r in _NATIVE_RULES[lang]
    ]))

native_rules_shim = repository_rule(
    implementation = _native_rules_shim_impl,
    attrs = {"lang": attr.string(mandatory = True, values = ["cc", "java"])},
)

# ---------------------------------------------------------------------------
# Every test action in Bazel 4 depends on @remote_coverage_tools (the LCOV
# merger, downloaded by the WORKSPACE suffix). Stub it out with no-op tools;
# `bazel coverage` will not work, `bazel test` does.
# ---------------------------------------------------------------------------

def _coverage_tools_stub_impl(rctx):
    rctx.file("WORKSPACE", 'workspace(name = "remote_coverage_tools")\n')
    rctx.file("noop.sh", "#!/bin/sh\nexit 0\n", executable = True)
    rctx.file("BUILD.bazel", "\n".join([
        'package(default_visibility = ["//visibility:public"])',
        'sh_binary(name = "coverage_report_generator", srcs = ["noop.sh"])',
        'sh_binary(name = "lcov_merger", srcs = ["noop.sh"])',
        "",
    ]))

coverage_tools_stub = repository_rule(implementation = _coverage_tools_stub_impl)
