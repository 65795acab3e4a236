#!/usr/bin/env bash
# Needs 2 GPUs, nothing else running on them: the fault table (tests/dist/test_faults.py) on
# CUDA — an engine killed before, during and after a refit (colocated, one trainer rank per GPU,
# CUDA IPC); a trainer rank killed mid-export and an inference rank killed mid-broadcast
# (non-colocated: 2 trainer ranks and an inference rank sharing GPU 1, so trainer rank 0
# broadcasts over NCCL). Each row prints
# "<fault>: seconds from the kill of ...: {rank r: ..., all exited: ...}".
# Results under $OUT/faults: rc.txt, errors.txt, timings.txt (the rows' lines + pytest's tally).
set -u
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/faults; mkdir -p "$D"

step fault_table 540 python3 -m pytest tests/dist/test_faults.py -q -s -p no:cacheprovider
grep -E "seconds from the kill|passed|failed|Error" /tmp/fault_table.out | tail -n 40 \
  > "$D/timings.txt"
cat "$D/rc.txt" "$D/timings.txt"; echo "total ${SECONDS}s"
