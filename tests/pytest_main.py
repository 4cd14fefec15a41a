"""Runs one test file under pytest for Bazel's py_test (see tests/BUILD).

Usage: pytest_main.py <test_file> [pytest args...]. pytest's exit code 5 (no
tests collected) is a failure here: a test file that collects nothing is a bug.
"""

import sys

import pytest

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: pytest_main.py <test_file> [pytest args...]")
    # Runfiles are read-only: no .pytest_cache.
    code = pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider"] + sys.argv[2:])
    sys.exit(1 if code == pytest.ExitCode.NO_TESTS_COLLECTED else int(code))
