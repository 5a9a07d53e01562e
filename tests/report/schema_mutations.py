#!/usr/bin/env python3
"""schema_mutations.py TIERZERO SCHEMA REPORT OUT_DIR

`tierzero report` checks each report against its schema before it renders (Note [A report
checked against its schema], src/profiler/json_schema.h). Here python3-jsonschema is the
independent reference:

1. Mutations of a real report (a member removed; a value made a string, null, -1, an empty
   array or object): every one jsonschema refuses, `tierzero report` refuses with an error that
   names the field (exit 1, "error:"), never a crash or a page. Ones jsonschema accepts render,
   or are refused for a reason beyond the schema (a number out of Note [A report's numbers in
   range]'s bounds), and the count of those is printed.
2. The smallest report the schema allows (every optional member removed, recursively):
   jsonschema accepts it and `tierzero report -o` writes its page (render_test.sh opens the page
   in Chromium: no console output, every chart drawn).
"""
import copy
import json
import os
import random
import subprocess
import sys

import jsonschema

tz, schema_path, report_path, out = sys.argv[1:5]
schema = json.load(open(schema_path))
report = json.load(open(report_path))
validator = jsonschema.Draft202012Validator(schema)


def resolve(s):
    while isinstance(s, dict) and "$ref" in s:
        s = schema["$defs"][s["$ref"].split("/")[-1]]
    return s


def minimal(v, s):
    """v with every member its schema does not require removed, at every depth."""
    s = resolve(s)
    if not isinstance(s, dict):
        return v
    if "oneOf" in s:
        for branch in s["oneOf"]:
            form = dict(branch, **{"$defs": schema["$defs"]})
            if jsonschema.Draft202012Validator(form).is_valid(v):
                return minimal(v, branch)
        return v
    if isinstance(v, dict):
        props = s.get("properties", {})
        keep = s.get("required", list(v) if "additionalProperties" in s else [])
        return {k: minimal(v[k], props.get(k, s.get("additionalProperties", {})))
                for k in v if k in keep}
    if isinstance(v, list) and "items" in s:
        return [minimal(x, s["items"]) for x in v]
    return v


def paths(v, at=()):
    """Every member and element path (arrays: their first and last elements only)."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield at + (k,)
            yield from paths(x, at + (k,))
    elif isinstance(v, list) and v:
        for i in sorted({0, len(v) - 1}):
            yield at + (i,)
            yield from paths(v[i], at + (i,))


def mutated(path, how):
    r = copy.deepcopy(report)
    parent = r
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if how == "remove":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    else:
        parent[last] = {"string": "x", "null": None, "negative": -1, "array": [], "object": {}}[how]
    return r


def shown(path):
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


all_paths = list(paths(report))
rng = random.Random(0)
kinds = ("remove", "string", "null", "negative", "array", "object")
cases = [(p, how) for p in all_paths for how in kinds]
if len(cases) > 600:
    cases = rng.sample(cases, 600)
refused_by_both = refused_beyond = rendered = 0
path = os.path.join(out, "mutated.json")
for p, how in cases:
    r = mutated(p, how)
    ok = validator.is_valid(r)
    json.dump(r, open(path, "w"))
    run = subprocess.run([tz, "report", path], capture_output=True, text=True, timeout=60)
    what = f"{shown(p)} ({how})"
    assert run.returncode in (0, 1), (what, run.returncode, run.stderr[-2000:])
    if run.returncode == 1:
        assert run.stderr.startswith("error: "), (what, run.stderr[-2000:])
        assert "uncaught" not in run.stderr and "terminate" not in run.stderr, (what, run.stderr)
    schema_said = "does not follow its schema" in run.stderr
    if not ok:
        assert run.returncode == 1, (what, "refused by jsonschema, rendered by tierzero",
                                     next(validator.iter_errors(r)).message)
        # Refused by the schema check, naming the field (or one above it, where a form of
        # oneOf failed), or earlier by the numbers' range, the schema's name or its version.
        named = any(str(k) in run.stderr for k in p[-2:])
        earlier = any(x in run.stderr for x in ("lie in [", "not a tierzero report",
                                                "report version", "version must be"))
        assert named and (schema_said or earlier), (what, run.stderr[-2000:])
        refused_by_both += 1
    elif run.returncode == 1:
        # Valid by the schema: never refused by the schema check (an over-strict checker would
        # refuse real reports); the numbers' range is the one other check.
        assert not schema_said and "lie in [" in run.stderr, (what, run.stderr[-2000:])
        refused_beyond += 1
    else:
        rendered += 1
print(f"mutations: {len(cases)} of {len(all_paths)} paths; {refused_by_both} refused by both, "
      f"{rendered} valid and rendered, {refused_beyond} valid but refused")
assert refused_by_both > 100 and rendered > 20, "too few mutations of each kind"

small = minimal(report, schema)
validator.validate(small)
json.dump(small, open(os.path.join(out, "minimal.json"), "w"))
removed = len(list(paths(report))) - len(list(paths(small)))
print(f"the smallest valid report: {removed} of {len(all_paths)} paths removed")
assert removed > 0
