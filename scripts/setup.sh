#!/usr/bin/env bash
# Installs what is missing and builds the extensions into jax_m2n/ (gitignored),
# so that `.venv/bin/python -c "import jax_m2n"` works from the repository root.
# Shared by scripts/test.sh and scripts/run_example.sh (they source it; it also
# runs alone). Idempotent: quiet, and a few seconds, when everything is there.
#
# Installs, only when missing: Bazel 4.2.3 (apt: bazel-bootstrap), python3-venv,
# .venv with requirements.txt. apt needs root or sudo.
#
# Environment:
#   JAX_M2N_PYTHON=/path/python  use this interpreter instead of .venv (nothing is
#                                pip-installed; it must already meet requirements.txt)
#   JAX_M2N_BUILDER=bazel|cmake  how to build (default: bazel; cmake where Bazel is
#                                absent but cmake, ninja and nanobind are there, as on
#                                the GPU machines)
#   JAX_M2N_NO_CUDA=1            build without the CUDA extension (no nvcc here)
#   CUDA_PATH                    CUDA toolkit (default /usr/local/cuda)
# After sourcing: ROOT, PY, and bazel_run <command> [args] (Bazel with this setup's flags).

_setup_main() {
  set -euo pipefail
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  _ensure_python
  _build_extensions
}

_log() { echo "setup: $*" >&2; }
_die() { echo "setup: error: $*" >&2; exit 1; }

_as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else _die "need root (or sudo) to run: $*"
  fi
}

_apt_install() {
  command -v apt-get >/dev/null 2>&1 || _die "apt-get not found; install by hand: $*"
  _log "apt-get install $*"
  if [ -z "${_APT_UPDATED:-}" ]; then
    _as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
      || _die "apt-get update failed"
    _APT_UPDATED=1
  fi
  _as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" \
    </dev/null >/dev/null || _die "apt-get install $* failed"
}

# Exit status 0 when the interpreter $1 has every requirements.txt range.
_requirements_met() {
  "$1" - "$ROOT/requirements.txt" 2>/dev/null <<'PY'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        req = Requirement(line)
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            sys.exit(1)
        if not req.specifier.contains(version, prereleases=True):
            sys.exit(1)
PY
}

_ensure_python() {
  if [ -n "${JAX_M2N_PYTHON:-}" ]; then
    PY=$JAX_M2N_PYTHON
    "$PY" -c "import jax, nanobind" 2>/dev/null \
      || _die "JAX_M2N_PYTHON=$PY lacks jax or nanobind"
    return
  fi
  PY=$ROOT/.venv/bin/python
  if [ ! -e "$PY" ]; then
    local base
    base=$(command -v python3 || true)
    if [ -z "$base" ] || ! "$base" -c "import venv, ensurepip" 2>/dev/null; then
      _apt_install python3 python3-venv
      base=/usr/bin/python3
    fi
    _log "creating .venv with $("$base" --version 2>&1)"
    "$base" -m venv "$ROOT/.venv"
  fi
  "$PY" -c "" 2>/dev/null || _die "$PY does not run; remove .venv and run again"
  if ! _requirements_met "$PY"; then
    _log "pip install -r requirements.txt into .venv"
    # Quiet, but pip's errors (and /etc/xdg/pip constraints, if any) still apply.
    "$PY" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements.txt" </dev/null
    _requirements_met "$PY" || _die "requirements.txt still not met after pip install"
  fi
}

_choose_builder() {
  if [ -n "${JAX_M2N_BUILDER:-}" ]; then
    BUILDER=$JAX_M2N_BUILDER
  elif command -v bazel >/dev/null 2>&1; then
    BUILDER=bazel
  elif command -v cmake >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 \
      && "$PY" -c "import nanobind" 2>/dev/null; then
    BUILDER=cmake
  else
    BUILDER=bazel
  fi
}

# Bazel with this set-up's flags, from the workspace root.
bazel_run() {
  local cmd=$1
  shift
  local site stamp
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # Changes whenever a package is added, removed or upgraded: re-probes @local_py.
  stamp=$(ls "$site" | cksum | cut -d" " -f1)
  # --nocache_test_results: the scripts always run tests afresh (the venv is outside
  # Bazel's view); given to every command so Bazel keeps its analysis cache.
  local flags=(--repo_env=JAX_M2N_VENV_STAMP="$stamp" --nocache_test_results)
  if [ -n "${JAX_M2N_PYTHON:-}" ]; then
    flags+=(--repo_env=JAXFFI_PYTHON="$JAX_M2N_PYTHON")
  fi
  if [ -n "${CI:-}" ]; then
    flags+=(--color=no --curses=no --show_progress_rate_limit=30)
  fi
  (cd "$ROOT" && bazel "$cmd" "${flags[@]}" "$@")
}

_build_extensions() {
  _choose_builder
  case "$BUILDER" in
    bazel)
      command -v bazel >/dev/null 2>&1 || _apt_install bazel-bootstrap
      bazel_run build --ui_event_filters=-info --noshow_progress \
        //jax_m2n:_ffi.so //jax_m2n:_ffi_cuda.so
      local so
      for so in _ffi.so _ffi_cuda.so; do
        if ! cmp -s "$ROOT/bazel-bin/jax_m2n/$so" "$ROOT/jax_m2n/$so"; then
          rm -f "$ROOT/jax_m2n/$so"
          cp "$ROOT/bazel-bin/jax_m2n/$so" "$ROOT/jax_m2n/$so"
          chmod u+w "$ROOT/jax_m2n/$so"
        fi
      done
      ;;
    cmake)
      local cuda=AUTO
      if [ "${JAX_M2N_NO_CUDA:-0}" != 0 ]; then cuda=OFF; fi
      cmake -S "$ROOT" -B "$ROOT/build/inplace" -G Ninja --log-level=WARNING \
        -DPython_EXECUTABLE="$PY" -DJAX_M2N_INPLACE=ON -DJAX_M2N_CUDA=$cuda >/dev/null
      cmake --build "$ROOT/build/inplace" | { grep -Ev '^\[[0-9]+/[0-9]+\] ' || true; }
      ;;
    *) _die "JAX_M2N_BUILDER must be bazel or cmake; got $BUILDER" ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _setup_main "$@"
else
  _setup_main
fi
