#!/usr/bin/env bash
# The test command (README, .ci/run): installs what is missing (scripts/setup.sh),
# builds the extensions with Bazel, runs every test with Bazel, prints each test's
# pytest summary line, and exits non-zero if anything failed.
#   ./scripts/test.sh                      # everything
#   ./scripts/test.sh //tests:planner_test # extra arguments go to `bazel test`
set -euo pipefail
export JAX_M2N_BUILDER=bazel  # tests run under Bazel
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(//...)

marker=$(mktemp)
trap 'rm -f "$marker"' EXIT
rc=0
bazel_run test "${targets[@]}" || rc=$?  # --nocache_test_results: see bazel_run
# vLLM's tests, where an interpreter with vLLM is named (requirements/vllm.txt: a venv
# of its own, vLLM pins its torch); under Bazel they skip saying so.
if [ -n "${JAX_M2N_VLLM_PYTHON:-}" ] && [ ${#@} -eq 0 ]; then
  (cd "$ROOT" && PYTHONPATH=$ROOT "$JAX_M2N_VLLM_PYTHON" -m pytest -q -p no:cacheprovider \
      tests/vllm_engines_test.py) > "$marker.vllm" 2>&1 || rc=1
fi

# pytest's closing line ("12 passed, 1 skipped in 3.40s") from every log of this run.
echo "pytest summaries:"
find -L "$ROOT/bazel-testlogs" -name test.log -newer "$marker" 2>/dev/null | sort |
  while read -r log; do
    rel=${log#"$ROOT/bazel-testlogs/"}
    line=$(grep -E "(passed|failed|error|errors|skipped|no tests ran|deselected).* in [0-9.]+s" "$log" |
      tail -n 1 | sed -E 's/^=+ //; s/ =+$//') || true
    printf '  //%s:%s  %s\n' "$(dirname "$(dirname "$rel")")" "$(basename "$(dirname "$rel")")" \
      "${line:-(no pytest summary: see $log)}"
  done > "$marker.summary"
if [ -f "$marker.vllm" ]; then
  printf '  tests/vllm_engines_test.py (%s)  %s\n' "$JAX_M2N_VLLM_PYTHON" \
    "$(grep -E " in [0-9.]+s" "$marker.vllm" | tail -n 1)" >> "$marker.summary"
  rm -f "$marker.vllm"
fi
cat "$marker.summary"
# One closing line over every test target: "total: N passed, N failed, N skipped".
count() { { grep -oE "[0-9]+ $1" "$marker.summary" || true; } | awk '{s += $1} END {print s + 0}'; }
failed=$(( $(count failed) + $(count error) ))
[ "$rc" -eq 0 ] || [ "$failed" -gt 0 ] || failed=1  # a failure without a pytest line
echo "total: $(count passed) passed, $failed failed, $(count skipped) skipped"
rm -f "$marker.summary"
exit "$rc"
