#!/usr/bin/env bash
# Ctrl-C under mpirun (docs/signals.md): SIGINT to mpirun, which sends SIGTERM to every rank and,
# one second later (odls_base_sigkill_timeout), SIGKILL. Each trial requires every rank to have
# stopped after the same step and the run's checkpoint to be complete (the manifest and both
# ranks' states at one step) and to export; metrics end at that step.
# Usage: signals_ranks_test.sh TIERZERO MPIEXEC [TRIALS]
set -euo pipefail
tz=$1 mpiexec=$2 trials=${3:-3}
work=$(mktemp -d /tmp/tz-sigranks.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat > "$work/run.json" <<'JSON'
{"model": {"n_layer": 2, "d_model": 64, "n_head": 4},
 "train": {"steps": 100000, "eval_every": 5, "eval_batches": 1, "checkpoint_every": 7},
 "engine": {"device_budget": "4 MiB", "host_budget": "8 MiB", "nvme_budget": "32 MiB"},
 "output": {"html": "none", "trace": "none"}}
JSON
for t in $(seq "$trials"); do
  dir="$work/t$t"
  "$mpiexec" -np 2 "$tz" train --config "$work/run.json" --quiet --run-dir "$dir" \
    > "$dir.log" 2>&1 &
  pid=$!
  # From the run's first line on (rank 0 prints it once every rank is set up): a signal before
  # main() has blocked it takes the default action, and a loaded machine can take seconds.
  for _ in $(seq 1200); do
    grep -q "^tierzero train:" "$dir.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  sleep $((1 + t))
  kill -INT "$pid"
  for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"; echo "trial $t: mpirun still running 60 s after Ctrl-C"; exit 1
  fi
  wait "$pid" || true  # mpirun's own status reports the signal
  step=$(grep -o 'saving a checkpoint at step [0-9]*' "$dir.log" | grep -o '[0-9]*$' || true)
  [ -n "$step" ] || { echo "trial $t: no checkpoint message"; tail -20 "$dir.log"; exit 1; }
  ls "$dir/checkpoint/states-$step.w2.rank0.bin" "$dir/checkpoint/states-$step.w2.rank1.bin" \
    > /dev/null || { echo "trial $t: the ranks' states at step $step are missing"; exit 1; }
  "$tz" export "$dir/checkpoint" -o "$dir/m.safetensors" > "$dir.export.log" 2>&1 ||
    { echo "trial $t: the checkpoint does not export"; cat "$dir.export.log"; exit 1; }
  last=$(grep '"loss"' "$dir/metrics.jsonl" | tail -1 | grep -o '"step":[0-9]*' | cut -d: -f2)
  [ "$last" = "$step" ] || { echo "trial $t: metrics end at step $last, checkpoint at $step"; exit 1; }
  echo "trial $t: both ranks stopped after step $step; checkpoint complete, exports; metrics to it"
done
