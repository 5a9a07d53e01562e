#!/usr/bin/env bash
# signals_test.sh TIERZERO OUT_DIR [TRIALS]: Ctrl-C at random moments of training, evaluation
# and checkpointing (Note [Signals on one thread of ours], apps/tierzero/signals.h). Every trial
# sends one SIGINT or SIGTERM, or a burst of several 30 ms apart, to a run that saves a
# checkpoint every 3 steps, and requires: exit status 0, the message that it saved, and a
# checkpoint that loads (exported to safetensors, which verifies every shard's checksum) and
# resumes. A signal handler running on a oneDNN JIT thread used to corrupt the heap in 2-25% of
# such trials (SIGSEGV, SIGBUS, a bad free, a hang).
# The metrics file must hold every step up to the checkpoint's and none after it.
#
#   TZ_SIGNAL_TRIALS=N    trials (default 12)
#   TZ_SIGNAL_MODEL=default  the built-in default run (its model, data and budgets: device, host
#                            and NVMe) with a checkpoint every 3 steps, instead of a smaller model
set -euo pipefail
tz=$1 out=$2 trials=${3:-${TZ_SIGNAL_TRIALS:-12}}
rm -rf "$out" && mkdir -p "$out"
if [ "${TZ_SIGNAL_MODEL:-}" = default ]; then
  cat > "$out/run.json" <<JSON
{"train": {"steps": 100000, "checkpoint_every": 3}, "output": {"html": "none", "trace": "none"}}
JSON
else
  cat > "$out/run.json" <<JSON
{"model": {"n_layer": 3, "d_model": 96, "n_head": 4},
 "train": {"steps": 100000, "batch_size": 16, "eval_every": 7, "eval_batches": 2,
           "checkpoint_every": 3},
 "engine": {"device_budget": "4 MiB", "host_budget": "6 MiB", "nvme_budget": "64 MiB"},
 "output": {"html": "none", "trace": "none"}}
JSON
fi
signals=0
RANDOM=${TZ_SIGNAL_SEED:-19}
for t in $(seq "$trials"); do
  dir="$out/t$t"
  "$tz" train --config "$out/run.json" --quiet --run-dir "$dir" > "$dir.log" 2>&1 &
  pid=$!
  # From the run's first line on: a signal before main() has blocked it takes the default action
  # (docs/signals.md), and a sanitized build can take a second to get there.
  for _ in $(seq 1200); do
    grep -q "^tierzero train:" "$dir.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  sleep "$(printf '0.%03d' $((RANDOM % 1000)))"
  sleep $((RANDOM % 3))
  sig=INT
  ((RANDOM % 3 == 0)) && sig=TERM
  burst=$((RANDOM % 2 == 0 ? 1 : 1 + RANDOM % 6))
  for _ in $(seq "$burst"); do
    kill -s "$sig" "$pid" 2>/dev/null && signals=$((signals + 1))
    sleep 0.03
  done
  # A run that hangs fails the test: at most 120 s for the step and the save.
  for _ in $(seq 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"
    echo "trial $t: SIG$sig x$burst: still running 120 s later (hang)"; tail -5 "$dir.log"; exit 1
  fi
  rc=0
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "trial $t: SIG$sig x$burst: exit status $rc"; tail -20 "$dir.log"; exit 1
  fi
  # (Or, stopped in the step-0 evaluation, a checkpoint of step 0 recording it undone: Note [An
  # evaluation a signal cuts short].)
  grep -qE "interrupted(: | in the evaluation of step [0-9]+: )saving a checkpoint" "$dir.log" ||
    { echo "trial $t: no checkpoint message"; tail -20 "$dir.log"; exit 1; }
  "$tz" export "$dir/checkpoint" -o "$dir/model.safetensors" > "$dir.export.log" 2>&1 ||
    { echo "trial $t: the checkpoint does not export"; cat "$dir.export.log"; exit 1; }
  step=$(grep -o 'saving a checkpoint at step [0-9]*' "$dir.log" | grep -o '[0-9]*$')
  python3 - "$dir/metrics.jsonl" "$step" <<'PY' || { echo "trial $t: metrics do not end at the checkpoint's step"; exit 1; }
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1])]
train = sorted({s for s in steps})
want = int(sys.argv[2])
# Every step 1..want (evaluations may add step 0), nothing after the checkpoint's step.
assert max(steps, default=0) == want and set(range(1, want + 1)) <= set(steps), (train[-5:], want)
PY
  "$tz" train --config "$out/run.json" --quiet --run-dir "$dir" --resume "$dir/checkpoint" \
    --steps $((step + 1)) > "$dir.resume.log" 2>&1 ||
    { echo "trial $t: the checkpoint does not resume"; tail -20 "$dir.resume.log"; exit 1; }
  echo "trial $t: SIG$sig x$burst at step $step: exit 0, checkpoint exports and resumes"
  rm -rf "$dir"
done
echo "all $trials trials clean: $signals signals delivered"
