"""Runs one test file under pytest for Bazel's py_test (see tests/BUILD).

Usage: pytest_main.py <test_file> [pytest args...]. pytest's exit code 5 (no
tests collected) is a failure here: a test file that collects nothing is a bug.
Tier 0 runs on 8 host devices: `jax_num_cpu_devices` is set here, before any test
starts JAX's backend (an explicit XLA_FLAGS device count wins).
"""

import os
import sys

import jax
import pytest

CPU_DEVICES = 8

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: pytest_main.py <test_file> [pytest args...]")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    # Runfiles are read-only: no .pytest_cache.
    code = pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider"] + sys.argv[2:])
    sys.exit(1 if code == pytest.ExitCode.NO_TESTS_COLLECTED else int(code))
