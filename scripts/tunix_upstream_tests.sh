#!/usr/bin/env bash
# Runs tunix's own cross-mesh tests with jax_m2n installed as tunix's reshard backend
# (jax_m2n.integrations.tunix.install()), each file in its own process (they set
# different device counts at import), from a checkout of google/tunix at the release
# jax_m2n[tunix] pins. The tests are read from that checkout; none is copied here.
#
#   scripts/tunix_upstream_tests.sh /path/to/tunix [python]
#     /path/to/tunix: git clone --branch v0.1.7 https://github.com/google/tunix
#     python: an interpreter with jax_m2n, google-tunix, pytest and chex
#             (default: .venv/bin/python of this checkout)
# Prints each test's pytest summary and how many reshards went through jax_m2n;
# exits non-zero if a test fails or a cross-mesh test made no reshard through it.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TUNIX=${1:?usage: $0 /path/to/tunix-checkout [python]}
PY=${2:-$ROOT/.venv/bin/python}
TUNIX=$(cd "$TUNIX" && pwd)
[ -f "$TUNIX/tests/rl/rl_cluster_test.py" ] || {
  echo "tunix_upstream_tests: $TUNIX must be a google/tunix checkout (tests/rl/...)" >&2
  exit 2
}

# file::test (empty test: the whole file)
TESTS=(
  "tests/rl/grpo/grpo_learner_test.py::test_grpo_with_lora_model"
  "tests/rl/agentic/agentic_grpo_learner_test.py::test_grpo_with_lora_model"
  "tests/rl/rl_cluster_test.py::test_model_loading_with_resharding"
)

status=0
for spec in "${TESTS[@]}"; do
  file=${spec%%::*}
  test=${spec#*::}
  echo "== $file ${test:+-k $test}"
  (cd "$TUNIX" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu \
    timeout 1800 "$PY" - "$file" "$test" <<'PY'
import sys

import pytest

from jax_m2n.integrations import tunix as m2n_tunix

m2n_tunix.install()
path, test = sys.argv[1], sys.argv[2]
args = [path, "-q", "-p", "no:cacheprovider"] + (["-k", test] if test else [])
code = pytest.main(args)
count = m2n_tunix.reshard_count()
print(f"tunix_upstream_tests: {path}: pytest exit {int(code)}, "
      f"{count} reshard calls through jax_m2n")
sys.exit(int(code) if int(code) else (0 if count else 3))
PY
  ) || status=1
done
exit $status
