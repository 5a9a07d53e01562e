#!/usr/bin/env bash
# render_test.sh TIERZERO SCHEMA OUT_DIR: plans a small run, trains it with --html, --trace and
#   --plan, then
#   1. validates report.json against the schema (python3-jsonschema),
#   2. checks the Chrome trace: valid JSON, every event with the fields its phase requires,
#      one named thread per stream, the report's events all present,
#   3. `tierzero report` renders the same page and prints the summary; with --plan the same
#      prediction (one of another config is refused),
#   4. opens the page in headless Chromium: a screenshot, the DOM after the script ran, no console
#      output (errors, uncaught exceptions), and every chart drawn with its marks;
#   5. schema_mutations.py: `tierzero report` refuses every mutation of the report that
#      jsonschema refuses, and the smallest report the schema allows renders a page Chromium
#      draws whole (Note [A report checked against its schema]).
# Exits 77 (skipped) when Chromium or jsonschema is missing (scripts/setup installs both).
set -euo pipefail
tz=$1 schema=$2 out=$3
rm -rf "$out" && mkdir -p "$out"
python3 -c "import jsonschema" 2>/dev/null || { echo "SKIP: python3-jsonschema missing"; exit 77; }
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "SKIP: chromium missing (scripts/setup installs it)"; exit 77; }

cat > "$out/run.json" <<JSON
{"model": {"n_layer": 3, "d_model": 64, "n_head": 4},
 "data": {"digits": 1},
 "train": {"steps": 6, "batch_size": 8, "eval_every": 0, "eval_batches": 2},
 "engine": {"device_budget": "2 MiB", "host_budget": "6 MiB", "nvme_budget": "64 MiB",
            "optimizer": "cpu"}}
JSON
# The optimizer is pinned to the CPU: the page's CPU Adam thread lanes are checked below, and
# `auto` may put every group on the (simulated) device when the rates it measures favour it.
# The run's plan (rates given: no calibration), shown beside the run's measurements.
cat > "$out/rates.json" <<JSON
{"name": "test rates", "cpu_adam_params_per_s": 1e9, "h2d_bytes_per_s": 1e10,
 "d2h_bytes_per_s": 1e10, "nvme_read_bytes_per_s": 1e9, "nvme_write_bytes_per_s": 1e9,
 "device_shares_cpu": true}
JSON
"$tz" plan --config "$out/run.json" --run-dir "$out/run" --rates "$out/rates.json" --no-advice \
  --json "$out/plan.json" > "$out/plan.log"
"$tz" train --config "$out/run.json" --quiet --run-dir "$out/run" --html "$out/report.html" \
  --trace "$out/trace.json" --plan "$out/plan.json" > "$out/train.log"
grep -q "^predicted by tierzero plan / measured:" "$out/train.log" ||
  { echo "no prediction in the train output"; cat "$out/train.log"; exit 1; }
grep -q "^worst stalls:" "$out/train.log" || { echo "no summary in the train output"; cat "$out/train.log"; exit 1; }

python3 - "$schema" "$out/run/report.json" "$out/trace.json" <<'PY'
import json, sys, jsonschema
schema, report, trace = (json.load(open(p)) for p in sys.argv[1:4])
jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)
p = report["profile"]
assert p["available"], "the run profiled no iteration"
nc = len(report["layout"]["chunks"])
chunk_bytes = report["layout"]["chunk_bytes"]
assert all(c["param_tier"] != "device" for c in report["layout"]["chunks"])
for m in p["moments"]:
    assert len(m["residency"]) == nc, m
    # Two records of the same thing: the device's chunk bytes are the gathered chunks (D), plus
    # in backward the separate gradient chunks (here: the tied embedding's, used twice forward).
    extra = m["device"]["chunk_bytes"] - m["residency"].count("D") * chunk_bytes
    assert extra >= 0 and extra % chunk_bytes == 0, m
    assert extra == 0 or m["backward"], m
    assert m["device"]["chunk_bytes"] <= m["device"]["budget"], m
tracks = {e["track"] for e in p["events"]}
assert {"compute", "H2D", "D2H", "optimizer"} <= tracks, tracks
assert any(e["lane"] > 0 for e in p["events"]), "no CPU Adam thread events"
rows = {r["what"]: r for r in report["prediction"]["compared"]}
for what in ("device peak", "host", "step", "compute per iteration", "H2D per iteration"):
    assert what in rows, (what, sorted(rows))
for what in ("device peak", "host", "H2D per iteration"):
    assert rows[what]["predicted"] == rows[what]["measured"], rows[what]
assert rows["step"]["measured"] == report["counters"]["step_seconds_median"] > 0

events = trace["traceEvents"]
assert isinstance(events, list) and events
names = {}
for e in events:
    for k in ("name", "ph", "pid", "tid"):
        assert k in e, (k, e)
    if e["ph"] == "X":
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    elif e["ph"] == "M":
        assert "args" in e, e
        if e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    else:
        raise AssertionError("unexpected phase %r" % e["ph"])
streams = {"compute", "H2D", "D2H", "NVMe read", "NVMe write", "optimizer", "comm"}
assert streams <= set(names.values()), names
threads = [n for n in names.values() if n.startswith("CPU Adam thread ")]
assert threads and len(names) == len(streams) + len(threads), names
assert sum(e["ph"] == "X" for e in events) == len(p["events"])
for e in events:
    if e["ph"] == "X":
        assert names[e["tid"]] == e["cat"] or names[e["tid"]].startswith("CPU Adam thread"), e
print("report and trace valid:", len(p["moments"]), "moments,", len(p["events"]), "events")
PY

"$tz" report "$out/run/report.json" -o "$out/report2.html" > "$out/report.log"
# The same prediction added to a report afterwards; one of another config is refused.
python3 - "$out/run/report.json" "$out/bare.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); del r["prediction"]; json.dump(r, open(sys.argv[2], "w"))
PY
"$tz" report "$out/bare.json" --plan "$out/plan.json" -o "$out/report3.html" > "$out/report3.log"
grep -q "^predicted by tierzero plan / measured:" "$out/report3.log"
"$tz" plan --config "$out/run.json" --run-dir "$out/run" --rates "$out/rates.json" --no-advice \
  --ranks 2 --json "$out/plan2.json" > /dev/null
if "$tz" report "$out/bare.json" --plan "$out/plan2.json" > "$out/report4.log" 2>&1; then
  echo "a plan of 2 ranks was shown beside a run of one"; exit 1
fi
grep -q "plan with the run's config and --ranks" "$out/report4.log"
grep -q "^memory: device peak" "$out/report.log"
cmp "$out/report.html" "$out/report2.html"

flags=(--headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking
       --enable-logging=stderr --v=0 --window-size=1280,2600)
timeout 120 "$browser" "${flags[@]}" --screenshot="$out/report.png" "file://$out/report.html" \
  2> "$out/chromium-screenshot.log" > /dev/null
timeout 120 "$browser" "${flags[@]}" --dump-dom "file://$out/report.html" \
  > "$out/dom.html" 2> "$out/chromium-dom.log"
[ -s "$out/report.png" ] || { echo "no screenshot"; exit 1; }
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
for log in ("chromium-screenshot.log", "chromium-dom.log"):
    text = open(f"{out}/{log}", errors="replace").read()
    console = [l for l in text.splitlines() if ":CONSOLE" in l]
    assert not console, "the page logged:\n" + "\n".join(console)
dom = open(f"{out}/dom.html", errors="replace").read()
charts = re.findall(r'<svg class="chart" data-chart="([^"]+)"(.*?)</svg>', dom, re.S)
expected = {"memory-device", "memory-host-nvme", "residency", "breakdown", "timeline", "links", "optimizer",
            "prediction"}
got = {name for name, _ in charts}
assert got == expected, ("charts", got)
for name, body in charts:
    marks = len(re.findall(r"<rect ", body))
    assert marks >= 3, (name, "drew", marks, "rects")
m = re.search(r'<body[^>]*data-rendered="(\d+)"', dom)
assert m and int(m.group(1)) == len(expected), "the script did not finish"
assert dom.count("<tr>") >= 4, "tables empty"
print("page rendered:", len(charts), "charts, no console output")
PY
python3 "$(dirname "$0")/schema_mutations.py" "$tz" "$schema" "$out/run/report.json" "$out"
"$tz" report "$out/minimal.json" -o "$out/minimal.html" > "$out/minimal.log"
timeout 120 "$browser" "${flags[@]}" --dump-dom "file://$out/minimal.html" \
  > "$out/minimal-dom.html" 2> "$out/chromium-minimal.log"
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
text = open(f"{out}/chromium-minimal.log", errors="replace").read()
console = [l for l in text.splitlines() if ":CONSOLE" in l]
assert not console, "the smallest valid report's page logged:\n" + "\n".join(console)
dom = open(f"{out}/minimal-dom.html", errors="replace").read()
got = set(re.findall(r'<svg class="chart" data-chart="([^"]+)"', dom))
assert got == {"memory-device", "memory-host-nvme", "residency", "breakdown", "timeline", "links",
               "optimizer"}, ("charts of the smallest report", got)
m = re.search(r'<body[^>]*data-rendered="(\d+)"', dom)
assert m and int(m.group(1)) == len(got), "the smallest report's script did not finish"
print("the smallest valid report's page rendered:", len(got), "charts, no console output")
PY

# A report of 200000 events (a many-core host's CPU Adam spans): its page's script ran out of
# stack spreading them into Math.max, a page half drawn behind exit 0; and of 3000 chunks over
# 1500 moments, whose residency map drew a cell each (the page of 7502 x 3004 never finished;
# hunt 51). (The page is the run's with that report in its data: `tierzero report` of 20 MB under
# ASan took minutes, and the page's script is what is tested.)
python3 - "$out/run/report.json" "$out/many.html" "$out/report.html" <<'PY'
import copy, json, re, sys
r = json.load(open(sys.argv[1]))
ev = r["profile"]["events"]
r["profile"]["events"] = (ev * (200000 // len(ev) + 1))[:200000]
chunks, moments = r["layout"]["chunks"], r["profile"]["moments"]
r["layout"]["chunks"] = [chunks[i % len(chunks)] for i in range(3000)]
r["profile"]["moments"] = []
for k in range(1500):
    m = copy.deepcopy(moments[k % len(moments)])
    m["residency"] = (m["residency"] * (3000 // len(m["residency"]) + 1))[:3000]
    r["profile"]["moments"].append(m)
page = open(sys.argv[3]).read()
data = json.dumps(r).replace("<", "\\u003c")  # (as the page writes it: no '<' in a script)
head = '<script type="application/json" id="report-data">'
at = page.index(head) + len(head)
open(sys.argv[2], "w").write(page[:at] + data + page[page.index("</script>", at):])
PY
timeout 300 "$browser" "${flags[@]}" --dump-dom "file://$out/many.html" \
  > "$out/many-dom.html" 2> "$out/chromium-many.log"
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
console = [l for l in open(f"{out}/chromium-many.log", errors="replace").read().splitlines()
           if ":CONSOLE" in l]
assert not console, "the page of 200000 events logged:\n" + "\n".join(console)
dom = open(f"{out}/many-dom.html", errors="replace").read()
assert re.search(r'<body[^>]*data-rendered="\d+"', dom), "the page of 200000 events did not finish"
m = re.search(r'<svg class="chart" data-chart="residency".*?</svg>', dom, re.S)
cells = m.group(0).count("<rect") if m else 0
assert 0 < cells <= 150 * 300 + 10, f"{cells} residency cells drawn for 3000 chunks x 1500 moments"
print("a page of 200000 events, 3000 chunks and 1500 moments rendered:", cells, "residency cells")
PY

png=$(python3 -c "import sys; d=open(sys.argv[1],'rb').read(); print(d[:8]==b'\x89PNG\r\n\x1a\n')" "$out/report.png")
[ "$png" = True ] || { echo "the screenshot is not a PNG"; exit 1; }
echo "ok: $out/report.png"
