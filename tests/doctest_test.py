"""Runs the examples in the public docstrings (help(jax_m2n.reshard) and friends) as
doctests on 8 CPU devices, so what the documentation shows is what the code does."""

import doctest
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_m2n  # noqa: E402
from jax_m2n._src import api, call_plan, local_copy, local_memory, request  # noqa: E402

PUBLIC = [jax_m2n.reshard, jax_m2n.plan, jax_m2n.check_errors]


def run_docstring_examples(fn):
  """Runs the examples of fn's own docstring (with `jax_m2n` in scope); fails unless
  there is one and all pass (jobs_protocol_test uses it for Publisher, Subscriber)."""
  assert ">>>" in fn.__doc__, f"{fn.__name__} has no example"
  finder = doctest.DocTestFinder(recurse=False)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  for test in finder.find(fn, fn.__name__, globs={"jax_m2n": jax_m2n}):
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("fn", PUBLIC, ids=[f.__name__ for f in PUBLIC])
def test_docstring_examples_run(fn):
  assert jax.device_count() == 8
  run_docstring_examples(fn)


def test_api_module_doctests():
  result = doctest.testmod(api, extraglobs={"jax_m2n": jax_m2n},
                           optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("module", [call_plan, request, local_copy, local_memory],
                         ids=["call_plan", "request", "local_copy", "local_memory"])
def test_internal_contract_doctests(module):
  """The examples of the internal contracts other rooms build on (docs/dev_contracts.md):
  the options value, the one function from a call to its plan, and the local data
  plane's copies and segments."""
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
