#!/usr/bin/env bash
# ZeRO++ on `tierzero train` (issue 21; docs/zero.md, "ZeRO++"), 4 ranks as 2 emulated nodes of 2
# (ranks.ranks_per_node = 2) on the simulated device:
#   bench/zeropp_bench.sh convergence [seeds]
#                                       the default model for 300 steps as plain ZeRO-3, as qwZ int8 +
#                                       hpZ + qgZ int4, and as the same with qgZ int8, for each of
#                                       seeds 1..seeds (default 5; model and data seed): validation
#                                       loss curves, final losses per seed and their means against
#                                       ZeRO-3's, and the bytes each step sent across nodes.
#   bench/zeropp_bench.sh text [seeds]  the same on byte-level text (Debian's licence texts).
#   bench/zeropp_bench.sh slowlink [reps] step times of ZeRO-3 and ZeRO++ when the cross-node link
#                                       is EMULATED at 0.1 and 0.025 GB/s (TZ_EMULATE_CROSS_NODE_GBPS:
#                                       a delay the MPI backend adds to cross-node traffic, Note [An
#                                       emulated slow link] in src/zero/mpi.cc), next to the time
#                                       the cross-node bytes alone take at that bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-convergence}
bin=$PWD/build/bin/tierzero
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
plain='{"ranks": {"ranks_per_node": 2}}'
int4='{"ranks": {"ranks_per_node": 2}, "zeropp": {"qwz": true, "qwz_bits": 8, "hpz": true, "qgz": true, "qgz_bits": 4}}'
int8='{"ranks": {"ranks_per_node": 2}, "zeropp": {"qwz": true, "qwz_bits": 8, "hpz": true, "qgz": true, "qgz_bits": 8}}'
for v in plain int4 int8; do echo "${!v}" >"$out/$v.json"; done

run() {  # name run_dir [extra args]
  local name=$1 dir=$2
  shift 2
  mpirun -np 4 "$bin" train --config "$out/$name.json" --run-dir "$dir" --quiet "$@" \
    >"$dir.log" 2>&1 || { echo "FAIL: $name"; tail -20 "$dir.log"; exit 1; }
}

case $mode in
  convergence | text)
    # Each seed sets the model's initialisation and the batches (model.seed, data.seed); the three
    # variants of one seed see the same batches from the same initial weights. `text`: the same
    # model on byte-level text (the licence texts every Debian has, 300 KB), 32-token rows, 16 per
    # rank, whose loss falls smoothly instead of leaving a plateau at a chaotic step.
    seeds=${2:-5}
    model='{}'
    args=()
    if [ "$mode" = text ]; then
      cat /usr/share/common-licenses/* >"$out/text.txt"
      model='{"seq_len": 32}'
      args=(--text "$out/text.txt" --batch-size 16 --device-budget 64MiB)
    fi
    for s in $(seq "$seeds"); do
      for v in plain int4 int8; do
        python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); s = int(sys.argv[3]); c["model"] = dict(json.loads(sys.argv[4]), seed=s); c["data"] = {"seed": s}; json.dump(c, open(sys.argv[2], "w"))' \
          "$out/$v.json" "$out/$v-$s.json" "$s" "$model"
        run $v-$s "$out/$v-$s" --steps 300 --eval-every 50 "${args[@]}"
      done
    done
    python3 - "$out" "$seeds" "$mode" <<'EOF'
import json, statistics, sys
out, seeds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
names = {"plain": "ZeRO-3", "int4": "qwZ8+hpZ+qgZ4", "int8": "qwZ8+hpZ+qgZ8"}
val, lines = {}, {}
for k in names:
    for s in range(1, seeds + 1):
        ls = [json.loads(l) for l in open(f"{out}/{k}-{s}/metrics.jsonl")]
        val[k, s] = {l["step"]: l["val_loss"] for l in ls if "val_loss" in l}
        lines[k, s] = [l for l in ls if "loss" in l]
steps = sorted(val["plain", 1])
data = "byte-level text, 16 x 32-token rows per rank" if mode == "text" else "the default addition task"
print(f"validation loss, 4 ranks as 2 emulated nodes of 2, default model, {data}, 300 steps; seed 1's curves")
print("| step | " + " | ".join(names.values()) + " |")
print("|---:|" + "---:|" * len(names))
for st in steps:
    print(f"| {st} | " + " | ".join(f"{val[k, 1][st]:.4f}" for k in names) + " |")
print()
print("final validation loss (step 300) per seed (model and data seed)")
print("| seed | " + " | ".join(names.values()) + " | qgZ4 vs ZeRO-3 | qgZ8 vs ZeRO-3 |")
print("|---:|" + "---:|" * (len(names) + 2))
final = {(k, s): val[k, s][steps[-1]] for k in names for s in range(1, seeds + 1)}
pct = lambda a, b: f"{100 * (a - b) / b:+.1f}%"
for s in range(1, seeds + 1):
    print(f"| {s} | " + " | ".join(f"{final[k, s]:.4f}" for k in names) + " | " +
          " | ".join(pct(final[k, s], final["plain", s]) for k in ("int4", "int8")) + " |")
mean = {k: statistics.mean(final[k, s] for s in range(1, seeds + 1)) for k in names}
print("| mean | " + " | ".join(f"{mean[k]:.4f}" for k in names) + " | " +
      " | ".join(pct(mean[k], mean["plain"]) for k in ("int4", "int8")) + " |")
if seeds > 1:
    sd = statistics.stdev(final["plain", s] for s in range(1, seeds + 1))
    print(f"ZeRO-3's final loss across seeds: mean {mean['plain']:.4f}, standard deviation {sd:.4f} "
          f"({100 * sd / mean['plain']:.0f}% of the mean)")
# Bytes this rank sent across nodes per step, median over steps 2.. (step 1 is the warm-up).
cross = {k: statistics.median(l["comm_cross_node_bytes"] for l in lines[k, 1][1:]) for k in names}
for k in ("int4", "int8"):
    print(f"cross-node bytes per step {names[k]}: {cross[k]:.0f} = {cross[k] / cross['plain']:.3f} "
          f"of ZeRO-3's {cross['plain']:.0f}")
EOF
    ;;
  slowlink)
    reps=${2:-3}
    steps=40
    for gbps in 0.1 0.025; do
      for r in $(seq "$reps"); do
        for v in plain int4; do
          TZ_EMULATE_CROSS_NODE_GBPS=$gbps run $v "$out/$v-$gbps-$r" --steps $steps --eval-every 0
        done
      done
    done
    python3 - "$out" "$reps" <<'EOF'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
print("EMULATED cross-node link (TZ_EMULATE_CROSS_NODE_GBPS), 4 ranks as 2 nodes of 2; medians of")
print("steps 10.. over the repetitions; bytes are one rank's per step")
print("| link | run | step ms | cross-node MB/step | bytes-alone ms | all sent MB/step |")
print("|---|---|---:|---:|---:|---:|")
for gbps in ("0.1", "0.025"):
    for v, name in (("plain", "ZeRO-3"), ("int4", "ZeRO++ (qwZ8+hpZ+qgZ4)")):
        lines = []
        for r in range(1, reps + 1):
            ls = [json.loads(l) for l in open(f"{out}/{v}-{gbps}-{r}/metrics.jsonl")]
            lines += [l for l in ls if "loss" in l and l["step"] >= 10]
        ms = 1e3 * statistics.median(l["step_s"] for l in lines)
        cross = statistics.median(l["comm_cross_node_bytes"] for l in lines)
        sent = statistics.median(l["comm_bytes"] for l in lines)
        alone = 1e3 * cross / (float(gbps) * 1e9)
        print(f"| {gbps} GB/s | {name} | {ms:.1f} | {cross / 1e6:.2f} | {alone:.1f} | {sent / 1e6:.2f} |")
EOF
    ;;
  *)
    echo "usage: bench/zeropp_bench.sh convergence [seeds] | text [seeds] | slowlink [reps]" >&2
    exit 2
    ;;
esac
