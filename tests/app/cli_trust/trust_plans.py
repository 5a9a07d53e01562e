"""Plans: the files `tierzero plan` writes and other commands read back (plan files, train --plan
and report --plan; rates files, plan --rates; warm-up traces, plan --trace), edited; what plan
refuses against what train refuses; a plan's rates, device and largest model."""
import json
import os
import re
import subprocess

from trust_common import TZ, OUT, check, run, refused, ok, read, write_config, train_small, nobody_runs


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

    # The plan a resumed run's config records, made for another config than the resume's (a
    # budget changed): said and left out, not refused for a --plan this command never gave (hunt
    # 51).
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "5", "--host-budget", "40MiB",
              "--quiet"])
    check("was made for another config (engine.host_budget" in out,
          f"a recorded plan of another config:\n{out}")
    # ... or that cannot be read now (review 51).
    kept = read(plan)
    with open(plan, "w") as f:
        f.write("not json")
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "6", "--quiet"])
    check("cannot be read now" in out, f"a recorded plan unreadable:\n{out}")
    with open(plan, "wb") as f:
        f.write(kept)
    # The plan a resumed run's config records, removed since: the run goes on without it.
    os.rename(plan, plan + ".moved")
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "7", "--quiet"])
    check("the report leaves the prediction out" in out, f"a recorded plan gone:\n{out}")
    # One named by --plan is this command's own, and refused.
    refused(["train", "--resume", rd + "/checkpoint", "--steps", "9", "--plan", plan, "--quiet"],
            "cannot open plan file")
    # `--plan none` leaves the recorded one out, unsaid (it was a file name: hunt 51).
    os.rename(plan + ".moved", plan)
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "8", "--host-budget", "40MiB",
              "--plan", "none", "--quiet"])
    check("prediction" not in out, f"--plan none:\n{out}")

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


def case_plan_refuses_as_train():
    """A run train refuses at set-up has no plan (Note [What the plan of a run train refuses
    says]; hunt 48: each planned, exit 0): a --profile-step that profiles nothing, an NVMe path
    that is a file, a model directory's weights file alone; an --init-from not here is said."""
    cfg = os.path.join(OUT, "small.json")
    env = dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, "pr_rates.json"))
    afile = os.path.join(OUT, "pr_file")
    with open(afile, "w") as f:
        f.write("mine")
    for args, says in ((["--profile-step", "1"], "warm-up iteration"),
                       (["--nvme-path", afile, "--nvme-budget", "64MiB"], "not a directory")):
        refused(["plan", "--config", cfg, "--no-advice"] + args, says)
        refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "pr_run"),
                 "--steps", "2"] + args)
    check(read(afile) == b"mine", "the NVMe path's file was changed")
    rc, out = run(["plan", "--config", cfg, "--no-advice", "--init-from",
                   os.path.join(OUT, "pr_nothing")], env=env)
    check(rc == 0 and "--init-from" in out and "is not here" in out,
          f"a plan of an --init-from that is not here said nothing:\n{out}")
    # A model directory's weights file alone (its tensors named as transformers names them).
    hf = os.path.join(OUT, "pr_hf")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "pr_src"), "--steps", "1"])
    ok(["export", os.path.join(OUT, "pr_src", "checkpoint"), "--format", "hf", "-o", hf])
    weights = os.path.join(hf, "model.safetensors")
    for cmd in (["plan", "--no-advice"],
                ["train", "--run-dir", os.path.join(OUT, "pr_run2"), "--steps", "1"]):
        refused(cmd + ["--config", cfg, "--init-from", weights], "give the directory (--init-from")


def case_plan_device():
    """The plan's rates come from the device the run computes on (Note [Calibrated on the device
    that runs]): a cached GPU's rates are not used for a run on the simulated device, and a plan
    of a cuda run either calibrates on this machine's GPU or is refused without one."""
    cfg = os.path.join(OUT, "small.json")
    rates = os.path.join(OUT, "g_rates.json")
    gpu = {"name": "this machine's GPU (calibrated)", "cpu_adam_params_per_s": 1e9,
           "device_adam_params_per_s": 5e10,
           "h2d_bytes_per_s": 2.5e10, "d2h_bytes_per_s": 2.5e10, "nvme_read_bytes_per_s": 6e9,
           "nvme_write_bytes_per_s": 4e9, "device_shares_cpu": False}
    with open(rates, "w") as f:
        json.dump(gpu, f)
    env = dict(os.environ, TZ_RATES_FILE=rates)
    rc, out = run(["plan", "--config", cfg, "--device", "host", "--no-advice"], env=env)
    check(rc == 0, f"plan: exit status {rc}\n{out}")
    check("calibrating this machine's rates on its simulated device" in out and
          "rates: this machine (calibrated)" in out,
          f"a GPU's cached rates planned a run on the simulated device:\n{out}")
    # The GPU's cache is kept (Note [A rates cache is written over only when it is one]) ...
    check(json.load(open(rates))["device_shares_cpu"] is False and
          "not cached" in out and "holds the rates of this machine's GPU" in out,
          f"the GPU's cache was written over:\n{out}")
    # ... a file of its own caches the simulated device's, and the next plan uses them.
    env = dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, "g_rates_host.json"))
    ok(["plan", "--config", cfg, "--device", "host", "--no-advice"], env=env)
    rc, out = run(["plan", "--config", cfg, "--device", "host", "--no-advice"], env=env)
    check(rc == 0 and "calibrating" not in out, f"the simulated device's cache not used:\n{out}")
    # A hand-written rates file given with --calibrate is an input, never written over.
    hand = os.path.join(OUT, "g_hand.json")
    with open(hand, "w") as f:
        json.dump(dict(gpu, name="H100 node"), f)
    before = read(hand)
    out = ok(["plan", "--config", cfg, "--device", "host", "--no-advice", "--rates", hand,
              "--calibrate"])
    check(read(hand) == before and "not written by a calibration" in out,
          f"a hand-written rates file was written over:\n{out}")
    env = dict(os.environ, TZ_RATES_FILE=rates)
    rc, out = run(["plan", "--config", cfg, "--device", "cuda", "--no-advice"], env=env)
    if rc == 0:
        check("rates: this machine's GPU (calibrated)" in out, f"a cuda plan's rates:\n{out}")
    else:
        refused(["plan", "--config", cfg, "--device", "cuda", "--no-advice"], "no usable GPU")
    # A trace plans the model it recorded (Note [A trace plans its own model]): a flag that
    # shapes the built-in GPT would be ignored, so it is refused; a config's model is noted.
    run_dir = os.path.join(OUT, "g_traced")
    train_small(run_dir, steps=2)
    trace = os.path.join(run_dir, "warmup_trace.json")
    env = dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, "g_rates_host.json"))
    for flag in (["--layers", "40"], ["--batch-size", "64"], ["--seq-len", "4"], ["--largest"]):
        refused(["plan", "--trace", trace] + flag, "--trace")
    out = ok(["plan", "--trace", trace, "--config", cfg, "--no-advice"], env=env)
    check("the config's model section" in out and "compute is not in it" not in out,
          f"a trace plan with a config:\n{out}")
    # A placement failure's message is printed whole, however long.
    rc, out = run(["plan", "--trace", trace, "--device-budget", "1MiB", "--host-budget", "1MiB",
                   "--nvme-budget", "0", "--no-advice"], env=env)
    check(rc == 0 and re.search(r"use more ranks; its shards and states fit with .*MiB\n", out),
          f"a plan's failure, cut:\n{out}")
    # A --rates FILE is written whatever HOME is.
    mine = os.path.join(OUT, "g_mine_rates.json")
    env = dict(os.environ, HOME=os.path.join(OUT, "g_no_home"), XDG_CACHE_HOME="")
    env.pop("TZ_RATES_FILE", None)
    ok(["plan", "--config", cfg, "--device", "host", "--no-advice", "--rates", mine,
        "--calibrate"], env=env, timeout=300)
    check(os.path.exists(mine), "plan --rates FILE --calibrate did not write FILE")
    # Three plans calibrating at once in one directory leave nothing there: a plan makes no
    # directory of its run's (the one that made runs/default found the others' calibrations in
    # it, and an empty runs/default was left: hunt 51).
    together = os.path.join(OUT, "g_together")
    os.makedirs(together, exist_ok=True)
    procs = [subprocess.Popen([TZ, "plan", "--no-advice", "--calibrate"], cwd=together,
                              env=dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, f"g_t{i}.json")),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(3)]
    codes = [p.wait(timeout=300) for p in procs]
    check(codes == [0, 0, 0] and os.listdir(together) == [],
          f"three plans at once: exit {codes}, left {os.listdir(together)}")
    # A home that does not exist gets no cache made in it.
    missing = os.path.join(OUT, "g_no_home")
    env = dict(os.environ, HOME=missing, XDG_CACHE_HOME="")
    env.pop("TZ_RATES_FILE", None)
    out = ok(["plan", "--config", cfg, "--device", "host", "--no-advice"], env=env, timeout=300)
    check(not os.path.exists(missing) and "not cached" in out,
          f"a plan made a cache in a home that does not exist:\n{out}")
    # A plan made where nothing may be written (a read-only working directory) calibrates under
    # $TMPDIR, and says so, instead of failing on its run directory (as `nobody`: root writes
    # anywhere).
    if nobody_runs("plan_device"):
        ro = os.path.join(OUT, "g_read_only")
        os.makedirs(ro, exist_ok=True)
        os.chmod(ro, 0o555)
        os.chmod(OUT, 0o755)
        tmp = os.path.join(OUT, "g_tmp")
        os.makedirs(tmp, exist_ok=True)
        os.chmod(tmp, 0o777)
        home = os.path.join(OUT, "g_ro_home")
        os.makedirs(home, exist_ok=True)
        os.chmod(home, 0o777)
        env = dict(os.environ, HOME=home, XDG_CACHE_HOME="", TMPDIR=tmp)
        env.pop("TZ_RATES_FILE", None)

        def as_nobody():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        rc, out = run(["plan", "--no-advice"], env=env, cwd=ro, timeout=300,
                      preexec_fn=as_nobody)
        check(rc == 0 and "the calibration runs under " + tmp in out,
              f"a plan in a read-only directory: exit status {rc}\n{out}")
        check(os.listdir(tmp) == [] and os.listdir(ro) == [],
              f"a plan in a read-only directory left {os.listdir(tmp)} {os.listdir(ro)}")
        # Rates measured away from the run's disk are not cached for later plans.
        check("measured away from the run's disk" in out and os.listdir(home) == [],
              f"rates measured under $TMPDIR were cached: {os.listdir(home)}\n{out}")


def case_plan_of_another_config():
    # `train --plan` compares the plan's predictions with what the run measures: a plan of
    # another config (other budgets, batch) was accepted and its numbers shown as the engine's
    # errors. It is refused before the run, naming the fields; the plan's own config runs.
    cfg = os.path.join(OUT, "small.json")
    plan = os.path.join(OUT, "pa_plan.json")
    ok(["plan", "--config", cfg, "--json", plan, "--no-advice"])
    rd = os.path.join(OUT, "pa_run")
    refused(["train", "--config", cfg, "--plan", plan, "--run-dir", rd, "--batch-size", "3",
             "--quiet"], "train.batch_size", "another config")
    check(not os.path.exists(rd), "a refused run left its directory")
    # One model written two ways is the plan's (n_kv_head 2 of 2 heads, and 0): review 46.
    llama = ["--arch", "llama", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "2"]
    lplan = os.path.join(OUT, "pa_llama.json")
    ok(["plan"] + llama + ["--kv-heads", "2", "--json", lplan, "--no-advice"])
    ok(["train"] + llama + ["--plan", lplan, "--run-dir", os.path.join(OUT, "pa_llama"),
                            "--quiet"])
    refused(["train"] + llama + ["--kv-heads", "1", "--plan", lplan, "--run-dir",
                                 os.path.join(OUT, "pa_llama1"), "--quiet"], "model.n_kv_head")
    # A plan edited to hold a number out of a report's range is refused at set-up, naming it,
    # where the run trained, then could not write its report (nor `report` read it after).
    with open(plan) as f:
        edited = json.load(f)
    edited["prediction"]["memory"]["device"]["budget"] = 1e300
    bad_plan = os.path.join(OUT, "pa_bad_plan.json")
    with open(bad_plan, "w") as f:
        json.dump(edited, f)
    refused(["train", "--config", cfg, "--plan", bad_plan, "--run-dir", rd, "--quiet"],
            "the plan: prediction: memory.device.budget")
    check(not os.path.exists(rd), "a run refused for its plan left its directory")
    # --json --overwrite never names what the plan reads: its text, its token files (hunt 46).
    text = os.path.join(OUT, "pa_text.txt")
    with open(text, "w") as f:
        f.write("the quick brown fox\n" * 2000)
    refused(["plan", "--layers", "1", "--width", "32", "--heads", "2", "--text", text, "--json",
             text, "--overwrite", "--no-advice"], "the text (--text) this command reads")
    check(read(text) == b"the quick brown fox\n" * 2000, "plan --json replaced its --text")
    # A plan nested 500000 deep under a config field overflowed the stack (SIGSEGV, hunt 45).
    deep = os.path.join(OUT, "pa_deep.json")
    with open(deep, "w") as f:
        f.write('{"config":{"model":{"activation_checkpointing":' + "[" * 500000 + "]" * 500000 +
                '}},"prediction":{}}')
    refused(["train", "--config", cfg, "--plan", deep, "--run-dir", rd, "--quiet"],
            "deeper than 64 levels")
    check(not os.path.exists(rd), "a refused run left its directory")
    ok(["train", "--config", cfg, "--plan", plan, "--run-dir", rd, "--steps", "2", "--quiet"])
    report = json.load(open(os.path.join(rd, "report.json")))
    check("prediction" in report, "the run's report has no prediction beside it")
    # `report --plan` refuses a plan of another config too (Note [A plan of another run]): one
    # of another batch or budget had been compared as this run's prediction (hunt 46).
    rj = os.path.join(rd, "report.json")
    ok(["report", rj, "--plan", plan])
    for flags, field in ((["--batch-size", "3"], "train.batch_size"),
                         (["--host-budget", "64MiB"], "engine.host_budget"),
                         (["--optimizer-states", "int8"], "engine.optimizer_states")):
        other = os.path.join(OUT, "pa_other_plan.json")
        ok(["plan", "--config", cfg, "--json", other, "--no-advice", "--overwrite"] + flags)
        refused(["report", rj, "--plan", other], field, "another config")
    # A plan of a recorded trace records the engine's settings it was made with: `train --plan`
    # refuses one of other budgets (it was taken, its placement shown as this run's).
    tplan = os.path.join(OUT, "pa_trace_plan.json")
    ok(["plan", "--config", cfg, "--trace", os.path.join(rd, "warmup_trace.json"), "--json",
        tplan, "--host-budget", "64MiB"])
    refused(["train", "--config", cfg, "--plan", tplan, "--run-dir", rd + "_t", "--quiet"],
            "engine.host_budget", "another config")
    refused(["report", rj, "--plan", tplan], "engine.host_budget")
    # A plan nested 500000 deep: refused by report too, not a SIGSEGV (review 47).
    refused(["report", rj, "--plan", deep], "deeper than 64 levels")
    # ZeRO++ asked of one rank runs off: the report says so, and the plan of that config is
    # the run's (it was refused as of another).
    zcfg = write_config(os.path.join(OUT, "pa_zeropp.json"), zeropp={"qwz": True})
    zplan = os.path.join(OUT, "pa_zeropp_plan.json")
    ok(["plan", "--config", zcfg, "--json", zplan, "--no-advice"])
    ok(["train", "--config", zcfg, "--plan", zplan, "--run-dir", rd + "_z", "--steps", "2",
        "--quiet"])
    ok(["report", os.path.join(rd + "_z", "report.json"), "--plan", zplan])
    check(not os.path.exists(rd + "_t"), "a run refused for its plan left its directory")
    # An older tierzero's plan records no config: refused, not checked by its layout alone.
    older = json.load(open(plan))
    older.pop("config")
    older_path = os.path.join(OUT, "pa_older_plan.json")
    with open(older_path, "w") as f:
        json.dump(older, f)
    rd2 = os.path.join(OUT, "pa_run2")
    refused(["train", "--config", cfg, "--plan", older_path, "--run-dir", rd2, "--batch-size",
             "3", "--quiet"], "records no config", "make it again")
    check(not os.path.exists(rd2), "a refused run left its directory")
    # A run whose data train would refuse is not planned as fitting either; data not on this
    # machine is said, and the plan made (a run is often planned elsewhere).
    refused(["plan", "--config", cfg, "--seq-len", "6"], "needs rows of 9 tokens")
    rc, out = run(["plan", "--config", cfg, "--text", os.path.join(OUT, "pa_missing.txt")])
    check(rc == 0 and "the run's data is not here" in out and "pa_missing.txt" in out,
          f"a plan of data that is elsewhere:\n{out}")


def case_plan_largest_times():
    # plan --largest's answer is timed for its own shape: its step was the config's blocks (5 x
    # 192) times its layers, 2.6x under the same model planned alone (figures hunt 47). Both
    # time blocks on this machine, so they agree to its noise, not to a factor.
    budgets = ["--batch-size", "4", "--seq-len", "64", "--device-budget", "64MiB",
               "--host-budget", "256MiB", "--nvme-budget", "1GiB"]
    out = ok(["plan", "--largest"] + budgets, timeout=300)
    m = re.search(r"GPT-2 (\d+) layers x (\d+) wide, (\d+) heads", out)
    check(m is not None, f"no largest model:\n{out}")
    steps = re.findall(r"^step ([0-9.]+) ms = compute ([0-9.]+) ms", out, re.M)
    alone = ok(["plan", "--layers", m.group(1), "--width", m.group(2), "--heads", m.group(3),
                "--no-advice"] + budgets, timeout=300)
    want = re.findall(r"^step ([0-9.]+) ms = compute ([0-9.]+) ms", alone, re.M)
    got_c, want_c = float(steps[-1][1]), float(want[-1][1])
    check(0.5 < got_c / want_c < 2.0,
          f"--largest's compute {got_c} ms, the same model planned alone {want_c} ms")


def case_plan_device_states():
    """8-bit moments kept on the device: one allocation the device rounds to its alignment, which
    the plan's device peak counts (it was 128 bytes under the run's: hunt 51); host and NVMe
    exact as ever."""
    d = os.path.join(OUT, "pds")
    os.makedirs(d)
    cfg = os.path.join(d, "cfg.json")
    with open(cfg, "w") as f:
        json.dump({"engine": {"optimizer_states": "int8", "device_shard_budget": "8 MiB"}}, f)
    plan = os.path.join(d, "plan.json")
    ok(["plan", "--config", cfg, "--steps", "3", "--run-dir", os.path.join(d, "run"), "--json",
        plan])
    ok(["train", "--config", cfg, "--steps", "3", "--run-dir", os.path.join(d, "run"), "--plan",
        plan, "--quiet"])
    with open(os.path.join(d, "run", "report.json")) as f:
        rows = {r["what"]: r for r in json.load(f)["prediction"]["compared"]}
    for what in ("device peak", "host"):
        check(rows[what]["predicted"] == rows[what]["measured"],
              f"{what}: predicted {rows[what]['predicted']}, measured {rows[what]['measured']}")
