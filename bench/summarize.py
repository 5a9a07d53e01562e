#!/usr/bin/env python3
"""Prints the median rows of a Google Benchmark JSON file with their user counters."""
import json
import sys

SKIP = {"name", "run_name", "run_type", "repetitions", "repetition_index", "threads",
        "iterations", "real_time", "cpu_time", "time_unit", "family_index",
        "per_family_instance_index", "aggregate_name", "aggregate_unit", "bytes_per_second"}


def main(path):
    with open(path) as f:
        data = json.load(f)
    ctx = data["context"]
    print(f"# {ctx.get('host_name')} cpus={ctx.get('num_cpus')} date={ctx.get('date')}")
    rows = [b for b in data["benchmarks"]
            if b.get("aggregate_name", "median") == "median" and b.get("run_type") != "iteration"
            or "aggregate_name" not in b]
    for b in rows:
        counters = " ".join(f"{k}={v:.3g}" for k, v in b.items()
                            if k not in SKIP and isinstance(v, (int, float)))
        print(f"{b.get('run_name', b['name']):<52} {counters}")


if __name__ == "__main__":
    main(sys.argv[1])
