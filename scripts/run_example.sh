#!/usr/bin/env bash
# The main job (README): installs what it runs and builds the extensions
# (scripts/setup.sh), then runs examples/rl_refit.py from the repository root:
# on the GPUs when there are GPUs and a CUDA-enabled jax, else on 8 CPU devices.
#   ./scripts/run_example.sh [rl_refit.py arguments...]
#   JAX_M2N_EXAMPLE=tunix_grpo ./scripts/run_example.sh [arguments...]  # another example
# Installs only the main job's set (requirements/runtime.txt), the CUDA build's
# (requirements/cuda.txt) where GPUs and a CUDA toolkit are there, and the sets the
# example names in a `# requirements: NAME ...` line (requirements/NAME.txt; e.g.
# tunix_grpo.py: `# requirements: tunix`; examples/ray_refit.py:
# `# requirements: ray`). Without GPUs only the CPU extension is built (unless
# JAX_M2N_CUDA=1): the example runs on CPU devices. ./scripts/test.sh installs
# everything (requirements.txt).
# Environment: JAX_M2N_CPU_DEVICES=8 (CPU device count), JAX_M2N_EXAMPLE=rl_refit
# (examples/<name>.py to run), plus setup.sh's.
# Leaves no Bazel server behind that it started (bazel shutdown after the build).
set -euo pipefail

# Bazel's default output base for this workspace; its server.pid.txt exists while a
# server runs (one the user started stays running).
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_pidfile=${XDG_CACHE_HOME:-$HOME/.cache}/bazel/_bazel_$(id -un)/$(printf %s "$_root" | md5sum | cut -c1-32)/server/server.pid.txt
_had_server=0
if [ -f "$_pidfile" ] && kill -0 "$(cat "$_pidfile" 2>/dev/null)" 2>/dev/null; then _had_server=1; fi

example=$_root/examples/${JAX_M2N_EXAMPLE:-rl_refit}.py
[ -f "$example" ] || { echo "run_example: $example not found" >&2; exit 1; }

# What to install: the main job's set, the example's own, CUDA's where it will be built.
SETUP_REQUIREMENTS=(requirements/runtime.txt)
for name in $(sed -n 's/^# requirements: *//p' "$example" | head -n 1); do
  [ -f "$_root/requirements/$name.txt" ] \
    || { echo "run_example: $example names requirements/$name.txt, which is missing" >&2; exit 1; }
  SETUP_REQUIREMENTS+=("requirements/$name.txt")
done
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  gpus=1
fi
if [ "$gpus" = 1 ] || [ "${JAX_M2N_CUDA:-0}" != 0 ]; then
  SETUP_REQUIREMENTS+=(requirements/cuda.txt)
elif [ "${JAX_M2N_NO_CUDA:-0}" = 0 ]; then
  export JAX_M2N_NO_CUDA=1  # no GPU here: the example runs on CPU devices
fi

source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "$BUILDER" = bazel ] && [ "$_had_server" = 0 ]; then
  (cd "$ROOT" && bazel shutdown 2>/dev/null) || true
fi

has_gpu=0
if [ "$gpus" = 1 ]; then
  if "$PY" -c "import importlib.metadata as m, sys; sys.exit(not any(
      (d.metadata['Name'] or '').lower().startswith('jax-cuda') for d in m.distributions()))"; then
    has_gpu=1
  else
    echo "run_example: GPUs found but $PY has no jax CUDA plugin (jax[cuda13]); using CPU devices" >&2
  fi
fi
if [ "$has_gpu" = 0 ]; then
  export JAX_PLATFORMS=cpu  # the example sets 8 CPU devices (jax_num_cpu_devices) itself
fi

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$example" "$@"
