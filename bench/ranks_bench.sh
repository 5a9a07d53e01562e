#!/usr/bin/env bash
# End-to-end step time of the default model (`tierzero train`, built-in config) on 1, 2 and 4
# ranks under mpirun (ZeRO-3 over MPI, data parallel: each rank takes its own micro-batch of
# batch_size rows, so the global batch grows with the ranks). Rounds interleave 1, 2, 4 ranks;
# the figures are medians over rounds of each run's median step time (steps after the plan).
# On a 2-core machine 4 ranks are oversubscribed: compare 1 and 2 ranks for scaling.
# Plain rows run the default collectives path, on the device (Note [Gathers on the device]: the
# local shard goes H2D, the all_gather and reduce-scatter run in place in device memory); rows
# marked "host" set ranks.collectives to "host" (all_gather into pinned host memory, the whole
# chunk H2D; the gradient chunk D2H, reduce-scatter on the host). "comm s/step" is the trainer
# thread's time in collectives; "H2D MiB/step" what crossed the (simulated) host link.
# Usage: bench/ranks_bench.sh [STEPS=60] [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}
rounds=${2:-2}
tz=build/bin/tierzero
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
work=$(mktemp -d /tmp/tz-ranks-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo '{"ranks": {"collectives": "device"}}' >"$work/device.json"
echo '{"ranks": {"collectives": "host"}}' >"$work/host.json"
for round in $(seq "$rounds"); do
  for cfg in 1 2 2h 4 4h; do
    np=${cfg%h}
    path=device
    [ "$cfg" != "$np" ] && path=host
    mpiexec -np "$np" "$tz" train --config "$work/$path.json" \
      --steps "$steps" --eval-every 0 --quiet --run-dir "$work/r$cfg.$round" \
      >"$work/r$cfg.$round.log" 2>&1 || { tail -20 "$work/r$cfg.$round.log"; exit 1; }
  done
done
python3 - "$work" "$rounds" <<'EOF'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'ranks':>12} {'step ms':>8} {'tok/s':>8} {'tok/s/rank':>10} {'state/rank MiB':>14} "
      f"{'comm s/step':>11} {'comm MiB/step':>13} {'H2D MiB/step':>12}")
base = None
for cfg in ("1", "2", "2h", "4", "4h"):
    np = int(cfg.rstrip("h"))
    label = f"{np} host" if cfg.endswith("h") else str(np)
    step_s, tok = [], []
    for r in range(1, rounds + 1):
        rows = [json.loads(l) for l in open(f"{work}/r{cfg}.{r}/metrics.jsonl") if '"loss"' in l]
        rows = rows[5:]  # warm-up and the first planned steps
        step_s.append(statistics.median(x["step_s"] for x in rows))
        tok.append(statistics.median(x["tokens_per_s"] for x in rows))
    rep = json.load(open(f"{work}/r{cfg}.{rounds}/report.json"))
    ranks = rep["ranks"]
    h2d = rep["counters"]["h2d_bytes"]
    nsteps = len(rows) + 5
    s, t = statistics.median(step_s), statistics.median(tok)
    base = base or t
    print(f"{label:>12} {s * 1e3:>8.1f} {t:>8.0f} {t / np:>10.0f} "
          f"{ranks['model_state_bytes'] / 2**20:>14.2f} "
          f"{ranks.get('comm_seconds', 0) / nsteps:>11.4f} "
          f"{ranks.get('comm_bytes', 0) / nsteps / 2**20:>13.2f} "
          f"{h2d / nsteps / 2**20:>12.2f}   ({t / base:.2f}x the 1-rank tokens/s)")
EOF
