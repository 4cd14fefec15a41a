"""Shared compiler options and the per-file pytest macro.

COPTS is mirrored by JAX_M2N_COPTS in CMakeLists.txt (tests/build_test.py
checks that the two agree).
"""

COPTS = [
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-Wall",
]

def py_pytest_tests(srcs, runner, helpers = [], overrides = {}, **kwargs):
    """One py_test per file in `srcs`, named after it without `.py`.

    Each runs `runner` (a pytest entry point) with the file as its argument;
    `helpers` (conftest.py, shared case tables) are sources of every test.
    `kwargs` are py_test attributes shared by all; `overrides` maps a test
    name to attributes (timeout, tags, data, ...) that replace those for it.
    """
    names = [src[:-len(".py")] for src in srcs]
    for name in overrides:
        if name not in names:
            fail("py_pytest_tests: overrides names %r, which is not a test here" % name)
    for src in srcs:
        name = src[:-len(".py")]
        attrs = dict(kwargs)
        attrs.update(overrides.get(name, {}))
        native.py_test(
            name = name,
            main = runner,
            srcs = [runner, src] + [h for h in helpers if h != runner],
            args = ["$(location %s)" % src],
            python_version = "PY3",
            srcs_version = "PY3",
            **attrs
        )
