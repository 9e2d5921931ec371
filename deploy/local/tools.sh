#!/usr/bin/env bash
# Makes sure the command-line tools the tests run are installed: promtool (Debian's prometheus
# package), which checks and unit-tests deploy/prometheus/alerts.yml, Debian's chromium, which
# the console's browser tests drive headless (tests/it/console.rs), and Python's and Node.js's
# packages for the producer examples. Installs what is missing when apt-get (pip, npm) is
# available; exits non-zero, naming the tool, when one cannot be had.
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
install_tool chromium chromium

# The producer examples of docs/producers.md, which tests/it/producers.rs runs as a producer
# would: their Python packages (docs/examples/requirements.txt) and Node.js packages
# (docs/examples/package-lock.json).
install_tool python3 python3
install_tool node nodejs
install_tool npm npm
examples=docs/examples
if ! python3 -c 'import pika, jsonschema' 2>/dev/null; then
  echo "tools.sh: installing the Python producer example's packages" >&2
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    -r "$examples/requirements.txt" ||
    { echo "tools.sh: pip could not install $examples/requirements.txt" >&2; exit 1; }
fi
if [ ! -d "$examples/node_modules/amqplib" ] || [ ! -d "$examples/node_modules/ajv" ]; then
  echo "tools.sh: installing the Node.js producer example's packages" >&2
  npm ci --prefix "$examples" --no-audit --no-fund --silent ||
    { echo "tools.sh: npm could not install $examples/package.json" >&2; exit 1; }
fi
