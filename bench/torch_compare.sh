#!/usr/bin/env bash
# tierzero's CPU GPT against the same GPT in PyTorch (bench/torch_gpt.py): fp32, everything
# resident (no offload, no activation checkpointing), 2 threads, the same batches, at two shapes:
#   default  the default run's model (5 x 192, 6 heads) on 16 x 9-token addition batches
#   wide     4 x 256, 8 heads, on 8 x 128-token batches of text
# Rounds interleave the four runs (this machine's speed drifts between minutes); each run's step
# time is the median past its first 20 steps (warm-up, plan), tokens/s follow from it, and the
# ratio is taken per round, then the median over rounds.
#   bench/torch_compare.sh [rounds, default 6]
# Both sides get the same instruction set: the script sets OPENBLAS_CORETYPE to SkylakeX (AVX-512
# kernels) on an AVX-512 CPU, and to Haswell (AVX2) on others or when ONEDNN_MAX_CPU_ISA=AVX2 holds
# tierzero's products to AVX2 (as on an AVX2 host), overriding the environment's (this workplace
# sets OPENBLAS_CORETYPE=Haswell globally, which gave PyTorch AVX2 kernels against oneDNN's AVX-512).
# Installs Debian's python3-torch and the OpenMP OpenBLAS for itself (not a tierzero dependency,
# so not in scripts/setup): with Debian's default reference BLAS torch is about 15x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-6}
bin=build/bin/tierzero
py=/usr/bin/python3  # Debian's python, which sees python3-torch
if [ "${ONEDNN_MAX_CPU_ISA:-}" != AVX2 ] && grep -qw avx512f /proc/cpuinfo; then
  export OPENBLAS_CORETYPE=SkylakeX
else
  export OPENBLAS_CORETYPE=Haswell
fi
if ! $py -c 'import torch' 2>/dev/null ||
  ! dpkg-query -W -f='${Status}' libopenblas0-openmp 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    python3-torch libopenblas0-openmp
fi
[ -x "$bin" ] || scripts/setup
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Text for the wide shape: the licence texts every Debian has, about 300 KB.
cat /usr/share/common-licenses/* > "$out/text.txt"
resident='"engine": {"device_budget": "1 GiB", "device_shard_budget": "1 GiB",
  "host_budget": "2 GiB", "nvme_budget": "0", "compute_dtype": "fp32"}'
# Everything the PyTorch side does is pinned here, not taken from tierzero's default run.
cat > "$out/default.json" <<JSON
{"model": {"n_layer": 5, "d_model": 192, "n_head": 6, "seq_len": 9,
           "activation_checkpointing": false},
 "data": {"kind": "addition", "digits": 2, "pad_operands": false, "reverse_answer": true},
 "train": {"batch_size": 16, "lr": 0.002, "min_lr": 0.0002, "warmup_steps": 50}, $resident}
JSON
cat > "$out/wide.json" <<JSON
{"model": {"n_layer": 4, "d_model": 256, "n_head": 8, "seq_len": 128,
           "activation_checkpointing": false},
 "data": {"kind": "text", "text_path": "$out/text.txt"},
 "train": {"batch_size": 8, "lr": 0.002, "min_lr": 0.0002, "warmup_steps": 50}, $resident}
JSON
declare -A steps=([default]=200 [wide]=60)
declare -A torch_args=(
  [default]="--layers 5 --width 192 --heads 6 --seq 9 --batch 16 --data addition"
  [wide]="--layers 4 --width 256 --heads 8 --seq 128 --batch 8 --data text --text $out/text.txt")

for r in $(seq "$rounds"); do
  for shape in default wide; do
    $bin train --config "$out/$shape.json" --steps "${steps[$shape]}" --eval-every 0 --quiet \
      --run-dir "$out/tz-$shape-$r" --html none --trace none > /dev/null
    OMP_NUM_THREADS=2 $py bench/torch_gpt.py ${torch_args[$shape]} --steps "${steps[$shape]}" \
      --threads 2 > "$out/torch-$shape-$r.json"
  done
  echo "round $r of $rounds done" >&2
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tokens = {"default": 16 * 9, "wide": 8 * 128}
print(f"machine: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].split(chr(10))[0].strip()}, "
      f"{len([l for l in open('/proc/cpuinfo') if l.startswith('processor')])} CPUs")
for shape in ("default", "wide"):
    tz, pt, ratio = [], [], []
    for r in range(1, rounds + 1):
        m = [json.loads(l) for l in open(f"{out}/tz-{shape}-{r}/metrics.jsonl") if '"loss"' in l]
        t = statistics.median(x["step_s"] for x in m[20:])
        j = json.load(open(f"{out}/torch-{shape}-{r}.json"))
        p = statistics.median(j["step_s"][20:])
        tz.append(tokens[shape] / t)
        pt.append(tokens[shape] / p)
        ratio.append(p / t)
    print(f"{shape:8s} tierzero {statistics.median(tz):8.0f} tok/s | PyTorch {statistics.median(pt):8.0f} "
          f"tok/s | tierzero / PyTorch {statistics.median(ratio):.2f}x "
          f"(per round: {', '.join(f'{x:.2f}' for x in ratio)})")
    print(f"         final loss tierzero {m[-1]['loss']:.4f}, PyTorch {j['loss'][-1]:.4f} "
          f"(same batches and schedule; different initial weights)")
print(f"PyTorch {j['torch']}, {j['threads']} threads, BLAS {', '.join(j['blas']) or 'none found'} "
      f"(OpenBLAS kernels: {j.get('blas_core') or 'unknown'})")
PY
