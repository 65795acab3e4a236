# Sourced by every sweep in benchmarks/ (bash). It
#   - makes OUT (default: the directory the sweep was started from) absolute and changes to the
#     repository root, so the sweep runs from anywhere and its recipes/ and configs/ paths hold;
#   - keeps NVLink SHARP / multicast off, as in every measured run (the figures assume it);
#   - defines `step`, `last_json`, `summarize` and `refit_bench` below.
OUT=$(realpath -m "${OUT:-.}")
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# step NAME LIMIT COMMAND...: runs COMMAND under `timeout`, its limit cut to what is left of
# BUDGET_S (seconds since the sweep started), with stdout/stderr in /tmp/NAME.{out,err}; appends
# "rc=<code> NAME <seconds>" to $D/rc.txt and the error lines of its stderr to $D/errors.txt. A
# step with under 20 s of budget left is skipped (rc=skipped). With STACKS_AFTER=S and py-spy on
# PATH, a step still running after S seconds has the stacks of every Python process (threads
# included) written to $D/stacks_NAME.txt: where a hang sits. With KEEP_LOGS=1 the last 200 kB
# of its stderr are kept in $D/NAME.err.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS)) start=$SECONDS watcher=
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 20 ]; then echo "rc=skipped $name (budget spent)" >> "$D/rc.txt"; return; fi
  if [ -n "${STACKS_AFTER:-}" ] && command -v py-spy > /dev/null; then
    ( sleep "$STACKS_AFTER"
      for pid in $(pgrep python); do
        echo "== pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-160)"
        py-spy dump --pid "$pid"
      done > "$D/stacks_$name.txt" 2>&1 ) &
    watcher=$!
  fi
  # SIGINT first: a step that ran out of time prints where it was (Python's traceback).
  timeout -s INT -k 15 "$limit" "$@" > "/tmp/$name.out" 2> "/tmp/$name.err"
  local rc=$?
  [ -z "$watcher" ] || kill "$watcher" 2> /dev/null
  [ "${KEEP_LOGS:-0}" != 1 ] || tail -c 200000 "/tmp/$name.err" > "$D/$name.err"
  echo "rc=$rc $name $((SECONDS - start))s (limit ${limit}s)" >> "$D/rc.txt"
  { echo "== $name"; grep -E "Error|error:|Timeout" "/tmp/$name.err" \
      | grep -v "FP8GlobalStateManager\|import_utils" | tail -n 8
    [ "$rc" = 0 ] || { echo "-- last lines of stderr"; tail -n 25 "/tmp/$name.err"; }
  } >> "$D/errors.txt"
}

# last_json NAME: the step's last stdout line if it is a JSON object, else an error object.
last_json() {
  local line; line=$(tail -n 1 "/tmp/$1.out" 2> /dev/null)
  [ "${line:0:1}" = "{" ] || line='{"error": "no JSON line"}'
  echo "$line"
}

# summarize NAME: append {"run": NAME, "summary": <last_json NAME>} to $D/summaries.jsonl.
summarize() { echo "{\"run\": \"$1\", \"summary\": $(last_json "$1")}" >> "$D/summaries.jsonl"; }

# refit_bench NAME LIMIT NPROC [overrides...]: a step running recipes/refit_bench.py on NPROC
# ranks, on the port after $port, with --config $CONFIG (default configs/refit_bench.yaml), its
# JSON lines appended to $D/bench.jsonl and its summary to $D/summaries.jsonl. With RUNS set, only
# the names RUNS lists run; BENCH_OVERRIDES (space-separated, e.g. "bench.rounds=3") are added to
# every run's overrides.
refit_bench() {
  local name=$1 limit=$2 nproc=$3; shift 3
  [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $name "* ]] || return 0
  port=$((port + 1))
  step "$name" "$limit" python3 -m torch.distributed.run --nproc-per-node "$nproc" \
    --master-addr 127.0.0.1 --master-port "$port" recipes/refit_bench.py \
    --config "${CONFIG:-configs/refit_bench.yaml}" bench.output="$D/bench.jsonl" "$@" \
    ${BENCH_OVERRIDES:-}
  summarize "$name"
}
