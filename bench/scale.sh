#!/usr/bin/env bash
# Scale benchmark (issue 6): a GPT whose model states (16 bytes per parameter) exceed this
# machine's RAM trains for a few steps through the NVMe tier.
#   bench/scale.sh [run_dir, default runs/scale] [layers, default 26]
# 26 layers x 2560 wide = 2.05B parameters = 32.7 GB of model states on a 24 GiB machine. The
# budgets: 2 GiB simulated device, 10 GiB host (the bf16 parameter and gradient shards), and the
# fp32 masters and Adam moments (24.5 GB) on NVMe. Needs about 55 GB free under run_dir (swap
# file and the final checkpoint). The disk's read and write rates (fio, the same access the NVMe
# tier makes) are measured in the same run, before training, as the ceiling for the optimizer's
# NVMe traffic. lr is 1e-6 with no warm-up: Adam's first steps move every weight by about lr, and
# 1e-5 already drives a model this deep the wrong way in 3 steps (the loss rose 6.2 -> 10.7).
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir=$(realpath -m "${1:-runs/scale}")
layers=${2:-26}
bin=build/bin/tierzero
rm -rf "$run_dir"
mkdir -p "$run_dir"

echo "== disk ceiling: fio, 4 GiB sequential, 1 MiB blocks, depth 32, O_DIRECT, io_uring, under $run_dir"
fio_rate() {  # $1 = read|write; prints bytes/s
  fio --name=ceiling --filename="$run_dir/fio.bin" --size=4G --bs=1M --iodepth=32 --direct=1 \
    --ioengine=io_uring --rw="$1" --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['$1']['bw_bytes'])"
}
write_bw=$(fio_rate write)
read_bw=$(fio_rate read)
rm -f "$run_dir/fio.bin"
echo "write $(python3 -c "print(f'{$write_bw/1e9:.2f}')") GB/s, read $(python3 -c "print(f'{$read_bw/1e9:.2f}')") GB/s"

cat > "$run_dir/scale.json" <<JSON
{
  "model": {"d_model": 2560, "n_layer": $layers, "n_head": 20},
  "data": {"digits": 2},
  "train": {"steps": 3, "batch_size": 8, "lr": 1e-6, "min_lr": 1e-6, "warmup_steps": 0,
            "eval_every": 0, "eval_batches": 1},
  "engine": {"device_budget": "2 GiB", "host_budget": "10 GiB", "nvme_budget": "40 GiB"},
  "output": {"run_dir": "$run_dir/run"}
}
JSON
echo "== tierzero train --config $run_dir/scale.json (peak RSS by /usr/bin/time -v)"
/usr/bin/time -v $bin train --config "$run_dir/scale.json" 2> "$run_dir/time.log"
grep -E "Maximum resident set size|Elapsed|Exit status" "$run_dir/time.log"
python3 - "$run_dir/run" "$read_bw" "$write_bw" <<'PY'
import json, sys
run, read_bw, write_bw = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rep = json.load(open(f"{run}/report.json"))
steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"loss"' in l]
c, t = rep["counters"], rep["tiers"]
gib = lambda b: b / 2**30
print("== summary")
print("loss per step:", " ".join(f"{s['loss']:.4f}" for s in steps))
print("step seconds: ", " ".join(f"{s['step_s']:.1f}" for s in steps))
print(f"tiers: device peak {gib(t['device']['peak']):.2f} GiB of {gib(t['device']['capacity']):.2f}; "
      f"host {gib(t['host']['used']):.2f} of {gib(t['host']['budget']):.2f} GiB; "
      f"NVMe {gib(t['nvme']['used']):.2f} of {gib(t['nvme']['budget']):.2f} GiB")
total = sum(s["step_s"] for s in steps)
opt, nvme, wait = c["optimizer_seconds"], c["optimizer_nvme_seconds"], c["acquire_wait_seconds"]
print(f"time over {len(steps)} steps ({total:.1f} s): optimizer step {opt:.1f} s "
      f"(of which waiting on NVMe {nvme:.1f} s), waiting for parameters {wait:.1f} s, "
      f"forward/backward compute {total - opt - wait:.1f} s")
# The optimizer reads and writes every master/m/v byte once per step; on one disk the two
# directions share the device, so at fio's rates the transfers alone take read + write time.
states = t["nvme"]["used"]
disk_s = states / read_bw + states / write_bw
per_step = opt / len(steps)
if disk_s > 0:
  print(f"optimizer: {states/1e9:.1f} GB of states read and written per step, {per_step:.1f} s per step "
        f"= {2 * states / per_step / 1e9:.2f} GB/s both directions together; at fio's rates the same "
        f"transfers take {disk_s:.1f} s (measured / fio-rate time = {per_step / disk_s:.2f})")
print(f"bytes: NVMe read {gib(c['nvme_read_bytes']):.1f} GiB, write {gib(c['nvme_write_bytes']):.1f} GiB; "
      f"H2D {gib(c['h2d_bytes']):.1f} GiB, D2H {gib(c['d2h_bytes']):.1f} GiB")
PY
