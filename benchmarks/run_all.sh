#!/usr/bin/env bash
# Run every benchmark at its default size, one after another (they must not overlap: 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
mkdir -p bench-results
for name in machine allreduce dataparallel kvstore pipeline pipesgd spatial; do
    echo "== mpitrain bench $name -n ${NP:-2}"
    $BIN/mpitrain bench "$name" -n "${NP:-2}" 2>&1 | tee "bench-results/$name.txt"
done
