#!/usr/bin/env bash
# Compressed optimizer states (engine.optimizer_states; docs/optimizer.md): what they do to
# training and to the update phase, fp32, bf16 and 8-bit moments side by side.
#   bench/moments_bench.sh text [seeds, default 3]: the zeropp_bench `text` protocol on one rank
#     (the default model, the licence texts every Debian has as byte-level text, 16 x 32-token
#     rows, 300 steps, validation every 50) for each seed and format; the final validation loss
#     of each, and each format's mean over the seeds against fp32's.
#   bench/moments_bench.sh addition: the default addition task's final exact-match accuracy and
#     validation loss for each format (the default run, 300 steps).
#   bench/moments_bench.sh nvme [repetitions, default 3]: the default run (its optimizer states
#     on NVMe), fp32 and 8-bit moments interleaved, 60 steps each; the update phase's median
#     (report.json) and the median of the per-repetition ratios fp32 / int8.
# On the simulated device, like every CPU figure here; the disk is this machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin/tierzero
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mode=${1:-text}

case $mode in
  text)
    seeds=${2:-3}
    cat /usr/share/common-licenses/* >"$out/text.txt"
    for s in $(seq "$seeds"); do
      for f in fp32 bf16 int8; do
        python3 -c 'import json, sys; json.dump({"model": {"seq_len": 32, "seed": int(sys.argv[2])}, "data": {"seed": int(sys.argv[2])}, "engine": {"optimizer_states": sys.argv[3]}}, open(sys.argv[1], "w"))' \
          "$out/$f-$s.json" "$s" "$f"
        $bin train --config "$out/$f-$s.json" --text "$out/text.txt" --batch-size 16 \
          --device-budget 64MiB --steps 300 --eval-every 50 --quiet --run-dir "$out/$f-$s" \
          >"$out/$f-$s.log" 2>&1 || { echo "FAIL: $f-$s"; tail -20 "$out/$f-$s.log"; exit 1; }
      done
    done
    python3 - "$out" "$seeds" <<'EOF'
import json, statistics, sys
out, seeds = sys.argv[1], int(sys.argv[2])
def final(f, s):
    ls = [json.loads(l) for l in open(f"{out}/{f}-{s}/metrics.jsonl")]
    return [l["val_loss"] for l in ls if "val_loss" in l][-1]
print("final validation loss after 300 steps, default model, byte-level text, 16 x 32-token rows")
print("| seed | fp32 | bf16 | int8 |")
print("|---|---|---|---|")
for s in range(1, seeds + 1):
    print(f"| {s} | " + " | ".join(f"{final(f, s):.4f}" for f in ("fp32", "bf16", "int8")) + " |")
mean = {f: statistics.mean(final(f, s) for s in range(1, seeds + 1)) for f in ("fp32", "bf16", "int8")}
print("| mean | " + " | ".join(f"{mean[f]:.4f}" for f in ("fp32", "bf16", "int8")) + " |")
for f in ("bf16", "int8"):
    print(f"{f}: mean final validation loss {mean[f] / mean['fp32']:.4f} x fp32's")
EOF
    ;;
  addition)
    for f in fp32 bf16 int8; do
      $bin train --optimizer-states $f --quiet --run-dir "$out/$f" >"$out/$f.log" 2>&1 ||
        { echo "FAIL: $f"; tail -20 "$out/$f.log"; exit 1; }
    done
    python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
print("| moments | final validation loss | exact-match accuracy |")
print("|---|---|---|")
for f in ("fp32", "bf16", "int8"):
    ls = [json.loads(l) for l in open(f"{out}/{f}/metrics.jsonl") if '"val_loss"' in l]
    print(f"| {f} | {ls[-1]['val_loss']:.4f} | {100 * ls[-1].get('val_accuracy', float('nan')):.1f}% |")
EOF
    ;;
  nvme)
    reps=${2:-3}
    for r in $(seq "$reps"); do
      for f in fp32 int8; do
        $bin train --optimizer-states $f --steps 60 --eval-every 0 --quiet --run-dir "$out/$f-$r" \
          >"$out/$f-$r.log" 2>&1 || { echo "FAIL: $f-$r"; tail -20 "$out/$f-$r.log"; exit 1; }
      done
    done
    python3 - "$out" "$reps" <<'EOF'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def run(f, r):
    d = f"{out}/{f}-{r}"
    rep = json.load(open(f"{d}/report.json"))
    u = rep["optimizer"]["update_phase"]
    m = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l][20:]
    return u["measured_median_seconds"], statistics.median(x["step_s"] for x in m)
print("the default run (optimizer states on NVMe), 60 steps, interleaved; medians")
print("| rep | fp32 phase s | int8 phase s | phase ratio | fp32 step s | int8 step s |")
print("|---|---|---|---|---|---|")
ratios = []
for r in range(1, reps + 1):
    (pf, sf), (pi, si) = run("fp32", r), run("int8", r)
    ratios.append(pf / pi)
    print(f"| {r} | {pf:.4f} | {pi:.4f} | {pf / pi:.2f} | {sf:.4f} | {si:.4f} |")
print(f"update phase, fp32 / int8 moments: {statistics.median(ratios):.2f}x (median of the ratios)")
EOF
    ;;
  *)
    echo "usage: bench/moments_bench.sh text [seeds] | addition | nvme [reps]" >&2
    exit 2
    ;;
esac
