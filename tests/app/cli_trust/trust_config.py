"""Configs and flags as a user writes them, and the run a resume with them makes: a resume that
is a copy says so; values written as people write them are read as they mean them.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import shutil
import struct
import subprocess
import time

from trust_common import TZ, OUT, check, ok, refused, write_config


def case_resume_copy():
    """Note [A resume that is a copy]: `--config MY.json --resume C/checkpoint`, the first
    command again with --resume, goes on in the config's run directory: said at the start, with
    the --run-dir that continues C in place. A run directory moved since: the refusal of the
    built-in model names its config and its directory, and that command continues it in place."""
    cfg = write_config(os.path.join(OUT, "rc.json"), train={"steps": 20})
    c = os.path.join(OUT, "rc_C")
    ok(["train", "--config", cfg, "--run-dir", c, "--steps", "4", "--quiet"])
    copy = os.path.join(OUT, "rc_copy")
    out = ok(["train", "--config", cfg, "--run-dir", copy, "--resume", c + "/checkpoint",
              "--steps", "6", "--quiet"])
    check(f"as a copy into {copy}: {c} stays at step 4 (--run-dir {c} continues that run in "
          "place)" in out, f"a resume into another run directory is not said as a copy\n{out}")
    out = ok(["train", "--config", cfg, "--run-dir", c, "--resume", c + "/checkpoint", "--steps",
              "6", "--quiet"])
    check("as a copy" not in out, f"a resume in place said as a copy\n{out}")
    moved = c + "_moved"
    shutil.move(c, moved)
    out = refused(["train", "--resume", moved + "/checkpoint", "--steps", "8", "--quiet"],
                  f"--config {moved}/config.json --run-dir {moved}")
    ok(["train", "--config", moved + "/config.json", "--run-dir", moved, "--resume",
        moved + "/checkpoint", "--steps", "8", "--quiet"])
    with open(os.path.join(moved, "checkpoint", "manifest.json")) as f:
        check(json.load(f)["step"] == 8, "the moved run was not continued in place")
    check(not os.path.exists(c), f"a run directory {c} was made again")


def case_flag_forms():
    """Note [Options written --name=value] and numbers as a shell user writes them: `--lr=.001`,
    `--steps=3`, `--lr 1.` are the options they look like (each was refused); Note [A floor below
    the rate asked for]: `--lr 5e-5` trains, its floor a tenth of it, unless one is named."""
    cfg = write_config(os.path.join(OUT, "ff.json"))
    rd = os.path.join(OUT, "ff")
    ok(["train", "--config", cfg, "--run-dir=" + rd, "--steps=3", "--lr=.002", "--quiet"])
    with open(os.path.join(rd, "config.json")) as f:
        train = json.load(f)["train"]
    check(train["steps"] == 3 and abs(train["lr"] - 0.002) < 1e-9, f"recorded: {train}")
    ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "2", "--lr", "5e-5", "--overwrite",
        "--quiet"])
    with open(os.path.join(rd, "config.json")) as f:
        train = json.load(f)["train"]
    check(abs(train["min_lr"] - 5e-6) < 1e-12, f"the floor of --lr 5e-5: {train}")
    floor = write_config(os.path.join(OUT, "ff_floor.json"), train={"min_lr": 1e-4})
    refused(["train", "--config", floor, "--run-dir", rd + "_floor", "--lr", "5e-5"],
            "'train.min_lr' (0.0001) exceeds 'train.lr'")
    check(not os.path.exists(rd + "_floor"), "a refused run left its directory")
    refused(["train", "--quiet=1"], "--quiet takes no value")
    refused(["plan", "--lr", "1e-400"], "too small for a double")
    ok(["plan", "--config", cfg, "--steps", "+2", "--no-advice"])
    # A name after "--" is no option: export's checkpoint "--x=y" is a path.
    refused(["export", "--", "--x=y", "-o", os.path.join(OUT, "ff.st")], "--x=y")


def case_resume_mistakes():
    """A mistyped --resume beside a used runs/default is said as the typo, not as that run's
    outputs; a checkpoint whose manifest was removed is said as what it holds, and --overwrite
    said to remove its states; a profile step the run's config records past a shorter resume is
    the run's, not an error (hunt 51); the activations' type changed is said where it changes.
    """
    cfg = write_config(os.path.join(OUT, "rm.json"), train={"steps": 20})
    rd = os.path.join(OUT, "rm")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "runs", "default"), "--steps",
        "2", "--quiet"])
    refused(["train", "--resume", "typo/checkpoint", "--steps", "4"],
            "no checkpoint at 'typo/checkpoint'")
    # (The run of 20 steps profiling step 18, stopped at step 4: its config.json says so.)
    ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "4", "--quiet"])
    with open(os.path.join(rd, "config.json")) as f:
        recorded = json.load(f)
    recorded["train"].update(steps=20, profile_step=18)
    with open(os.path.join(rd, "config.json"), "w") as f:
        json.dump(recorded, f)
    out = ok(["train", "--resume", rd + "/checkpoint", "--steps", "6", "--quiet"])
    check("profile step 18 is past this run's last step 6" in out, f"profile step:\n{out}")
    os.remove(os.path.join(rd, "checkpoint", "manifest.json"))
    refused(["train", "--resume", rd + "/checkpoint", "--steps", "8"],
            "holds states-6.w1.rank0.bin without the manifest.json",
            "states-6.w1.rank0.bin among them")
    # The activations' type: a change of what each run computed in is said, the same type
    # spelled otherwise is not ("auto" is fp32 on the CPU: it was said to change the steps).
    ra = os.path.join(OUT, "rm_act")
    ok(["train", "--config", cfg, "--run-dir", ra, "--steps", "2", "--quiet"])
    out = ok(["train", "--resume", ra + "/checkpoint", "--steps", "3", "--activations", "fp32",
              "--quiet"])
    check("activations change" not in out, f"auto to fp32 on the CPU said as a change:\n{out}")
    out = ok(["train", "--resume", ra + "/checkpoint", "--steps", "4", "--activations", "bf16",
              "--quiet"])
    check("the activations change from fp32 to bf16" in out, f"fp32 to bf16 not said:\n{out}")


def case_outputs_taken():
    """Note [Outputs another run took]: a --report another process wrote while the run trained is
    kept, the run's report kept aside, and the run's config.json records where it went: a resume
    in place no longer replaces the other's report unasked (hunt 51)."""
    cfg = write_config(os.path.join(OUT, "ot.json"), train={"steps": 3000, "eval_every": 0})
    rd, shared = os.path.join(OUT, "ot"), os.path.join(OUT, "ot_shared.json")
    log = os.path.join(OUT, "ot.log")
    with open(log, "w") as f:
        p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--report", shared,
                              "--log-every", "1"], stdout=f, stderr=subprocess.STDOUT, cwd=OUT)
    deadline = time.time() + 60
    while p.poll() is None and time.time() < deadline and "step    20/" not in open(log).read():
        time.sleep(0.05)
    with open(shared, "w") as f:
        f.write('{"another run": true}')
    p.wait(timeout=120)
    check(p.returncode == 1, f"the run ended {p.returncode}\n{open(log).read()[-1500:]}")
    with open(os.path.join(rd, "config.json")) as f:
        recorded = json.load(f)["output"]["report"]
    check(recorded != shared and os.path.exists(recorded), f"config.json records {recorded}")
    ok(["train", "--resume", rd + "/checkpoint", "--steps", "3002", "--quiet"])
    with open(shared) as f:
        check(f.read() == '{"another run": true}', "a resume replaced another run's report")


def case_older_files():
    """Files the build before model.token_ids wrote (review 52): a run's config.json without it is
    still the run's own (a resume from another directory continues in place, on its data); a
    plan without it is still the run's. A glob of token files under a directory whose name has
    glob characters, recorded absolute beside an absolute run directory, still matches."""
    a = os.path.join(OUT, "of_a")
    os.makedirs(a)
    with open(os.path.join(a, "data.bin"), "wb") as f:
        f.write(struct.pack("<4000H", *[i % 200 for i in range(4000)]))
    ok(["train", "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "256", "--seq-len",
        "16", "--data", "data.bin", "--run-dir", "run", "--steps", "2", "--quiet"], cwd=a)
    config = os.path.join(a, "run", "config.json")
    with open(config) as f:
        recorded = json.load(f)
    del recorded["model"]["token_ids"]
    with open(config, "w") as f:
        json.dump(recorded, f)
    b = os.path.join(OUT, "of_b")
    os.makedirs(b)
    with open(os.path.join(b, "data.bin"), "wb") as f:
        f.write(struct.pack("<4000H", *[(i * 7) % 200 for i in range(4000)]))
    out = ok(["train", "--resume", os.path.join(a, "run", "checkpoint"), "--steps", "3",
              "--quiet"], cwd=b)
    check("as a copy" not in out and "the data changes" not in out and
          not os.path.exists(os.path.join(b, "run")),
          f"an older config.json was not the run's own:\n{out}")
    # A plan of the build before.
    small = os.path.join(OUT, "small.json")
    plan = os.path.join(OUT, "of_plan.json")
    ok(["plan", "--config", small, "--json", plan, "--no-advice"])
    with open(plan) as f:
        p = json.load(f)
    del p["config"]["model"]["token_ids"]
    with open(plan, "w") as f:
        json.dump(p, f)
    ok(["train", "--config", small, "--plan", plan, "--run-dir", os.path.join(OUT, "of_planned"),
        "--steps", "2", "--quiet"])
    # Glob characters in the working directory's name.
    g = os.path.join(OUT, "of_br[1]")
    os.makedirs(os.path.join(g, "shards"))
    for k in range(2):
        with open(os.path.join(g, "shards", f"s{k}.bin"), "wb") as f:
            f.write(struct.pack("<4000H", *[i % 200 for i in range(4000)]))
    rd = os.path.join(g, "run")
    common = ["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "256", "--seq-len",
              "16", "--run-dir", rd, "--quiet"]
    ok(["train", *common, "--data", "shards/*.bin", "--steps", "2"], cwd=g)
    ok(["train", "--resume", rd + "/checkpoint", "--run-dir", rd, "--steps", "3", "--quiet"],
       cwd=g)
    # The same with a relative run directory, resumed and evaluated from elsewhere: the
    # checkpoint's record and the run config's rebase escape the directory's part too.
    ok(["train", *common[:-3], "--run-dir", "rel", "--quiet", "--data", "shards/*.bin", "--steps",
        "2"], cwd=g)
    ok(["train", "--resume", os.path.join(g, "rel", "checkpoint"), "--steps", "3", "--quiet"],
       cwd=OUT)
    ok(["eval", "--resume", os.path.join(g, "rel", "checkpoint")], cwd=OUT)
