#!/usr/bin/env python3
"""`tierzero plan` against the runs it predicts (issue: memory within 5%, step time within 15%).

For each configuration: `tierzero plan --json`, then `tierzero train` with the same config, and
the predicted per-tier peaks and step time next to the measured ones (the report's tiers; the
median step_s of the metrics after the first planned steps). Prints one table; writes
OUT/plan_check.json. Plans of several ranks use the communicator's rates, measured first
(`mpirun -np 2 tierzero plan --calibrate`).

usage: bench/plan_check.py [--bin build/bin/tierzero] [--out DIR] [--steps N] [--only NAME]
"""
import argparse, json, os, statistics, subprocess, sys

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}

# name, ranks, config (over the built-in default: GPT 5 x 192, batch 32 x 9, bf16).
CONFIGS = [
    ("resident", 1, {"model": {"activation_checkpointing": False},
                     "engine": {"device_budget": "64 MiB", "device_shard_budget": "64 MiB",
                                "host_budget": "256 MiB", "nvme_budget": "0 B"}}),
    ("host", 1, {"model": {"activation_checkpointing": False},
                 "engine": {"device_budget": "40 MiB", "host_budget": "256 MiB",
                            "nvme_budget": "0 B"}}),
    ("nvme", 1, {"model": {"activation_checkpointing": False},
                 "engine": {"device_budget": "40 MiB", "host_budget": "16 MiB",
                            "nvme_budget": "256 MiB"}}),
    ("2ranks", 2, {"model": {"activation_checkpointing": False},
                   "engine": {"device_budget": "40 MiB", "host_budget": "256 MiB",
                              "nvme_budget": "0 B"}}),
    ("checkpointing", 1, {"model": {"activation_checkpointing": True},
                          "engine": {"device_budget": "12 MiB", "host_budget": "16 MiB",
                                     "nvme_budget": "256 MiB"}}),
    # Separate gradient chunks held two moments past their reduction (hunt 39).
    ("accum2", 1, {"model": {"activation_checkpointing": False},
                   "engine": {"device_budget": "40 MiB", "host_budget": "256 MiB",
                              "nvme_budget": "0 B", "grad_accumulation": 2}}),
    ("llama", 1, {"model": {"arch": "llama", "n_kv_head": 2, "activation_checkpointing": False},
                  "engine": {"device_budget": "40 MiB", "host_budget": "256 MiB",
                             "nvme_budget": "0 B", "optimizer_states": "int8"}}),
]


def run(cmd, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, env=e)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/tierzero")
    ap.add_argument("--out", default="/tmp/plan_check")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    # The communicator's latency and rate (plans of several ranks use them), into the same
    # cache the plans read ($TZ_RATES_FILE or the user's cache).
    if any(r > 1 for n, r, _ in CONFIGS if not a.only or n == a.only):
        print(run(MPIRUN + [a.bin, "plan", "--calibrate"], MPI_ENV).strip(), flush=True)
    rows = []
    for name, ranks, over in CONFIGS:
        if a.only and name != a.only:
            continue
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        cfg = os.path.join(d, "config.json")
        over = json.loads(json.dumps(over))
        over.setdefault("train", {}).update({"steps": a.steps, "eval_every": 0})
        with open(cfg, "w") as f:
            json.dump(over, f)
        common = ["--config", cfg, "--run-dir", os.path.join(d, "run")]
        run([a.bin, "plan", *common, "--ranks", str(ranks), "--no-advice",
             "--json", os.path.join(d, "plan.json")])
        train = [a.bin, "train", *common, "--quiet", "--html", "none", "--trace", "none",
                 "--plan", os.path.join(d, "plan.json")]
        run(MPIRUN + train if ranks > 1 else train, MPI_ENV if ranks > 1 else None)
        pred = json.load(open(os.path.join(d, "plan.json")))["prediction"]
        rep = json.load(open(os.path.join(d, "run", "report.json")))
        steps = [json.loads(l) for l in open(os.path.join(d, "run", "metrics.jsonl"))]
        step_s = [m["step_s"] for m in steps if "step_s" in m][5:]
        t = rep["tiers"]
        meas = {"device": t["device"]["peak"], "host": t["host"]["used"],
                "nvme": t["nvme"]["used"], "step_s": statistics.median(step_s)}
        pm = pred["memory"]
        predicted = {"device": pm["device"]["peak"], "host": pm["host"]["peak"],
                     "nvme": pm["nvme"]["peak"], "step_s": pred["time"]["step_s"]}
        row = {"name": name, "ranks": ranks, "predicted": predicted, "measured": meas,
               "time": pred["time"]}
        rows.append(row)
        print(f"{name:14s}", end="")
        for k in ("device", "host", "nvme", "step_s"):
            p, m = predicted[k], meas[k]
            err = (p - m) / m * 100 if m else 0.0
            unit = 1e3 if k == "step_s" else 1 / 2**20
            print(f" | {k} {p*unit:7.2f}/{m*unit:7.2f} ({err:+5.1f}%)", end="")
        print(flush=True)
    json.dump(rows, open(os.path.join(a.out, "plan_check.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
