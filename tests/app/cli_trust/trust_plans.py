"""The files `tierzero plan` writes and other commands read back: plan files (train --plan,
report --plan), rates files (plan --rates) and warm-up traces (plan --trace), edited."""
import json
import os

from trust_common import OUT, check, refused, ok, read


def case_plan_files():
    # Hunt 49: what a plan, a rates file or a trace may hold is checked where it is read, before
    # a run trains; each refusal names the file and the field, and says how to make it again.
    d = os.path.join(OUT, "pf")
    os.makedirs(d)
    run_json = os.path.join(d, "run.json")
    with open(run_json, "w") as f:
        json.dump({"model": {"n_layer": 2, "d_model": 64, "n_head": 4}, "data": {"digits": 1},
                   "train": {"steps": 4, "batch_size": 8, "eval_every": 0},
                   "engine": {"device_budget": "2 MiB", "host_budget": "6 MiB",
                              "nvme_budget": "64 MiB", "optimizer": "cpu"}}, f)
    rates = os.path.join(d, "rates.json")
    with open(rates, "w") as f:
        json.dump({"name": "r", "cpu_adam_params_per_s": 1e9, "h2d_bytes_per_s": 1e10,
                   "d2h_bytes_per_s": 1e10, "device_shares_cpu": True}, f)
    plan = os.path.join(d, "plan.json")
    ok(["plan", "--config", run_json, "--run-dir", os.path.join(d, "run"), "--rates", rates,
        "--no-advice", "--json", plan])
    good = json.loads(read(plan))

    def edited(name, edit):
        p = json.loads(json.dumps(good))
        edit(p)
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(p, f)
        return path

    def refused_before_training(path, *needles):
        rd = os.path.join(d, "r_" + os.path.basename(path))
        refused(["train", "--config", run_json, "--run-dir", rd, "--plan", path, "--quiet"],
                *needles)
        check(not os.path.exists(rd), f"{path}: a refused plan left a run directory")

    # A figure only a profiled iteration compares: refused at set-up, not after the run (whose
    # report was then lost).
    refused_before_training(
        edited("no_h2d.json", lambda p: p["prediction"]["bytes_per_step"]["iteration"].pop("h2d")),
        "bytes_per_step.iteration.h2d is missing")

    # Nested as deep as outside JSON may be: the report, which holds the plan two levels down,
    # could not be read again.
    def deep(p):
        v = []
        for _ in range(61):
            v = [v]
        p["prediction"]["x"] = v
    refused_before_training(edited("deep.json", deep), "deeper than 62 levels")
    # A config that is not one, the prediction alone, a "trace" added: each skipped the check that
    # the plan is of this run.
    refused_before_training(edited("cfg_null.json", lambda p: p.update(config=None)),
                            "the plan's config is null", "make it again")
    bare = os.path.join(d, "bare.json")
    with open(bare, "w") as f:
        json.dump(good["prediction"], f)
    refused_before_training(bare, "records no config")
    b2 = os.path.join(d, "b2.json")
    ok(["plan", "--config", run_json, "--run-dir", os.path.join(d, "run"), "--rates", rates,
        "--no-advice", "--batch-size", "2", "--json", b2])
    b2_plan = json.loads(read(b2))
    b2_plan["trace"] = ""
    b2_trace = os.path.join(d, "b2_trace.json")
    with open(b2_trace, "w") as f:
        json.dump(b2_plan, f)
    refused_before_training(b2_trace, "train.batch_size 2 in the plan")
    # Counts are whole; a plan whose schema was removed is said to be so.
    refused_before_training(
        edited("half.json", lambda p: p["prediction"]["optimizer"].update(cpu=6.5)),
        "optimizer.cpu must be a whole count")
    refused_before_training(edited("noschema.json", lambda p: p.pop("schema")), "has no schema")

    # report --plan: a plan it cannot check (no config, or no train section) is refused, as
    # train --plan refuses it; a plan of batch 2 was shown beside the batch-8 run.
    rd = os.path.join(d, "run")
    ok(["train", "--config", run_json, "--run-dir", rd, "--plan", plan, "--quiet"])
    report = os.path.join(rd, "report.json")
    b2_plan = json.loads(read(b2))
    for name, edit, needle in (("b2_nocfg.json", lambda p: p.pop("config"), "records no config"),
                               ("b2_notrain.json", lambda p: p["config"].pop("train"),
                                "train.batch_size null in the plan")):
        edit(b2_plan)
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(b2_plan, f)
        refused(["report", report, "--plan", path], needle)
        b2_plan = json.loads(read(b2))

    # The plan a resumed run's config records, removed since: the run goes on without it.
    os.rename(plan, plan + ".moved")
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "6", "--quiet"])
    check("the report leaves the prediction out" in out, f"a recorded plan gone:\n{out}")
    # One named by --plan is this command's own, and refused.
    refused(["train", "--resume", rd + "/checkpoint", "--steps", "8", "--plan", plan, "--quiet"],
            "cannot open plan file")

    # A warm-up trace edited into what the engine refuses: named by file and field.
    trace = json.loads(read(os.path.join(rd, "warmup_trace.json")))
    for edit, needle in ((lambda t: t["params"][1].update(name=t["params"][0]["name"]),
                          "params[1] names"),
                         (lambda t: t["params"][0].update(shape=[]),
                          "params[0] has an empty shape"),
                         (lambda t: t["params"][0].update(shape=[2 ** 31, 2 ** 31]),
                          "more than 2^40 elements"),
                         (lambda t: t["params"][1].update(name=""), "params[1] has an empty name"),
                         (lambda t: t["moments"][0].update(params=[0, 0]),
                          "moments[0].params[1] names parameter 0 again")):
        t = json.loads(json.dumps(trace))
        edit(t)
        path = os.path.join(d, "trace_bad.json")
        with open(path, "w") as f:
            json.dump(t, f)
        refused(["plan", "--rates", rates, "--trace", path, "--no-advice"],
                "trace_bad.json: ", needle, "records it again")

    # A rates name that would drive the terminal.
    with open(rates, "w") as f:
        json.dump({"name": "a\u001b[31mRED", "cpu_adam_params_per_s": 1e9,
                   "h2d_bytes_per_s": 1e10, "d2h_bytes_per_s": 1e10}, f)
    refused(["plan", "--config", run_json, "--rates", rates, "--no-advice"],
            "name holds a control character")


def case_plan_advice():
    # Hunt 49: plan's advice of a smaller batch or sequence was never given (its search changed
    # a copy of the config), and an NVMe budget of 1 MiB "holding the rest" was advised where
    # none is needed. Each change advised is planned again here: it fits.
    d = os.path.join(OUT, "pa")
    os.makedirs(d)
    rates = os.path.join(d, "rates.json")
    with open(rates, "w") as f:
        json.dump({"name": "r", "cpu_adam_params_per_s": 1e9, "h2d_bytes_per_s": 1e10,
                   "d2h_bytes_per_s": 1e10, "device_shares_cpu": True}, f)

    def plan(*args):
        path = os.path.join(d, "p.json")
        ok(["plan", "--rates", rates, "--json", path, "--overwrite", *args])
        return json.loads(read(path))

    flags = {"train.batch_size": "--batch-size", "model.seq_len": "--seq-len",
             "engine.device_budget": "--device-budget"}
    text = os.path.join(d, "t.txt")
    with open(text, "w") as f:
        f.write("words to learn from, over and over. " * 300)
    for args, want, never in ((["--batch-size", "64"], "train.batch_size", "model.seq_len"),
                              (["--text", text, "--seq-len", "256", "--batch-size", "8"],
                               "model.seq_len", None)):
        p = plan(*args)
        check(not p["prediction"]["fits"], f"{args}: expected not to fit")
        advised = {a["field"]: a["value"] for a in p["advice"]}
        check(want in advised, f"{args}: no {want} advised: {sorted(advised)}")
        check(never is None or never not in advised,
              f"{args}: {never} advised for the addition task, whose rows are fixed")
        for field, value in advised.items():
            if field not in flags:
                continue
            again = list(args)
            flag = flags[field]
            shown = f"{value // (1 << 20)}MiB" if field.startswith("engine.") else str(value)
            if flag in again:
                again[again.index(flag) + 1] = shown
            else:
                again += [flag, shown]
            check(plan(*again)["prediction"]["fits"], f"{again}: the advised change does not fit")
    p = plan("--batch-size", "256", "--nvme-budget", "0", "--host-budget", "64MiB")
    nvme = [a for a in p["advice"] if "nvme_budget" in a["field"]]
    check(not nvme, f"an NVMe budget advised where the plan needs none: {nvme}")


def case_plan_limits():
    # Hunt 49: under `ulimit -v` plan said a run fit that train then refused for the address space
    # it maps; plan now says so on a "but:" line, with train's own figure.
    import resource
    import subprocess
    from trust_common import TZ

    # (A sanitizer's runtime reserves terabytes of address space before main: under ASan this
    # cannot run, as in address_space_limit.)
    libs = subprocess.run(["ldd", TZ], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
    if b"libasan" in libs or b"libtsan" in libs:
        print("      (plan_limits: a sanitizer's build: skipped)")
        return

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (1500000 * 1024, 1500000 * 1024))  # as ulimit -v

    shape = ["--host-budget", "900MiB", "--nvme-budget", "0", "--width", "768", "--heads", "12",
             "--layers", "6", "--device-budget", "300MiB"]
    rates = os.path.join(OUT, "pl_rates.json")
    with open(rates, "w") as f:
        json.dump({"name": "r", "cpu_adam_params_per_s": 1e9, "h2d_bytes_per_s": 1e10,
                   "d2h_bytes_per_s": 1e10, "device_shares_cpu": True}, f)
    p = subprocess.run([TZ, "plan", *shape, "--rates", rates, "--no-advice"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limited,
                       timeout=120, cwd=OUT)
    out = p.stdout.decode(errors="replace")
    check(p.returncode == 0 and "but: the run maps at least 1.65 GiB" in out, f"plan:\n{out}")
    p = subprocess.run([TZ, "train", *shape, "--steps", "1", "--run-dir",
                        os.path.join(OUT, "pl_run")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limited,
                       timeout=120, cwd=OUT)
    out = p.stdout.decode(errors="replace")
    check(p.returncode == 1 and "this run maps at least 1.65 GiB" in out, f"train:\n{out}")


def case_device_fit_early():
    # Hunt 49: a device budget too small for the model's activations was found at the first
    # training iteration, after the step-0 evaluation and a warm-up iteration, with the words
    # plan says at once. Train plans its own run at set-up and refuses it before evaluating; a
    # budget short only of the room a plan keeps against fragmentation still trains.
    rd = os.path.join(OUT, "dfe_run")
    out = refused(["train", "--batch-size", "256", "--device-budget", "51MiB", "--steps", "2",
                   "--run-dir", rd], "needs 4 gathered chunks", "predicted at set-up")
    check("eval  step" not in out and not os.path.exists(rd),
          f"refused after its evaluation, or left its run directory:\n{out}")
    ok(["train", "--batch-size", "256", "--device-budget", "52MiB", "--steps", "1",
        "--eval-every", "0", "--run-dir", os.path.join(OUT, "dfe_ok"), "--quiet"], timeout=300)
