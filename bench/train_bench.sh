#!/usr/bin/env bash
# Training benchmark (issue 6): the default run's tokens/s, achieved FLOP/s and peak RSS, and the
# step times of runs offloaded to host memory and to NVMe against the all-resident run, on the
# unthrottled simulated device.
#   bench/train_bench.sh [repetitions, default 3]
#   bench/train_bench.sh overlap [repetitions, default 6]: what the optimizer's I/O overlap buys
#     on the default run (docs/optimizer.md): prefetch and write-behind each off and on
#     (TZ_OPTIMIZER_PREFETCH, TZ_OPTIMIZER_WRITE_BEHIND), interleaved, the medians of the
#     per-repetition ratios of the update phase and the step against neither.
#   bench/train_bench.sh speculative [repetitions, default 5]: the speculative start off and on
#     (engine.speculative_step), interleaved, on the default model with its states in host
#     memory and clipping off (so every step can use it); the step's and the phase's medians.
#   bench/train_bench.sh behind [repetitions, default 5]: the update phase's CPU groups inside
#     Step and behind the next forward (TZ_UPDATE_BEHIND_FORWARD off/auto, interleaved) for the
#     default run (states on NVMe) and with its states in host memory; the step's medians and
#     the median of the per-repetition ratios.
# Runs are interleaved (resident, host, nvme, resident, ...) and the medians of the per-step times
# (steps 20.. of each run, past warm-up and planning) compared, because this machine's speed
# drifts between minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin/tierzero
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ "${1:-}" = overlap ]; then
  reps=${2:-6}
  for r in $(seq "$reps"); do
    for v in 00 10 01 11; do
      TZ_OPTIMIZER_PREFETCH=${v:0:1} TZ_OPTIMIZER_WRITE_BEHIND=${v:1:1} $bin train --steps 80 \
        --eval-every 0 --quiet --run-dir "$out/$v-$r" > /dev/null
    done
  done
  python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def run(v, r):
    d = f"{out}/{v}-{r}"
    m = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l][20:]
    u = json.load(open(f"{d}/report.json"))["optimizer"]["update_phase"]
    return statistics.median(x["step_s"] for x in m), u["measured_median_seconds"], u["predicted_seconds"]
runs = {v: [run(v, r) for r in range(1, reps + 1)] for v in ("00", "10", "01", "11")}
names = {"00": "neither", "10": "prefetch", "01": "write-behind", "11": "both"}
for v, rs in runs.items():
    step, phase, pred = (statistics.median(x[i] for x in rs) * 1e3 for i in range(3))
    line = f"{names[v]:13s} step {step:6.2f} ms  update phase {phase:6.2f} ms (predicted {pred:6.2f})"
    if v != "00":
        pr = statistics.median(b[1] / a[1] for a, b in zip(runs["00"], rs))
        sr = statistics.median(b[0] / a[0] for a, b in zip(runs["00"], rs))
        line += f"  phase {pr:.3f}, step {sr:.3f} of neither's"
    print(line)
print("(simulated device; the disk is this machine's virtual disk)")
PY
  exit 0
fi
if [ "${1:-}" = behind ]; then
  reps=${2:-5}
  echo '{"engine": {"device_budget": "12 MiB", "host_budget": "512 MiB", "nvme_budget": "0"}}' > "$out/host.json"
  echo '{}' > "$out/nvme.json"
  for r in $(seq "$reps"); do
    for cfg in nvme host; do
      for v in off auto; do
        TZ_UPDATE_BEHIND_FORWARD=$v $bin train --config "$out/$cfg.json" --steps 120 --eval-every 0 \
          --quiet --run-dir "$out/$cfg-$v-$r" > /dev/null
      done
    done
  done
  python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def run(d):
    m = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l]
    u = json.load(open(f"{d}/report.json"))["optimizer"]["update_phase"]
    return statistics.median(x["step_s"] for x in m[20:]), u["measured_median_seconds"], [x["loss"] for x in m]
for cfg, name in (("nvme", "states on NVMe (the default run)"), ("host", "states in host memory")):
    a = [run(f"{out}/{cfg}-off-{r}") for r in range(1, reps + 1)]
    b = [run(f"{out}/{cfg}-auto-{r}") for r in range(1, reps + 1)]
    same = all(x[2] == y[2] for x, y in zip(a, b))
    print(f"{name}: step inside Step {statistics.median(x[0] for x in a)*1e3:.1f} ms, behind the "
          f"forward {statistics.median(x[0] for x in b)*1e3:.1f} ms; per repetition "
          f"{', '.join(f'{y[0]/x[0]:.2f}' for x, y in zip(a, b))}, median "
          f"{statistics.median(y[0]/x[0] for x, y in zip(a, b)):.3f}; update phase "
          f"{statistics.median(x[1] for x in a)*1e3:.1f} / {statistics.median(x[1] for x in b)*1e3:.1f} ms; "
          f"losses {'identical' if same else 'DIFFER'}")
print("(simulated device: the forward computes on the cores the worker uses; the disk is this machine's virtual disk)")
PY
  exit 0
fi
if [ "${1:-}" = speculative ]; then
  reps=${2:-5}
  for r in $(seq "$reps"); do
    for v in off on; do
      echo "{\"engine\": {\"device_budget\": \"12 MiB\", \"host_budget\": \"512 MiB\", \"nvme_budget\": \"0\", \"clip_grad_norm\": 0, \"speculative_step\": \"$v\"}}" >"$out/$v.json"
      $bin train --config "$out/$v.json" --steps 80 --eval-every 0 --quiet \
        --run-dir "$out/$v-$r" > /dev/null
    done
  done
  python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
for r in range(1, reps + 1):
    row = []
    for v in ("off", "on"):
        d = f"{out}/{v}-{r}"
        m = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l][20:]
        u = json.load(open(f"{d}/report.json"))["optimizer"]["update_phase"]
        row.append(f"{v}: step {statistics.median(x['step_s'] for x in m)*1e3:6.2f} ms, phase "
                   f"{u['measured_median_seconds']*1e3:5.2f} ms, used in "
                   f"{u['speculative_start']['steps']} steps")
    print(" | ".join(row))
print("(simulated device: the model computes on the same cores the speculative updates use)")
PY
  exit 0
fi
reps=${1:-3}
steps=120
# Same model and data as the default run; only where the states live differs.
resident='{"engine": {"device_budget": "64 MiB", "device_shard_budget": "64 MiB", "host_budget": "512 MiB", "nvme_budget": "0"}}'
# host: the default run's device budget (12 MiB), everything else in host memory. nvme: the
# default run's budgets.
host='{"engine": {"device_budget": "12 MiB", "host_budget": "512 MiB", "nvme_budget": "0"}}'
nvme='{"engine": {"device_budget": "12 MiB", "host_budget": "16 MiB", "nvme_budget": "256 MiB"}}'
for v in resident host nvme; do echo "${!v}" > "$out/$v.json"; done
for r in $(seq "$reps"); do
  for v in resident host nvme; do
    $bin train --config "$out/$v.json" --steps $steps --eval-every 0 --quiet \
      --run-dir "$out/$v-$r" > /dev/null
  done
done
echo "== default run (full, with evaluations), peak RSS by /usr/bin/time -v"
/usr/bin/time -v $bin train --quiet --run-dir "$out/default" > "$out/default.log" 2> "$out/time.log"
grep -E "^done|eval  step  1000" "$out/default.log"
grep -E "Maximum resident set size|Elapsed" "$out/time.log"
python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def steps(path):
    m = [json.loads(l) for l in open(path) if '"loss"' in l]
    return [x["step_s"] for x in m[20:]]
med = {}
for v in ("resident", "host", "nvme"):
    per = [statistics.median(steps(f"{out}/{v}-{r}/metrics.jsonl")) for r in range(1, reps + 1)]
    med[v] = statistics.median(per)
    print(f"{v:10s} median step {med[v]*1e3:7.1f} ms  (per repetition: {', '.join(f'{p*1e3:.1f}' for p in per)})")
for v in ("host", "nvme"):
    print(f"offloaded to {v} / resident step time: {med[v] / med['resident']:.3f}  (target <= 1.15)")
# The NVMe run's update phase next to what bounds it, both measured in the same run: the disk
# time of the bytes a step moves (states and NVMe parameter shards, read and written, at the
# rate the engine measured with reads and writes in flight together) and CPU Adam's time for
# the step's parameters (at the rate the phases' own Adam calls measured). Below 1.0: part of
# the I/O was moved out of the phase (read during backward, written behind the next forward).
for r in range(1, reps + 1):
    rep = json.load(open(f"{out}/nvme-{r}/report.json"))
    u, c = rep["optimizer"]["update_phase"], rep["counters"]
    io_s = (c["nvme_read_bytes"] + c["nvme_write_bytes"]) / c["steps"] / u["rates"]["nvme_duplex_bytes_per_second"]
    elems = sum(ch["used_elems"] for ch in rep["layout"]["chunks"])
    adam_s = elems / u["rates"]["cpu_adam_params_per_second"]
    phase = u["measured_median_seconds"]
    print(f"nvme rep {r}: update phase {phase*1e3:.1f} ms; NVMe time of its bytes {io_s*1e3:.1f} ms, "
          f"CPU Adam {adam_s*1e3:.2f} ms; phase / max = {phase / max(io_s, adam_s):.2f} (goal <= 1.15); "
          f"the bytes alone / resident step = {io_s / med['resident']:.2f}")
cfg = json.load(open(f"{out}/default/config.json"))
m = cfg["model"]; t = cfg["train"]
C, L, V, T = m["d_model"], m["n_layer"], m["vocab"], m["seq_len"]
fpt = 6 * (L * 12 * C * C + V * C) + 6 * L * T * C
steps_all = [json.loads(l) for l in open(f"{out}/default/metrics.jsonl") if '"loss"' in l]
tps = statistics.median(x["tokens_per_s"] for x in steps_all[20:])
print(f"default run: median {tps:.0f} tokens/s, {tps * fpt / 1e9:.1f} GFLOP/s of model FLOPs "
      f"({fpt/1e6:.1f} MFLOP/token, recomputation not counted)")
PY
