#!/usr/bin/env bash
# Installs what is missing, builds the extensions into jax_m2n/ (gitignored) and
# installs the package editable into .venv, so that `.venv/bin/python -c "import
# jax_m2n"`, `python -m jax_m2n` and `python examples/rl_refit.py` work from any
# directory. Shared by scripts/test.sh and scripts/run_example.sh (they source it;
# it also runs alone). Idempotent: quiet, and a few seconds, when everything is there.
#
# Installs, only when missing: Bazel 4.2.3 (apt: bazel-bootstrap), python3-venv,
# .venv with the requirement sets its caller names in SETUP_REQUIREMENTS (files under
# the repository root; default requirements.txt, everything the tests need:
# scripts/test.sh; scripts/run_example.sh names the main job's set,
# requirements/runtime.txt, and the example's own), and as root iproute2 (the
# network tests' `ip`, `tc`). apt needs root or sudo.
# CUDA: the CUDA extension is built when the machine has a CUDA toolkit (nvcc) and
# the venv has NCCL's headers (bazel/local_cuda.bzl decides); otherwise the CPU
# extension alone, and one line says so. A missing toolkit is never an error.
#
# Environment:
#   JAX_M2N_PYTHON=/path/python  use this interpreter instead of .venv (nothing is
#                                pip-installed; it must already meet the requirements)
#   JAX_M2N_BUILDER=bazel|cmake  how to build (default: bazel; cmake where Bazel is
#                                absent but cmake, ninja and nanobind are there, as on
#                                the GPU machines)
#   JAX_M2N_NO_CUDA=1            build the CPU extension alone even where CUDA is there
#   JAX_M2N_CUDA=1               fail instead of skipping when CUDA cannot be built
#   CUDA_PATH                    CUDA toolkit (default /usr/local/cuda, else nvcc on PATH)
# After sourcing: ROOT, PY, and bazel_run <command> [args] (Bazel with this setup's flags).

_setup_main() {
  set -euo pipefail
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  _ensure_python
  _ensure_iproute2
  _build_extensions
  _install_editable
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

# Exit status 0 when the interpreter $1 has every range of the requirement files $2...
# (`-r` includes followed).
_requirements_met() {
  local py=$1
  shift
  "$py" - "$@" 2>/dev/null <<'PY'
import importlib.metadata as md, os, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

def met(path):
    for line in open(path):
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            if not met(os.path.join(os.path.dirname(path), line[3:].strip())):
                return False
        elif line:
            req = Requirement(line)
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                return False
            if not req.specifier.contains(version, prereleases=True):
                return False
    return True

sys.exit(0 if all(met(p) for p in sys.argv[1:]) else 1)
PY
}

_ensure_python() {
  if [ -n "${JAX_M2N_PYTHON:-}" ]; then
    PY=$JAX_M2N_PYTHON
    local missing managed
    missing=$("$PY" - <<'PY' 2>/dev/null
import importlib.util
print(" ".join(m for m in ("jax", "jaxlib", "nanobind") if importlib.util.find_spec(m) is None))
PY
) || _die "JAX_M2N_PYTHON=$PY does not run"
    if [ -n "$missing" ]; then
      # PEP 668: a distribution's Python (Debian's python3) refuses pip installs.
      managed=$("$PY" -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(
        sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED"))))' 2>/dev/null || echo 0)
      local pkgs="'jax>=0.10.2,<0.12' 'jaxlib>=0.10.2,<0.12' 'nanobind>=3.1,<4'"
      if [ "$managed" = 1 ]; then
        _die "JAX_M2N_PYTHON=$PY lacks $missing, and pip may not install into it (an
externally managed system Python). Use a venv with them:
  $PY -m venv ~/jax_m2n-venv && ~/jax_m2n-venv/bin/pip install $pkgs
  JAX_M2N_PYTHON=~/jax_m2n-venv/bin/python $0
or drop JAX_M2N_PYTHON: setup then creates .venv with requirements.txt."
      fi
      _die "JAX_M2N_PYTHON=$PY lacks $missing. Install them into it:
  $PY -m pip install $pkgs
(all of requirements.txt for the tests), or drop JAX_M2N_PYTHON: setup then creates
.venv with requirements.txt."
    fi
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
  local files=() args=() f
  for f in "${SETUP_REQUIREMENTS[@]:-requirements.txt}"; do
    files+=("$ROOT/$f")
    args+=(-r "$ROOT/$f")
  done
  if ! _requirements_met "$PY" "${files[@]}"; then
    _log "pip install ${args[*]#"$ROOT/"} into .venv"
    # Quiet, but pip's errors (and /etc/xdg/pip constraints, if any) still apply.
    "$PY" -m pip install -q --disable-pip-version-check "${args[@]}" </dev/null
    _requirements_met "$PY" "${files[@]}" \
      || _die "${SETUP_REQUIREMENTS[*]:-requirements.txt} still not met after pip install"
  fi
}

# The network tests' emulated hosts (jax_m2n/testing/hosts.py) need `ip` and `tc`.
# Only as root (they skip, saying why, without root or iproute2 anyway).
_ensure_iproute2() {
  if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v tc; } >/dev/null 2>&1; then
    _apt_install iproute2
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
        //jax_m2n:_ffi.so //jax_m2n:_ffi_cuda.so //jax_m2n:cuda_status
      local status
      status=$(cat "$ROOT/bazel-bin/jax_m2n/cuda_status.txt")
      _install_so _ffi.so
      case "$status" in
        "CPU and CUDA"*) _install_so _ffi_cuda.so ;;
        *) rm -f "$ROOT/jax_m2n/_ffi_cuda.so"; _log "$status" ;;
      esac
      ;;
    cmake)
      local cuda=AUTO
      if [ "${JAX_M2N_NO_CUDA:-0}" != 0 ]; then cuda=OFF; fi
      if [ "${JAX_M2N_CUDA:-0}" != 0 ]; then cuda=ON; fi
      cmake -S "$ROOT" -B "$ROOT/build/inplace" -G Ninja --log-level=WARNING \
        -DPython_EXECUTABLE="$PY" -DJAX_M2N_INPLACE=ON -DJAX_M2N_CUDA=$cuda >/dev/null
      cmake --build "$ROOT/build/inplace" | { grep -Ev '^\[[0-9]+/[0-9]+\] ' || true; }
      ;;
    *) _die "JAX_M2N_BUILDER must be bazel or cmake; got $BUILDER" ;;
  esac
}

# Copies bazel-bin/jax_m2n/$1 next to jax_m2n/__init__.py when it changed.
_install_so() {
  if ! cmp -s "$ROOT/bazel-bin/jax_m2n/$1" "$ROOT/jax_m2n/$1"; then
    rm -f "$ROOT/jax_m2n/$1"
    cp "$ROOT/bazel-bin/jax_m2n/$1" "$ROOT/jax_m2n/$1"
    chmod u+w "$ROOT/jax_m2n/$1"
  fi
}

# Installs this checkout into .venv as an editable (path-based, like `pip install
# -e` with setuptools' compat mode) distribution: a .pth naming build/editable/, which
# holds one link, jax_m2n -> ../../jax_m2n, plus jax_m2n-<version>.dist-info (so
# `pip list` shows it as editable and `pip uninstall jax_m2n` removes it). A path
# entry, not an import hook: the current directory, PYTHONPATH and Bazel's runfiles
# still come first. Skipped with JAX_M2N_PYTHON and where .venv is a symlink (a venv
# shared by several checkouts), and left alone when .venv already has a jax_m2n from
# elsewhere (one line says so).
_install_editable() {
  [ -z "${JAX_M2N_PYTHON:-}" ] && [ ! -L "$ROOT/.venv" ] || return 0
  mkdir -p "$ROOT/build/editable"
  ln -sfn ../../jax_m2n "$ROOT/build/editable/jax_m2n"
  "$PY" - "$ROOT" <<'PY'
import importlib.metadata as md, json, os, re, sys, sysconfig
root = sys.argv[1]
init = os.path.join(root, "jax_m2n", "__init__.py")
version = re.search(r'^__version__ = "([^"]+)"', open(init).read(), re.M).group(1)
site = sysconfig.get_paths()["purelib"]
url = "file://" + root
try:
    dist = md.distribution("jax_m2n")
except md.PackageNotFoundError:
    dist = None
if dist is not None:
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    ours = (dist.read_text("INSTALLER") or "").strip() == "jax_m2n-setup"
    if not ours or direct.get("url") != url:
        where = direct.get("url", "") or str(dist.locate_file(""))
        print(f"setup: .venv already has jax_m2n {dist.version} ({where}); left as is",
              file=sys.stderr)
        sys.exit(0)
    if dist.version == version:
        sys.exit(0)
    for f in dist.files or []:
        path = dist.locate_file(f)
        if os.path.isfile(path):
            os.remove(path)
    os.rmdir(str(dist._path))  # pylint: disable=protected-access
info = f"jax_m2n-{version}.dist-info"
files = {
    "jax_m2n_editable.pth": os.path.join(root, "build", "editable") + "\n",
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: jax_m2n\nVersion: {version}\n",
    f"{info}/INSTALLER": "jax_m2n-setup\n",
    f"{info}/direct_url.json": json.dumps({"url": url, "dir_info": {"editable": True}}),
}
os.makedirs(os.path.join(site, info), exist_ok=True)
for name, text in files.items():
    with open(os.path.join(site, name), "w") as f:
        f.write(text)
with open(os.path.join(site, info, "RECORD"), "w") as f:
    f.writelines(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
PY
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _setup_main "$@"
else
  _setup_main
fi
