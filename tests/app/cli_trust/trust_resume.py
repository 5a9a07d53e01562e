"""Resumes: exact, refused when the model differs, and honest about what changed.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import re
import shutil
import struct
import subprocess
import time

from trust_common import (TZ, OUT, check, run, refused, ok, write_config, train_small, read, losses)


def case_resume_in_place_only():
    # A checkpoint directory of the user's with files that look like ours but are not.
    mine = os.path.join(OUT, "i_mine")
    os.makedirs(mine)
    for name in ("states-important.txt", "states-0.w1.rank0.bin.bak", "notes.txt"):
        with open(os.path.join(mine, name), "w") as f:
            f.write("keep")
    train_small(os.path.join(OUT, "i_run0"), "--checkpoint", mine)
    for name in ("states-important.txt", "states-0.w1.rank0.bin.bak", "notes.txt"):
        check(read(os.path.join(mine, name)) == b"keep", f"the checkpoint save removed {name}")
    # A run whose metrics file and checkpoint directory are elsewhere: a resume in place that
    # does not name them again is told which to name, and splits nothing.
    away = os.path.join(OUT, "i_away")
    metrics, ckpt = os.path.join(OUT, "i_away.jsonl"), os.path.join(OUT, "i_away_ckpt")
    train_small(away, "--metrics", metrics, "--checkpoint", ckpt, steps=3)
    before = read(metrics)
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", away, "--resume",
             ckpt, "--checkpoint", ckpt, "--steps", "6"], "--metrics " + metrics)
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", away, "--resume",
             ckpt, "--metrics", metrics, "--steps", "6"],
            "--config " + away + "/config.json --resume " + ckpt)
    check(read(metrics) == before and not os.path.exists(os.path.join(away, "metrics.jsonl")),
          "a refused resume changed the run's metrics")
    # A new run there is refused with advice that, followed as given, continues the run.
    out = refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", away],
                  "--config " + away + "/config.json --resume " + ckpt + " continues that run")
    ok(["train", "--config", os.path.join(away, "config.json"), "--resume", ckpt, "--steps", "6",
        "--quiet"])
    check([m[0] for m in losses(metrics)] == list(range(1, 7)), "the resumed metrics are split")
    # A run directory copied with its outputs inside it resumes in place in the copy (its
    # config.json records the original's paths: those inside it follow the directory).
    for name, extra, metrics_name in (("def", [], "metrics.jsonl"),
                                      ("own", ["--metrics"], "m2.jsonl")):
        orig, copy = os.path.join(OUT, "i_orig_" + name), os.path.join(OUT, "i_copy_" + name)
        flags = extra + [os.path.join(orig, metrics_name)] if extra else []
        train_small(orig, *flags, steps=3)
        shutil.copytree(orig, copy)
        flags = extra + [os.path.join(copy, metrics_name)] if extra else []
        train_small(copy, "--resume", os.path.join(copy, "checkpoint"), *flags, steps=6)
        check([m[0] for m in losses(os.path.join(orig, metrics_name))] == [1, 2, 3] and
              [m[0] for m in losses(os.path.join(copy, metrics_name))] == list(range(1, 7)),
              f"{name}: a copied run directory's resume wrote into the original")
        if extra:
            # Not naming it again: the copy's own file is named, never the original's.
            out = refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", copy,
                           "--resume", os.path.join(copy, "checkpoint"), "--steps", "8"],
                          os.path.join(copy, metrics_name))
            check(orig not in out, f"the original's metrics were named:\n{out}")
    # Resuming in place covers the run directory's files, not a --report naming someone's file.
    run_dir = os.path.join(OUT, "i_run")
    train_small(run_dir)
    precious = os.path.join(OUT, "i_precious.json")
    with open(precious, "w") as f:
        f.write("precious")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
             "--steps", "8", "--resume", run_dir + "/checkpoint", "--report", precious],
            "i_precious.json", "--overwrite")
    check(read(precious) == b"precious", "a resumed run replaced a user's file")
    # Another run directory's checkpoint, resumed and written in place, is not this directory's.
    other = os.path.join(OUT, "i_other")
    train_small(other)
    before = read(other + "/metrics.jsonl")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", other,
             "--steps", "8", "--resume", run_dir + "/checkpoint", "--checkpoint",
             run_dir + "/checkpoint"], "--overwrite")
    check(read(other + "/metrics.jsonl") == before, "another run's metrics were changed")
    # A glob of token files is an input file by file: a metrics path naming one is refused.
    shards = os.path.join(OUT, "i_shards")
    os.makedirs(shards)
    for k in range(2):
        with open(os.path.join(shards, f"d_{k}.bin"), "wb") as f:
            f.write(b"".join(bytes([i % 200, 0]) for i in range(3000)))
    shard0 = read(os.path.join(shards, "d_0.bin"))
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
             os.path.join(OUT, "i_tok"), "--data", shards + "/d_*.bin", "--metrics",
             os.path.join(shards, "d_0.bin"), "--overwrite"], "input")
    check(read(os.path.join(shards, "d_0.bin")) == shard0, "a token file was overwritten")
    # A token file whose name has brackets is that file (not a glob matching it not): a plan
    # --json --overwrite naming it replaced it (hunt 52).
    bracketed = os.path.join(shards, "s[1].bin")
    with open(bracketed, "wb") as f:
        f.write(shard0)
    refused(["plan", "--config", os.path.join(OUT, "small.json"), "--data", bracketed,
             "--vocab", "256", "--json", bracketed, "--overwrite", "--no-advice"], "input")
    check(read(bracketed) == shard0, "a bracketed token file was overwritten by a plan")
    # Export and eval from another directory than the run's (its config records relative paths).
    elsewhere = os.path.join(OUT, "i_cwd")
    os.makedirs(elsewhere)
    rel = os.path.join(OUT, "i_rel")
    os.makedirs(rel)
    ok(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", "r", "--steps", "3",
        "--quiet"], cwd=rel)
    ok(["export", os.path.join(rel, "r/checkpoint"), "-o", os.path.join(OUT, "i_w.st")],
       cwd=elsewhere)
    ok(["eval", "--resume", os.path.join(rel, "r/checkpoint"), "--data",
        os.path.join(shards, "d_0.bin")], cwd=elsewhere)
    check(not os.listdir(elsewhere), f"export or eval left files: {os.listdir(elsewhere)}")


def case_resume_exact():
    # A run continued with more --steps decays its learning rate over the new horizon (Note [A
    # resumed run's schedule]): 10 + 10 steps equal 20 where the rate does not depend on the
    # horizon, inside the warm-up (which the configs below keep every step in). Past it, the
    # resume says how the schedule changed.
    cases = {
        # fp16 with a loss scale that overflows: the first 11 steps are skipped.
        "fp16": {"engine": {"compute_dtype": "fp16", "initial_loss_scale": 1e8},
                 "train": {"warmup_steps": 20}},
        "bf16_accumulation": {"engine": {"grad_accumulation": 2}},
        "fp32": {"engine": {"compute_dtype": "fp32"}},
    }
    for name, over in cases.items():
        cfg = write_config(os.path.join(OUT, f"e_{name}.json"), **over)
        a, b = os.path.join(OUT, f"e_{name}_a"), os.path.join(OUT, f"e_{name}_b")
        ok(["train", "--config", cfg, "--run-dir", a, "--steps", "20", "--quiet"])
        ok(["train", "--config", cfg, "--run-dir", b, "--steps", "10", "--quiet"])
        ok(["train", "--config", cfg, "--run-dir", b, "--steps", "20", "--quiet", "--resume",
            b + "/checkpoint"])
        la, lb = losses(a + "/metrics.jsonl"), losses(b + "/metrics.jsonl")
        check(la == lb, f"{name}: 10 + 10 resumed differ from 20:\n{la}\n{lb}")
        if name == "fp16":
            check(sum(1 for x in la if not x[2]) >= 5, f"fp16: too few skipped steps: {la}")
    cfg = write_config(os.path.join(OUT, "e_decay.json"), train={"warmup_steps": 0})
    rd = os.path.join(OUT, "e_decay")
    ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "3", "--quiet"])
    out = ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "6", "--quiet", "--resume",
              rd + "/checkpoint"])
    check("the learning-rate schedule changes (train.steps 3 -> 6)" in out,
          f"a resume past the warm-up with another horizon said nothing:\n{out}")


def case_resume_other_split():
    # The data continues where the checkpoint's run stopped (Note [The data continues where the
    # checkpoint's run stopped]): 6 steps accumulating 2 micro-batches, resumed accumulating 1,
    # took steps 4..6's micro-batches again (hunt 47). With a learning rate of 0 a step's loss is
    # its data's alone: the resumed steps 7..10 are an uninterrupted accumulation-1 run's steps
    # 13..16 (micro-batches 12..15), and the stream of a split kept equals its uninterrupted run.
    cfg = write_config(os.path.join(OUT, "os.json"), train={"lr": 0, "min_lr": 0})

    def train(run_dir, steps, accum, *resume):
        ok(["train", "--config", cfg, "--run-dir", run_dir, "--steps", str(steps),
            "--grad-accumulation", str(accum), "--quiet"] + list(resume))
        return {s: loss for s, loss, *_ in losses(run_dir + "/metrics.jsonl")}

    one, two, acc = (os.path.join(OUT, n) for n in ("os_one", "os_two", "os_acc"))
    l1 = train(one, 16, 1)
    train(two, 6, 2)
    l2 = train(two, 10, 1, "--resume", two + "/checkpoint")
    check([l2[s] for s in range(7, 11)] == [l1[s] for s in range(13, 17)],
          f"resumed under another split, the data did not continue:\n{l1}\n{l2}")
    # Back to accumulation 2 from step 10: its micro-batches 16.. are steps 9.. of a run
    # accumulating 2 throughout, step for step.
    la = train(acc, 12, 2)
    l2 = train(two, 12, 2, "--resume", two + "/checkpoint")
    check([l2[s] for s in (11, 12)] == [la[s] for s in (9, 10)],
          f"a second resume did not continue the data:\n{la}\n{l2}")


def case_profile_step():
    # A run's first iteration is its warm-up, which is not profiled (Note [A step the report
    # cannot profile]): --profile-step 1 (one micro-batch a step), or a step a resumed
    # checkpoint has passed, silently profiled the first planned iteration instead (hunt 47).
    cfg = write_config(os.path.join(OUT, "ps.json"))
    rd = os.path.join(OUT, "ps_run")
    refused(["train", "--config", cfg, "--run-dir", rd, "--steps", "4", "--profile-step", "1",
             "--quiet"], "warm-up iteration", "give 2..4")
    check(not os.path.exists(rd), "a refused run left its directory")
    # Accumulating two, step 1's second micro-batch is planned: it is profiled.
    out = ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "4", "--profile-step", "1",
              "--grad-accumulation", "2"])
    report = json.load(open(os.path.join(rd, "report.json")))
    check(report["profile"]["available"], f"step 1 of two micro-batches was not profiled\n{out}")
    # A resume past the step says so, and profiles its first planned iteration: its config (the
    # run's own, or the file it started from) names the step the first run profiled.
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "8", "--quiet"])
    check("train.profile_step 1 is at or before the resumed checkpoint's step 4" in out,
          f"the run's profile step passed, and nothing said:\n{out}")
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "10", "--profile-step", "3",
              "--quiet"])
    check("train.profile_step 3 is at or before the resumed checkpoint's step 8" in out,
          f"a resume past its profile step said nothing:\n{out}")
    # One step of one micro-batch profiles nothing: said, not a range of no steps.
    refused(["train", "--config", cfg, "--run-dir", rd + "1", "--steps", "1", "--profile-step",
             "1"], "profiles no iteration")


def case_resume_older_config():
    # A run's config.json of an older build records fewer fields but every one it had, the
    # addition task's among them for a text run: it is the run's, not a user's ask, and resumes
    # (review 47: the new refusal of data.digits with text data refused it). A user's config
    # asking for them is still refused.
    text = os.path.join(OUT, "oc_text.txt")
    with open(text, "w") as f:
        f.write("an older run's text, over and over. " * 300)
    rd = os.path.join(OUT, "oc_run")
    ok(["train", "--text", text, "--layers", "1", "--width", "32", "--heads", "2", "--steps", "2",
        "--run-dir", rd, "--quiet"])
    cfg = json.load(open(rd + "/config.json"))
    cfg["data"]["digits"] = 3  # (an addition run's template, given --text then)
    for section, field in (("engine", "optimizer_states"), ("model", "rope_theta"),
                           ("model", "arch"), ("model", "tie_embeddings"),
                           ("data", "token_path"), ("model", "n_kv_head")):
        cfg[section].pop(field)
    with open(rd + "/config.json", "w") as f:
        json.dump(cfg, f)
    ok(["train", "--config", rd + "/config.json", "--resume", rd + "/checkpoint", "--steps", "4",
        "--quiet"])
    user = write_config(os.path.join(OUT, "oc_user.json"), data={"digits": 3})
    refused(["train", "--config", user, "--text", text, "--run-dir", rd + "_user", "--quiet"],
            "data.digits")


def case_resume_own_config():
    # `--resume RUN_DIR/checkpoint` continues that run (the help and the refusal of a used run
    # directory say so): without --config its config is the run's config.json, so a run made
    # with shape flags and settings continues without repeating them (hunt 40: refused as a
    # model of another shape), in place, as the uninterrupted run does.
    cfg = write_config(os.path.join(OUT, "own.json"), train={"warmup_steps": 20})
    shape = ["--config", cfg, "--layers", "1", "--width", "32", "--heads", "2", "--lr", "0.002",
             "--quiet"]
    a, b = os.path.join(OUT, "own_a"), os.path.join(OUT, "own_b")
    ok(["train", *shape, "--run-dir", a, "--steps", "12"])
    ok(["train", *shape, "--run-dir", b, "--steps", "6"])
    # plan predicts the run train continues: its model, not the built-in default's (hunt 47).
    out = ok(["plan", "--resume", b + "/checkpoint", "--steps", "12", "--no-advice"])
    check("continuing with the run's config" in out and "x 32 wide" in out,
          f"plan --resume did not plan the run's model:\n{out}")
    refused(["plan", "--resume", b + "/checkpoint", "--steps", "12", "--width", "64"],
            "model.d_model 32")
    out = ok(["train", "--resume", b + "/checkpoint", "--steps", "12", "--quiet"])
    check("note: continuing with the run's config" in out,
          f"the run's own config was not said:\n{out}")
    la, lb = losses(a + "/metrics.jsonl"), losses(b + "/metrics.jsonl")
    check(la == lb, f"6 + 6 resumed with the run's config differ from 12:\n{la}\n{lb}")
    # The resumed run's config.json is a template of the run, not of its resume: a new run from
    # it starts at step 1 (it resumed b's checkpoint at step 12, hunt 47).
    fresh = os.path.join(OUT, "own_fresh")
    ok(["train", "--config", b + "/config.json", "--run-dir", fresh, "--steps", "12", "--quiet"])
    check(losses(fresh + "/metrics.jsonl") == la,
          "a new run from a resumed run's config.json did not start from step 1")
    # Only where that run is: a run directory renamed since is not re-created under its old name
    # (its config records it), and a copy into a new --run-dir keeps the flags' outputs.
    moved = os.path.join(OUT, "own_b_moved")
    os.rename(b, moved)
    rc, out = run(["train", "--resume", moved + "/checkpoint", "--steps", "14", "--quiet"])
    check("continuing with the run's config" not in out and not os.path.exists(b),
          f"a moved run's config was taken, or its old directory made again:\n{out}")
    out = ok(["train", "--config", cfg, "--layers", "1", "--width", "32", "--heads", "2", "--lr",
              "0.002", "--resume", moved + "/checkpoint", "--run-dir", os.path.join(OUT, "own_e"),
              "--steps", "14", "--quiet"])
    # A config.json beside the checkpoint that is no run's (another program's) is not taken.
    c = os.path.join(OUT, "own_c")
    ok(["train", "--run-dir", c, "--steps", "2", "--quiet"])
    with open(c + "/config.json", "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"]}\n')
    out = ok(["train", "--resume", c + "/checkpoint", "--run-dir", os.path.join(OUT, "own_d"),
              "--steps", "3", "--quiet"])
    check("continuing with the run's config" not in out, f"another program's config taken:\n{out}")
    # The run's own config.json edited or cut short: said, naming it, and nothing trained (it was
    # passed over: the resume trained on the built-in defaults into runs/default; hunt 49).
    e = os.path.join(OUT, "own_edited")
    ok(["train", "--config", cfg, "--run-dir", e, "--steps", "2", "--quiet"])
    text = read(e + "/config.json").decode()
    before = sorted(os.listdir(OUT))
    for broken, needle in ((text.replace('"steps": 2', '"steps": "2"'), "'train.steps'"),
                           (text[:len(text) // 2], "is not JSON"), ("", "is not JSON"),
                           (json.dumps({"model": {}, "train": {}}), "has no data section")):
        with open(e + "/config.json", "w") as f:
            f.write(broken)
        refused(["train", "--resume", e + "/checkpoint", "--steps", "4", "--quiet"],
                e + "/config.json", needle, "--config FILE")
        check(sorted(os.listdir(OUT)) == before and len(losses(e + "/metrics.jsonl")) == 2,
              "a resume past its broken config trained")


def case_resume_model():
    run_dir = os.path.join(OUT, "m_run")
    train_small(run_dir)
    manifest = read(run_dir + "/checkpoint/manifest.json")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
             "--steps", "8", "--resume", run_dir + "/checkpoint", "--heads", "2"], "n_head",
            "--heads")
    # Another width names the width, not the FFN width that computes from it (review 47: it
    # named "d_ff 0 (256 as it computes)", 0 on both sides).
    out = refused(["train", "--resume", run_dir + "/checkpoint", "--steps", "8", "--width",
                   "128"], "model.d_model 64", "--width")
    check("d_ff" not in out, f"another width was said of d_ff:\n{out}")
    check(read(run_dir + "/checkpoint/manifest.json") == manifest, "the checkpoint changed")


def case_checkpoint_model():
    # A checkpoint records its model: eval and export of one saved outside its run directory
    # (--checkpoint PATH), with no config.json beside it, need no --config (they asked for a
    # config.json that is not there). train does not take it: the run's data, schedule and batch
    # would be the built-in defaults' (review 44: a moved run trained the addition task and saved
    # over its checkpoint), so it is refused, naming the config.
    d = os.path.join(OUT, "cm")
    os.makedirs(d)
    tok = os.path.join(d, "tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<30000H", *[(i * 7) % 50 for i in range(30000)]))
    common = ["--data", tok, "--vocab", "64", "--batch-size", "4", "--lr", "0.002", "--quiet"]
    shape = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16", "--dtype", "fp32"]
    half, ck = os.path.join(d, "half"), os.path.join(d, "ck")
    ok(["train", *shape, *common, "--run-dir", half, "--steps", "3", "--checkpoint", ck])
    manifest = read(os.path.join(ck, "manifest.json"))
    refused(["train", *common, "--resume", ck, "--run-dir", os.path.join(d, "rest"), "--steps",
             "6"], "--config RUN_DIR/config.json")
    check(not os.path.exists(os.path.join(d, "rest")), "a refused resume left its run directory")
    # A moved run directory: its config.json is not taken in place, and nothing is trained.
    moved = os.path.join(d, "moved")
    ok(["train", *shape, *common, "--run-dir", os.path.join(d, "orig"), "--steps", "3"])
    os.rename(os.path.join(d, "orig"), moved)
    before = {n: read(os.path.join(moved, n)) for n in ("config.json", "metrics.jsonl",
                                                        "checkpoint/manifest.json")}
    refused(["train", "--resume", moved + "/checkpoint", "--steps", "6", "--run-dir", moved,
             "--quiet"], "model.")
    check(all(read(os.path.join(moved, n)) == b for n, b in before.items()),
          "a refused resume of a moved run changed it")
    # eval and export without --config, or with one that names no model field, equal them with
    # the run's config.
    part = os.path.join(d, "part.json")
    with open(part, "w") as f:
        f.write('{"engine": {"host_budget": "64MiB"}}\n')

    def mean_loss_of(checkpoint, extra=()):
        out = ok(["eval", "--resume", checkpoint, "--data", tok, *extra])
        m = re.search(r"mean loss ([0-9.]+)", out)
        check(m, f"no loss:\n{out}")
        return m.group(1)

    def mean_loss(extra):
        return mean_loss_of(ck, extra)
    want = mean_loss(["--config", os.path.join(half, "config.json")])
    check(mean_loss([]) == want and mean_loss(["--config", part]) == want, "eval differs")
    # Without --data, the token files the checkpoint records (as its run's config would give),
    # their validation split (Note [What eval scores by default]); --split all, every token.
    out = ok(["eval", "--resume", ck, "--split", "all"])
    check("the token files the checkpoint's run read" in out and f"mean loss {want}" in out,
          f"eval without --data:\n{out}")
    out = ok(["eval", "--resume", ck])
    check("its validation split" in out and
          f"mean loss {mean_loss(['--split', 'validation'])}" in out,
          f"eval without --data, its validation split:\n{out}")
    xs = [os.path.join(d, f"x{i}.safetensors") for i in range(4)]
    ok(["export", ck, "--config", os.path.join(half, "config.json"), "-o", xs[0]])
    ok(["export", ck, "-o", xs[1]])
    ok(["export", ck, "--config", part, "-o", xs[2]])
    check(read(xs[0]) == read(xs[1]) == read(xs[2]), "an export without the run's config differs")
    # A config.json beside it that is no run's (another program's), or another run's, is not read
    # as its run's: eval and export agree.
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"]}\n')
    ok(["export", ck, "-o", xs[3]])
    check(read(xs[0]) == read(xs[3]), "another program's config.json was read")
    other = os.path.join(d, "other")
    ok(["train", "--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "32", *common,
        "--run-dir", other, "--steps", "1"])
    shutil.copytree(ck, os.path.join(other, "ck"))
    check(mean_loss([]) == want, "eval differs")
    out = ok(["eval", "--resume", os.path.join(other, "ck"), "--data", tok])
    check(re.search(r"mean loss ([0-9.]+)", out).group(1) == want,
          f"another run's config.json beside the checkpoint was taken:\n{out}")
    # What a flag or a config file names is kept, and another model is refused.
    refused(["eval", "--resume", ck, "--data", tok, "--heads", "4"], "n_head", "--heads")
    refused(["eval", "--resume", ck, "--data", tok, "--seq-len", "32"], "seq_len")
    named = os.path.join(d, "named.json")
    with open(named, "w") as f:
        f.write('{"model": {"n_head": 4}}\n')
    refused(["export", ck, "--config", named, "-o", os.path.join(d, "x5.st")], "n_head")
    check(read(os.path.join(ck, "manifest.json")) == manifest, "the checkpoint changed")
    # The run directory's checkpoint path, where that run saved elsewhere: the error names where.
    refused(["eval", "--resume", os.path.join(half, "checkpoint"), "--data", tok],
            "--resume " + ck)
    refused(["export", os.path.join(half, "checkpoint"), "-o", os.path.join(d, "x6.st")],
            "give " + ck)
    shutil.copytree(ck, os.path.join(d, "x_ck3"))  # (the checkpoint at step 3)
    # train's advice is with that run's config, and followed as given it continues the run.
    out = refused(["train", "--resume", os.path.join(half, "checkpoint"), "--steps", "4",
                   "--quiet"], "--config " + os.path.join(half, "config.json") + " --resume " + ck)
    ok(["train", "--config", os.path.join(half, "config.json"), "--resume", ck, "--steps", "4",
        "--quiet"])
    check([m[0] for m in losses(os.path.join(half, "metrics.jsonl"))] == [1, 2, 3, 4],
          "the advised resume did not continue the run")
    # A checkpoint of another model copied into a run directory as its checkpoint: that run's
    # config.json is not this checkpoint's.
    other2 = os.path.join(d, "other2")
    ok(["train", "--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "32", *common,
        "--run-dir", other2, "--steps", "1"])
    shutil.rmtree(os.path.join(other2, "checkpoint"))
    shutil.copytree(os.path.join(d, "x_ck3"), os.path.join(other2, "checkpoint"))
    check(mean_loss_of(os.path.join(other2, "checkpoint")) == want,
          "another run's config.json was taken for a checkpoint copied into its run directory")
    # A larger model than the built-in budgets hold exports at the machine's.
    big = os.path.join(d, "bigck")
    ok(["train", "--layers", "4", "--width", "256", "--heads", "4", "--seq-len", "16", *common,
        "--host-budget", "256MiB", "--run-dir", os.path.join(d, "big"), "--steps", "1",
        "--checkpoint", big])
    ok(["export", big, "-o", os.path.join(d, "big.safetensors")])


def case_resume_notes():
    d = os.path.join(OUT, "rn_tok")
    os.makedirs(d)
    with open(os.path.join(d, "a.bin"), "wb") as f:
        f.write(struct.pack("<60000H", *[(i * 7) % 64 for i in range(60000)]))
    val = struct.pack("<20000H", *[(i * 3) % 64 for i in range(20000)])
    with open(os.path.join(d, "b.bin"), "wb") as f:
        f.write(val)
    cfg = write_config(os.path.join(OUT, "rn.json"),
                       model={"n_layer": 1, "d_model": 32, "n_head": 2, "vocab": 64, "seq_len": 16},
                       data={"kind": "tokens", "token_path": os.path.join(d, "*.bin")})
    rd = os.path.join(OUT, "rn_run")
    p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--steps", "100000",
                          "--eval-every", "3", "--quiet"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=OUT)
    metrics = os.path.join(rd, "metrics.jsonl")
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None and \
            (not os.path.exists(metrics) or read(metrics).count(b"\n") < 6):
        time.sleep(0.02)
    os.truncate(os.path.join(d, "b.bin"), 100)  # the validation file: an evaluation fails
    out = p.communicate(timeout=60)[0].decode(errors="replace")
    check(p.returncode == 1 and "validation data" in out and "A checkpoint of step" in out,
          f"a validation file truncated mid-run: status {p.returncode}\n{out}")
    manifest = json.load(open(os.path.join(rd, "checkpoint", "manifest.json")))
    at = manifest["step"]
    check(manifest["user_state"].get("eval_pending") is True and at % 3 == 0,
          f"the checkpoint does not record its undone evaluation: {manifest['user_state']}")
    with open(os.path.join(d, "b.bin"), "wb") as f:
        f.write(val)
    ok(["train", "--config", cfg, "--run-dir", rd, "--resume", rd + "/checkpoint", "--steps",
        str(at + 2), "--eval-every", "3", "--quiet"])
    evals = [json.loads(line)["step"] for line in open(metrics) if "val_loss" in line]
    check(at in evals, f"the evaluation of step {at} was never made: evaluations at {evals}")
    # Other rows per micro-batch at the same global batch; another file matching the glob.
    out = ok(["train", "--config", cfg, "--run-dir", rd, "--resume", rd + "/checkpoint", "--steps",
              str(at + 4), "--batch-size", "4", "--grad-accumulation", "2", "--quiet"])
    check("rows per micro-batch change" in out, f"other rows at a resume, no note:\n{out}")
    with open(os.path.join(d, "c.bin"), "wb") as f:
        f.write(val)
    out = ok(["train", "--config", cfg, "--run-dir", rd, "--resume", rd + "/checkpoint", "--steps",
              str(at + 6), "--batch-size", "4", "--grad-accumulation", "2", "--quiet"])
    check("is not what the checkpoint's run read" in out, f"other files at a resume, no note:\n{out}")


    # eval --resume without --data: a run's relative token path (its config.json's) is not taken
    # as it is, but as the absolute path its checkpoint records (case eval_recorded_data).
    rel = os.path.join(OUT, "rn_rel")
    ok(["train", "--config", cfg, "--data", "rn_tok/a.bin", "--run-dir", rel, "--steps", "2",
        "--quiet"])
    out = ok(["eval", "--resume", rel + "/checkpoint"], cwd="/")
    check(os.path.join(OUT, "rn_tok/a.bin") in out, f"eval took another path:\n{out}")
    # A run directory given for its checkpoint is said first, everywhere.
    for cmd in (["train", "--config", cfg, "--run-dir", rd, "--resume", rd, "--steps", "100"],
                ["eval", "--resume", rd, "--data", os.path.join(d, "b.bin")],
                ["export", rd, "-o", os.path.join(OUT, "rn.st")]):
        refused(cmd, "is a run directory, not a checkpoint", rd + "/checkpoint")


def case_resume_settings():
    # A resume that changes what the steps compute says so (hunt 39: none was said): AdamW's
    # settings, a learning rate that differs below 4 digits, and with 8-bit moments the chunk
    # layout (their blocks and stochastic rounding follow it).
    cfg = write_config(os.path.join(OUT, "rs.json"),
                       model={"n_layer": 1, "d_model": 32, "n_head": 2},
                       engine={"optimizer_states": "int8"})
    rd = os.path.join(OUT, "rs_run")
    ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "3", "--quiet"])
    rc, out = run(["train", "--config", cfg, "--run-dir", rd, "--resume", rd + "/checkpoint",
                   "--steps", "5", "--lr", "0.0010004", "--quiet"])
    check(rc == 0 and "lr 0.00100000005 -> 0.00100040005" in out,
          f"an lr change below 4 digits was not said:\n{out}")
    cfg2 = write_config(os.path.join(OUT, "rs2.json"),
                        model={"n_layer": 1, "d_model": 32, "n_head": 2},
                        engine={"optimizer_states": "int8", "beta2": 0.999, "chunk_elems": 65536})
    rc, out = run(["train", "--config", cfg2, "--run-dir", rd, "--resume", rd + "/checkpoint",
                   "--steps", "7", "--quiet"])
    check(rc == 0 and "AdamW's settings change (adamw beta2 0.95 -> 0.999)" in out,
          f"a changed beta2 was not said:\n{out}")
    check("the chunk layout changes (engine.chunk_elems" in out,
          f"8-bit moments over another layout were not said:\n{out}")


def as_older_checkpoint(ckpt):
    """Rewrites a checkpoint's manifest as builds before 2026-11-26 wrote it: a user state of the
    step, batch, ranks and data seed only, and no manifest checksum (they had none)."""
    path = os.path.join(ckpt, "manifest.json")
    m = json.load(open(path))
    m.pop("manifest_crc32c", None)
    u = m["user_state"]
    m["user_state"] = {k: u[k] for k in ("step", "batch_size", "data_seed", "grad_accumulation",
                                         "ranks")}
    with open(path, "w") as f:
        json.dump(m, f)


def case_resume_older_checkpoint():
    # Note [An older checkpoint's records]: an older build's checkpoint records no model or
    # settings; they come from its run's config.json, so another --heads (the same tensor shapes)
    # is refused and a changed schedule is noted, where both went on silently (hunt 41).
    cfg = write_config(os.path.join(OUT, "older_cfg.json"), model={"n_layer": 1, "d_model": 32,
                                                                "n_head": 2})
    a = os.path.join(OUT, "older_run")
    ok(["train", "--config", cfg, "--run-dir", a, "--steps", "4", "--quiet"])
    as_older_checkpoint(os.path.join(a, "checkpoint"))
    moved = os.path.join(OUT, "older_moved_ckpt")
    shutil.copytree(os.path.join(a, "checkpoint"), moved)
    out = refused(["train", "--resume", os.path.join(a, "checkpoint"), "--heads", "4", "--steps",
                   "8"], "model.n_head 2", "an older tierzero's")
    # A moved run (its config.json's paths relative to where it ran): the same.
    moved_run = os.path.join(OUT, "older_moved", "run")
    shutil.copytree(a, moved_run)
    refused(["train", "--config", cfg, "--resume", "run/checkpoint", "--heads", "4", "--steps",
             "8", "--run-dir", "run2"], "taken from its run's", "model.n_head 2",
            cwd=os.path.dirname(moved_run))
    out = ok(["train", "--resume", os.path.join(a, "checkpoint"), "--steps", "8", "--lr", "0.01"])
    check("taken from its run's" in out and "learning-rate schedule changes" in out,
          f"an older checkpoint's resume does not note the changed schedule\n{out}")
    # Without its run's config.json: resumed, saying what could not be checked.
    out = ok(["train", "--config", cfg, "--resume", moved, "--run-dir",
              os.path.join(OUT, "older_run2"), "--steps", "8", "--quiet"])
    check("checked by its tensors' shapes only" in out,
          f"an older checkpoint without its config resumed without a word\n{out}")
    # An export without tierzero's model record, read as another model: the error says where
    # the shape comes from and how to give the right one.
    st = os.path.join(OUT, "older_export.st")
    ok(["export", os.path.join(a, "checkpoint"), "--format", "safetensors", "-o", st])
    raw = open(st, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(st, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    refused(["train", "--init-from", st, "--run-dir", os.path.join(OUT, "older_run3"), "--steps",
             "2"], "records no model", "--config RUN_DIR/config.json")


def case_resume_elsewhere():
    # Note [A run's config from another working directory]: a run's config.json records its paths
    # relative to where it started. Resumed from another working directory (`--resume
    # w/run/checkpoint`, or `--config w/run/config.json --resume w/run/checkpoint` as a refusal
    # advises), the run went on in a new ./run, the one resumed left at its step. It continues in
    # place now, bit for bit with a run never stopped.
    w = os.path.join(OUT, "re_w")
    os.makedirs(w)
    cfg = os.path.join(OUT, "small.json")
    ok(["train", "--config", cfg, "--run-dir", "run", "--steps", "4", "--quiet"], cwd=w)
    ok(["train", "--config", cfg, "--run-dir", "ref", "--steps", "10", "--quiet"], cwd=w)
    ok(["train", "--resume", "re_w/run/checkpoint", "--steps", "7", "--quiet"])
    other = os.path.join(OUT, "re_other")
    os.makedirs(other)
    ok(["train", "--config", os.path.join(w, "run", "config.json"), "--resume",
        os.path.join(w, "run", "checkpoint"), "--steps", "10", "--quiet"], cwd=other)
    check(os.listdir(other) == [] and not os.path.exists(os.path.join(OUT, "run")),
          f"a resume from elsewhere wrote a new run: {os.listdir(other)}")

    def losses(d):
        return [(m["step"], m["loss"]) for m in map(json.loads, open(os.path.join(d,
                "metrics.jsonl"))) if "loss" in m]
    got, want = losses(os.path.join(w, "run")), losses(os.path.join(w, "ref"))
    check(got == want, f"resumed from elsewhere: {got} against {want}")


def case_checkpoint_elsewhere_advice():
    # A new run whose --checkpoint names another run's checkpoint outside its run directory: the
    # refusal advised `--run-dir DIR`, which was refused again on that same checkpoint. It names
    # --checkpoint now, and following it (both flags where both are in the way) starts the run,
    # the other checkpoint untouched.
    cfg = os.path.join(OUT, "small.json")
    ck = os.path.join(OUT, "ce_ck")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_a"), "--checkpoint", ck,
        "--steps", "2", "--quiet"])
    manifest = open(os.path.join(ck, "manifest.json"), "rb").read()
    out = refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_b"),
                   "--checkpoint", ck, "--steps", "2", "--quiet"],
                  "--checkpoint PATH names another directory")
    check("--run-dir DIR" not in out, f"advice to move a run whose checkpoint stays:\n{out}")
    out = refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_a"),
                   "--checkpoint", ck, "--steps", "2", "--quiet"],
                  "--run-dir DIR starts this run elsewhere and --checkpoint PATH")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_b"), "--checkpoint",
        os.path.join(OUT, "ce_ck2"), "--steps", "2", "--quiet"])
    # Its advice to resume, followed as said: from that checkpoint, saving in the new run's own.
    out = refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_c"),
                   "--checkpoint", ck, "--steps", "4", "--quiet"], "without --checkpoint")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "ce_c"), "--resume", ck,
        "--steps", "4", "--quiet"])
    check(os.path.exists(os.path.join(OUT, "ce_c", "checkpoint", "manifest.json")),
          "the resumed run saved no checkpoint of its own")
    check(open(os.path.join(ck, "manifest.json"), "rb").read() == manifest,
          "the other run's checkpoint changed")


def case_one_process_advice():
    # eval and export run in one process, without mpirun, and eval refuses
    # --checkpoint-activations: their memory refusals advised more ranks and checkpointing. Each
    # refusal now names what these commands take, and the budget it names fits.
    base = os.path.join(OUT, "op_base")
    train_small(base, steps=2)
    ckpt = os.path.join(base, "checkpoint")
    tok = os.path.join(OUT, "op_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<4000H", *([1, 2, 3, 4] * 1000)))
    for args in (["eval", "--resume", ckpt, "--data", tok, "--host-budget", "1MiB",
                  "--nvme-budget", "0"],
                 ["eval", "--resume", ckpt, "--data", tok, "--device-budget", "1MiB", "--batch-size",
                  "64"],
                 ["export", ckpt, "-o", os.path.join(OUT, "op.safetensors"), "--host-budget",
                  "1MiB", "--nvme-budget", "0"]):
        out = refused(args, "OutOfMemory")
        check("more ranks" not in out, f"{args}: advice to use more ranks\n{out}")
        check(args[0] != "eval" or "checkpoint" not in out.partition("error:")[2].replace(ckpt, ""),
              f"{args}: advice to checkpoint activations\n{out}")
        m = re.search(r"host_budget \(--host-budget\) (\d+MiB) at this NVMe budget", out)
        if m:
            ok(args[:-4] + ["--host-budget", m.group(1), "--nvme-budget", "0"])


def case_never_steps():
    # Note [The states of a command that never steps]: eval and export hold no moments and no
    # gradient shards, whatever the run's. The model state they place is about 6 bytes a
    # parameter (it was 18 for a bf16 run with accumulation, then 10 with int8 moments, then 8
    # with gradient shards of the compute type), and what they compute is the same at a budget
    # that fits only so: the same loss, the same export.
    base = os.path.join(OUT, "ns_base")
    train_small(base, "--grad-accumulation", "2", steps=2)
    ckpt = os.path.join(base, "checkpoint")
    tok = os.path.join(OUT, "ns_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<4000H", *([5, 7, 11, 13, 17] * 800)))
    out = refused(["eval", "--resume", ckpt, "--data", tok, "--host-budget", "1MiB",
                   "--nvme-budget", "0"], "model state of")
    state = re.search(r"model state of ([0-9.]+) (KiB|MiB)", out)
    size = float(state.group(1)) * (1024 if state.group(2) == "KiB" else 1024 * 1024)
    params = 117056  # the small config's GPT-2 (2 layers x 64 wide)
    # (~6.6 with the chunks' padding; 19.6 with the run's states, 11.2 with int8 moments, 8.8
    # with gradient shards)
    check(size / params < 7.5, f"eval places {size / params:.1f} bytes a parameter:\n{out}")
    least = re.search(r"nvme_budget \(--nvme-budget\) (\d+MiB) at this host budget", out)
    check(least, f"no NVMe budget named:\n{out}")
    tight = ["--host-budget", "1MiB", "--nvme-budget", least.group(1)]

    def loss(extra):
        text = ok(["eval", "--resume", ckpt, "--data", tok] + extra)
        return re.search(r"mean loss ([0-9.]+)", text).group(1)
    check(loss([]) == loss(tight), "eval at the budgets said scores another loss")
    a, b = os.path.join(OUT, "ns_a.safetensors"), os.path.join(OUT, "ns_b.safetensors")
    ok(["export", ckpt, "-o", a])
    ok(["export", ckpt, "-o", b] + tight)
    check(read(a) == read(b), "an export at the budgets said differs")
