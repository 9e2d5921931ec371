#!/usr/bin/env bash
# Makes sure the command-line tools the tests run are installed: promtool (Debian's prometheus
# package), which checks and unit-tests deploy/prometheus/alerts.yml. Installs what is missing
# when apt-get is available; exits non-zero, naming the tool, when one cannot be had.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

updated=0
install_tool() { # command package
  command -v "$1" >/dev/null && return 0
  if command -v apt-get >/dev/null; then
    echo "tools.sh: installing $2 (for $1)" >&2
    # One package list update per run, before the first install.
    if [ "$updated" = 0 ]; then as_root apt-get update -qq; updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
  fi
  command -v "$1" >/dev/null || { echo "tools.sh: $1 is not installed (Debian package $2)" >&2; return 1; }
}

install_tool promtool prometheus
