#!/usr/bin/env bash
# Set-up for loramux on a fresh Debian/Ubuntu machine with Python 3.11 and apt.
#   ./bootstrap.sh serve [ARGS]   install what is needed, then run loramux on embedded defaults
#   ./bootstrap.sh test  [ARGS]   install what is needed, then lint, type-check and run every test
# Idempotent: a second run reinstalls nothing unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
STAMP="$VENV/.installed"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {  # apt_install PACKAGE...: install the Debian packages that are missing
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "bootstrap: apt-get install ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

python_venv() {
  local py
  py=$(command -v python3.11 || command -v python3)
  if ! "$py" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    echo "bootstrap: loramux needs Python 3.11 or newer" >&2; exit 1
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    "$py" -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; rm -rf "$VENV"; "$py" -m venv "$VENV"; }
  fi
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing Python packages into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # torch is pinned in the same command so that pip takes the 2.13.0 build (CPU wheel where one
    # is provided, the CUDA build from the registry on a GPU machine) and pulls no second torch.
    "$VENV/bin/pip" install -q "torch==2.13.0" -e ".[dev,ray]"
    echo "$want" > "$STAMP"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  serve)
    apt_install redis-server
    python_venv
    exec "$VENV/bin/loramux" serve "$@"
    ;;
  test)
    # tests start throwaway PostgreSQL and Redis servers from these binaries; Chromium for the dashboard
    apt_install postgresql redis-server chromium
    python_venv
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    "$VENV/bin/mypy"
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    ;;
  *)
    echo "usage: ./bootstrap.sh serve|test [ARGS]" >&2; exit 2
    ;;
esac
