#!/usr/bin/env bash
# `tierzero train` under mpirun with 1, 2 and 4 ranks (ZeRO-3, data parallel), against the
# one-rank run of the same global batch (docs/zero.md):
#   1. fp32: 20 steps on 2 and 4 ranks match the 1-rank run's losses within 1e-5 relative at every
#      step (1 rank accumulates 4 micro-batches, 2 ranks 2 each, 4 ranks 1 each).
#   2. Per-rank model state (report ranks.model_state_bytes) is 1/W of the 1-rank run's (and the
#      config's ranks.ranks_per_node = 2 shows as W/2 nodes), within
#      the padding of W shards per chunk.
#   3. Resharding: 10 steps on 4 ranks, resumed on 2 ranks to step 15, resumed on 1 rank to step
#      20: every step's loss matches the uninterrupted run (so weights and Adam moments came
#      through); and the 4-rank checkpoint re-saved on 2 ranks and then on 1 exports (one
#      process) to the very bytes the 4-rank checkpoint exports to.
#   4. ZeRO++ on 4 ranks as 2 nodes of 2 (bf16, shards on NVMe): the device path and the path
#      through host buffers give the same losses bit for bit, within 5% of plain ZeRO-3's.
#   6. The optimizer's placements on 2 ranks (docs/optimizer.md): every group on the CPU, a mix
#      of groups resident on the device and streamed to it, and every group that can stream
#      streamed, give the same losses bit for bit (fp32 and bf16), and the report shows each
#      assignment.
#   7. The Llama family: 2 ranks match 1 rank x accumulation 2 within 1e-5 relative.
#   5. A failing rank: a 2-rank checkpoint with rank 1's states file corrupted; resuming on 2 ranks
#      exits non-zero within 60 s, with rank 1's message (checksum mismatch), not a hang.
#   8. Machines without a shared file system: each rank resumes its own copy of a checkpoint of
#      the same name, the copies saves of two runs at the same step. Refused by every rank
#      ("the ranks read different saves"), not trained as a model mixed from both. The same for
#      --init-from: a model directory of one name holding two models ("different weights"), and
#      one missing on rank 1 (named as such, not as a difference of configs).
#   9. Budgets sized to the machine (a model directory, no budget given): the ranks on one machine
#      share it (each rank's host budget at most a quarter of its memory with 2 ranks, where one
#      rank takes half), and with host collectives no device-resident shards (which those refuse).
# Usage: train_ranks_test.sh TIERZERO MPIEXEC
set -euo pipefail
tz=$1
mpiexec=$2
work=$(mktemp -d /tmp/tz-ranks.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"

cat >config.json <<'EOF'
{
  "model": {"n_layer": 2, "d_model": 96, "n_head": 3},
  "train": {"batch_size": 8, "lr": 0.001, "min_lr": 0.001, "warmup_steps": 0,
            "eval_every": 0, "eval_batches": 2},
  "engine": {"device": "host", "compute_dtype": "fp32", "device_budget": "8 MiB",
             "nvme_budget": "256 MiB", "chunk_elems": 65536},
  "ranks": {"ranks_per_node": 2, "collective_timeout_s": 120}
}
EOF

run() {  # ranks accumulation run_dir steps [extra args]
  local np=$1 acc=$2 dir=$3 steps=$4
  shift 4
  # Per-rank host budgets small enough that every run keeps optimizer states (and, on 1 rank,
  # parameter shards) on NVMe.
  local host
  case $np in 4) host=5MiB ;; *) host=6MiB ;; esac
  "$mpiexec" -np "$np" "$tz" train --config config.json --grad-accumulation "$acc" \
    --host-budget "$host" --steps "$steps" --run-dir "$dir" --quiet "$@" >"$dir.log" 2>&1 ||
    { echo "FAIL: $np ranks ($dir):"; tail -20 "$dir.log"; exit 1; }
}

run 1 4 r1 20
run 2 2 r2 20
run 4 1 r4 20
# The same 2-rank run with gathers and reductions through host buffers instead of the device.
sed 's/"ranks_per_node": 2,/"ranks_per_node": 2, "collectives": "host",/' config.json >host.json
"$mpiexec" -np 2 "$tz" train --config host.json --grad-accumulation 2 --host-budget 6MiB \
  --steps 20 --run-dir h2 --quiet >h2.log 2>&1 || { echo "FAIL: host collectives"; tail -20 h2.log; exit 1; }
grep -q '"collectives_on": "host"' h2/report.json ||
  { echo "FAIL: the report does not show host collectives"; exit 1; }
grep -q '"collectives_on": "device (mpi)"' r2/report.json ||
  { echo "FAIL: the report does not show device collectives"; exit 1; }
# Resharding chain 4 -> 2 -> 1.
run 4 1 c4 10
run 2 2 c2 15 --resume c4/checkpoint
run 1 4 c1 20 --resume c2/checkpoint
# The same global batch on other rank counts says nothing; another one is announced, with the
# accumulation that keeps it.
if grep -q "global batch" c2.log c1.log; then echo "FAIL: a batch change announced wrongly"; exit 1; fi
run 2 1 g2 12 --resume c4/checkpoint
grep -q "the global batch changes from 32 rows (8 per micro-batch x 1 accumulated x 4 ranks) to 16 (8 x 1 x 2); --grad-accumulation 2 keeps it" g2.log ||
  { echo "FAIL: no note of the global batch change"; cat g2.log; exit 1; }
# The 4-rank checkpoint of step 10 re-saved on 2 ranks, then on 1, exports (one process, itself
# a resharding load) to the same bytes as the 4-rank checkpoint does.
run 2 2 x2 10 --resume c4/checkpoint
run 1 4 x1 10 --resume x2/checkpoint
"$tz" export c4/checkpoint -o c4.safetensors >/dev/null
"$tz" export x1/checkpoint -o x1.safetensors >/dev/null
cmp c4.safetensors x1.safetensors ||
  { echo "FAIL: 4 -> 2 -> 1 resharding changed the weights"; exit 1; }
echo "4 -> 2 -> 1 resharding round trip: exports identical ($(stat -c %s c4.safetensors) bytes)"

# The Llama family (grouped-query attention, untied head) on 2 ranks against 1 rank x 2.
llama=(--arch llama --kv-heads 1 --layers 2 --width 64 --heads 2)
run 1 2 l1 10 "${llama[@]}"
run 2 1 l2 10 "${llama[@]}"

python3 - <<'EOF'
import json, struct, sys

def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j}

def check(name, got, ref, tol=1e-5):
    worst = 0.0
    for step, l in got.items():
        rel = abs(l - ref[step]) / abs(ref[step])
        worst = max(worst, rel)
        if rel > tol:
            sys.exit(f"FAIL {name}: step {step} loss {l!r} vs 1 rank {ref[step]!r} (rel {rel:.2e})")
    print(f"{name}: {len(got)} steps, worst relative difference {worst:.2e}")

ref = losses("r1/metrics.jsonl")
assert len(ref) == 20, ref
check("2 ranks", losses("r2/metrics.jsonl"), ref)
check("Llama, 2 ranks", losses("l2/metrics.jsonl"), losses("l1/metrics.jsonl"))
check("2 ranks, host collectives", losses("h2/metrics.jsonl"), ref)
check("4 ranks", losses("r4/metrics.jsonl"), ref)
chain = {}
for d in ("c4", "c2", "c1"):
    chain.update(losses(f"{d}/metrics.jsonl"))
assert sorted(chain) == list(range(1, 21)), sorted(chain)
check("4 -> 2 -> 1 ranks", chain, ref)

# Per-rank model state: 1/W of one rank's, within one chunk's padding per chunk.
one = json.load(open("r1/report.json"))
for d, w in (("r2", 2), ("r4", 4)):
    r = json.load(open(f"{d}/report.json"))["ranks"]
    assert r["world_size"] == w, r
    # ranks.ranks_per_node = 2 emulates two ranks per node.
    assert r["nodes"] == w // 2 and r["local_size"] == 2 and r["node"] == 0, r
    chunks = len(one["layout"]["chunks"])
    per = one["ranks"]["model_state_bytes"] / w
    slack = chunks * 16 * 1024 * w  # 4 KiB shard granularity, 16 bytes of state per element
    if not (per <= r["model_state_bytes"] <= per + slack):
        sys.exit(f"FAIL {w} ranks: {r['model_state_bytes']} bytes of state per rank, 1/{w} of "
                 f"one rank's is {per:.0f}")
    print(f"{w} ranks: {r['model_state_bytes']} bytes of model state per rank, "
          f"{r['model_state_bytes'] / one['ranks']['model_state_bytes']:.3f} of one rank's")

EOF

# bf16, with parameter shards on NVMe on every rank (small chunks, small host budgets): 2 ranks
# against 1 rank accumulating 2 micro-batches. Not bit-comparable: each rank's gradient chunk is
# rounded to bf16 before the reduce-scatter, while one rank sums the micro-batches in fp32.
sed -e 's/"fp32"/"bf16"/' -e 's/"chunk_elems": 65536/"chunk_elems": 40960/' config.json >bf16.json
for np in 1 2; do
  host="3500 KiB"  # one rank's fp32 gradient shards (accumulation) take 1.09 MiB of it
  [ $np = 1 ] || host="1800 KiB"
  "$mpiexec" -np $np "$tz" train --config bf16.json --grad-accumulation $((2 / np)) \
    --host-budget "$host" --steps 20 --run-dir b$np --quiet >b$np.log 2>&1 ||
    { echo "FAIL: bf16 on $np ranks"; tail -20 b$np.log; exit 1; }
  grep -q "nvme: [1-9][0-9]* param shards" b$np.log ||
    { echo "FAIL: bf16 on $np ranks kept no parameter shard on NVMe"; grep nvme: b$np.log; exit 1; }
done
python3 - <<'EOF'
import json, sys
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j}
a, b = losses("b1/metrics.jsonl"), losses("b2/metrics.jsonl")
worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in a)
print(f"bf16, 2 ranks vs 1: worst relative loss difference over 20 steps {worst:.2e}")
if worst > 1e-3:
    sys.exit("FAIL: bf16 losses on 2 ranks drift from 1 rank's by more than 1e-3")
EOF

# ZeRO++ (qwZ int8 + hpZ + qgZ int4) on 4 ranks as 2 nodes of 2, bf16 with parameter shards on
# NVMe (many chunks, so reductions overlap and queue): on the device path and through host
# buffers the same quantized arithmetic in the same order, so the same losses bit for bit; and
# within 5% of plain ZeRO-3's at every one of the 20 steps (1.8% measured).
sed 's/"ranks_per_node": 2,/"ranks_per_node": 2, "collectives": "host",/' bf16.json >bf16host.json
zpp='{"qwz": true, "qwz_bits": 8, "hpz": true, "qgz": true, "qgz_bits": 4}'
for v in bf16 bf16host; do
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["zeropp"] = json.loads(sys.argv[2]); json.dump(c, open(sys.argv[3], "w"))' \
    $v.json "$zpp" z$v.json
done
for v in bf16 zbf16 zbf16host; do
  "$mpiexec" -np 4 "$tz" train --config $v.json --host-budget "2200 KiB" --steps 20 --run-dir p$v \
    --quiet >p$v.log 2>&1 || { echo "FAIL: ZeRO++ run $v"; tail -20 p$v.log; exit 1; }
done
grep -q "nvme: [1-9][0-9]* param shards" pzbf16host.log ||
  { echo "FAIL: the ZeRO++ run through host buffers kept no parameter shard on NVMe"; exit 1; }
python3 - <<'EOF'
import json, sys
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j}
plain, dev, host = (losses(f"p{v}/metrics.jsonl") for v in ("bf16", "zbf16", "zbf16host"))
if dev != host:
    sys.exit(f"FAIL: ZeRO++ through host buffers {host} differs from the device path {dev}")
worst = max(abs(dev[s] - plain[s]) / abs(plain[s]) for s in plain)
print(f"ZeRO++ on 4 ranks: device and host paths equal; worst relative loss difference from "
      f"ZeRO-3 over 20 steps {worst:.2e}")
if worst > 0.05:
    sys.exit("FAIL: ZeRO++ losses drift from ZeRO-3's by more than 5%")
EOF

# The optimizer's placements on 2 ranks, bit for bit (fp32 and bf16); and the speculative start
# (docs/optimizer.md) against the same run without it, with clipping (rolled back every step
# here) and without (used).
for dt in fp32 bf16; do
  for v in cpu mix all spec nocl noclspec; do
    python3 - "$dt" "$v" <<'EOF'
import json, sys
dt, v = sys.argv[1], sys.argv[2]
c = json.load(open("config.json"))
c["engine"]["compute_dtype"] = dt
c["engine"]["optimizer"] = {"mix": 0.75, "all": 1}.get(v, "cpu")
if v == "mix":
    c["engine"]["device_shard_budget"] = "1 MiB"
c["engine"]["speculative_step"] = "on" if v.endswith("spec") else "off"
if v.startswith("nocl"):
    c["engine"]["clip_grad_norm"] = 0
json.dump(c, open(f"o{dt}{v}.json", "w"))
EOF
    # The speculative start works on groups in host memory: room for them and their copies.
    hb=6MiB
    case $v in spec | nocl*) hb=64MiB ;; esac
    "$mpiexec" -np 2 "$tz" train --config o$dt$v.json --host-budget $hb --steps 12 \
      --run-dir o$dt$v --quiet >o$dt$v.log 2>&1 ||
      { echo "FAIL: optimizer placement $v ($dt)"; tail -20 o$dt$v.log; exit 1; }
  done
done
python3 - <<'EOF'
import json, sys
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j}
for dt in ("fp32", "bf16"):
    runs = {v: losses(f"o{dt}{v}/metrics.jsonl") for v in ("cpu", "mix", "all")}
    for v in ("mix", "all"):
        if runs[v] != runs["cpu"]:
            sys.exit(f"FAIL: {dt}, optimizer {v}: losses {runs[v]} differ from the CPU's {runs['cpu']}")
    where = {}
    for v in ("cpu", "mix", "all"):
        groups = json.load(open(f"o{dt}{v}/report.json"))["optimizer"]["sub_groups"]
        where[v] = {w: sum(g.get("update") == w for g in groups)
                    for w in ("cpu", "device", "device-streamed")}
    if where["cpu"]["cpu"] == 0 or where["cpu"]["device"] + where["cpu"]["device-streamed"]:
        sys.exit(f"FAIL: {dt}, optimizer cpu: {where['cpu']}")
    if not (where["mix"]["device"] and where["mix"]["device-streamed"]):
        sys.exit(f"FAIL: {dt}, optimizer 0.75 with 1 MiB of device shard budget: {where['mix']}")
    if not where["all"]["device-streamed"]:
        sys.exit(f"FAIL: {dt}, optimizer 1: nothing streamed: {where['all']}")
    print(f"optimizer placements, {dt}, 2 ranks, 12 steps: equal losses; rank 0's groups "
          f"{where}")
    for v, base, used in (("spec", "cpu", False), ("noclspec", "nocl", True)):
        if losses(f"o{dt}{v}/metrics.jsonl") != losses(f"o{dt}{base}/metrics.jsonl"):
            sys.exit(f"FAIL: {dt}, the speculative start ({v}) changed the losses")
        sp = json.load(open(f"o{dt}{v}/report.json"))["optimizer"]["update_phase"]["speculative_start"]
        if (sp["steps"] >= 10) != used or (sp["rollbacks"] >= 10) == used:
            sys.exit(f"FAIL: {dt}, {v}: speculative start {sp}")
        print(f"speculative start, {dt}, 2 ranks: equal losses; {v}: {sp}")
EOF

# A failing rank: rank 1's states file corrupted in a 2-rank checkpoint.
f=$(ls r2/checkpoint/states-*.rank1.bin)
printf 'garbage!' | dd of="$f" bs=1 seek=64 conv=notrunc status=none
start=$(date +%s)
rc=0
timeout 60 "$mpiexec" -np 2 "$tz" train --config config.json --grad-accumulation 2 \
  --steps 25 --run-dir bad --resume r2/checkpoint --quiet >bad.log 2>&1 || rc=$?
[ "$rc" -ne 0 ] || { echo "FAIL: a corrupt rank's checkpoint resumed"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the ranks hung (60 s)"; tail bad.log; exit 1; }
# (Rank 1 says it, or the rank that reaches MPI_Abort first says rank 1's error: under load the
# launcher may end rank 1 before its own line is out.)
grep -qE "rank 1 of 2: error: .*checksum mismatch|error: .*rank 1 of 2: .*checksum mismatch" bad.log ||
  { echo "FAIL: no message from the failing rank"; cat bad.log; exit 1; }
echo "failing rank: every rank exited (rc $rc) after $(($(date +%s) - start)) s with rank 1's message"
# Per-rank copies of two runs' checkpoints at one step (a wrapper runs each rank in its own
# directory, as on machines that each hold a copy under the same name).
for seed in 1 2; do
  "$mpiexec" -np 2 "$tz" train --config config.json --grad-accumulation 2 --steps 4 --seed $seed \
    --run-dir "s$seed" --quiet >"s$seed.log" 2>&1 || { echo "FAIL: seed $seed run"; tail s$seed.log; exit 1; }
done
mkdir -p own0 own1
cp -a s1/checkpoint own0/ck
cp -a s2/checkpoint own1/ck
printf '#!/usr/bin/env bash\ncd "%s/own${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}" && exec "%s" "$@"\n' \
  "$work" "$tz" >own.sh
chmod +x own.sh
# refused LOG MESSAGE WHAT ARGS...: `train ARGS` on 2 ranks through own.sh must fail (not hang)
# with MESSAGE in its output; WHAT names the case.
refused() {
  local log=$1 message=$2 what=$3 rc=0
  shift 3
  timeout 60 "$mpiexec" -np 2 ./own.sh train "$@" --quiet >"$log" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { echo "FAIL: $what (rc $rc)"; tail "$log"; exit 1; }
  grep -q -- "$message" "$log" || { echo "FAIL: $what: no message '$message'"; cat "$log"; exit 1; }
}
refused mixed.log "the ranks read different saves" "two saves resumed as one" \
  --config "$work/config.json" --grad-accumulation 2 --steps 6 --resume ck --run-dir "$work/mixed"
echo "per-rank copies of two saves at one step: refused"
# Copies of one save are one save, whatever an editor did to the manifest's whitespace.
rm -rf own1/ck && cp -a s1/checkpoint own1/ck && echo >>own1/ck/manifest.json
timeout 60 "$mpiexec" -np 2 ./own.sh train --config "$work/config.json" --grad-accumulation 2 \
  --steps 6 --resume ck --run-dir "$work/same" --quiet >same.log 2>&1 ||
  { echo "FAIL: copies of one save refused"; tail same.log; exit 1; }
for seed in 1 2; do
  "$tz" export "s$seed/checkpoint" --format hf -o "own$((seed - 1))/m" >/dev/null 2>&1 ||
    { echo "FAIL: export of s$seed"; exit 1; }
done
refused mixed2.log "the ranks start from different weights" "two models trained as one" \
  --config "$work/config.json" --grad-accumulation 2 --steps 2 --init-from m --run-dir "$work/mixed2"
rm -rf own1/m
refused mixed3.log "rank 1 of 2: --init-from m cannot be read" "a model missing on rank 1" \
  --config "$work/config.json" --grad-accumulation 2 --steps 2 --init-from m --run-dir "$work/mixed3"
echo "per-rank model directories: two models refused, one missing on rank 1 named"
mem=$(($(getconf _PHYS_PAGES) * $(getconf PAGE_SIZE)))
for coll in device host nodes; do
  # nodes: two emulated nodes of one rank on this one machine, which they still share.
  case $coll in nodes) ranks='"ranks_per_node": 1' ;; *) ranks="\"collectives\": \"$coll\"" ;; esac
  printf '{"train": {"batch_size": 8, "eval_every": 0}, "engine": {"device": "host", "compute_dtype": "fp32"}, "ranks": {%s}}\n' \
    "$ranks" >"machine-$coll.json"
  "$mpiexec" -np 2 "$tz" train --config "machine-$coll.json" --init-from own0/m --steps 2 \
    --run-dir "machine-$coll" --quiet >"machine-$coll.log" 2>&1 ||
    { echo "FAIL: machine-sized budgets, $coll collectives"; tail "machine-$coll.log"; exit 1; }
  python3 - "machine-$coll/config.json" "$mem" "$coll" <<'EOF'
import json, re, sys
e = json.load(open(sys.argv[1]))["engine"]
def size(v):
    if isinstance(v, int): return v
    n, u = re.fullmatch(r"([0-9.]+) ?([KMGT]?i?B)", v).groups()
    return int(float(n) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[u])
mem, host = int(sys.argv[2]), size(e["host_budget"])
if host > mem // 4:
    sys.exit(f"FAIL: host budget {host} of 2 ranks on a machine of {mem}: more than a quarter each")
if sys.argv[3] == "host" and size(e["device_shard_budget"]) != 0:
    sys.exit(f"FAIL: device-resident shards with host collectives: {e['device_shard_budget']}")
print(f"machine-sized budgets, {sys.argv[3]}: host {host >> 20} MiB a rank of {mem >> 20} MiB")
EOF
done
# The model directory missing on rank 1 (removed above), budgets sized to the machine on rank 0
# alone: the ranks still meet in the same collectives, and the missing path is what is said.
refused mixed4.log "rank 1 of 2: --init-from m cannot be read" "machine budgets, model missing on rank 1" \
  --config "$work/machine-device.json" --steps 2 --init-from m --run-dir "$work/mixed4"
grep -h "nvme:" r1.log r2.log r4.log | sed 's/^/NVMe per rank: /' || true
echo PASS
