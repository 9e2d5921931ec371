#!/usr/bin/env bash
# Counts the instructions a worker binary spends on N requests (two per recipient: half
# dispatched, half denied with a row), after start-up, under callgrind: an A/B figure of CPU
# work that repeats under any load, where seconds do not (docs/performance.md).
#
#   benches/callgrind/worker.sh BIN OUT [N]     e.g. target/release/sendquota /tmp/cg.out 6000
#
# Prints the program total; `callgrind_annotate --inclusive=yes OUT` shows where it went.
# profile.sh beside it does the work (and profiles with the kernel in view too).
set -euo pipefail
exec "$(dirname "$0")/profile.sh" callgrind "$1" "$2" "${3:-6000}"
