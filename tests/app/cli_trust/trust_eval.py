"""Evaluations: what `tierzero eval` scores when no --data names it (the run's own files, their
validation split, from any working directory), and its refusals' advice.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import re
import struct
import subprocess

from trust_common import TZ, OUT, check, ok, refused
from trust_resume import as_older_checkpoint


def tokens(path, mul, n=4096):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{n}H", *[(i * mul) % 256 for i in range(n)]))


MODEL = ["--arch", "gpt2", "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "256",
         "--seq-len", "16", "--steps", "3", "--quiet"]


def mean_loss(out):
    m = re.search(r"mean loss ([0-9.]+)", out)
    check(m is not None, f"no loss:\n{out}")
    return m.group(1)


def case_eval_recorded_data():
    # eval --resume without --data scores the token files the checkpoint records its run read,
    # only where that path names them from anywhere: absolute. A run under a directory whose name
    # is not UTF-8 records the path as given (relative): from elsewhere, another data.bin of the
    # same name was scored, silently (hunt 46). A run's config.json records the path as the user
    # gave it: a relative one there is the checkpoint's absolute one.
    model = MODEL
    odd = os.path.join(os.fsencode(OUT), b"er_run\xfe")
    os.makedirs(odd)
    tokens(os.path.join(odd, b"data.bin"), 7)
    elsewhere = os.path.join(OUT, "er_else")
    os.makedirs(elsewhere)
    tokens(os.path.join(elsewhere, "data.bin"), 13)
    ck = os.path.join(OUT, "er_ck")
    p = subprocess.run([TZ, "train"] + model + ["--data", "data.bin", "--run-dir", "r",
                                                "--checkpoint", ck],
                       cwd=odd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    check(p.returncode == 0, f"a run under a non-UTF-8 directory: {p.stdout.decode(errors='replace')}")
    refused(["eval", "--resume", ck], "--data PATH", "relative to where it ran", cwd=elsewhere)
    # A relative --data in the run's config.json: the checkpoint's absolute path, from anywhere.
    here = os.path.join(OUT, "er_here")
    os.makedirs(here)
    tokens(os.path.join(here, "data.bin"), 7)
    ok(["train"] + model + ["--data", "data.bin", "--run-dir", "r"], cwd=here)
    want = ok(["eval", "--resume", os.path.join(here, "r/checkpoint"), "--data",
               os.path.join(here, "data.bin")])
    got = ok(["eval", "--resume", os.path.join(here, "r/checkpoint"), "--split", "all"],
             cwd=elsewhere)
    check(mean_loss(got) == mean_loss(want), f"eval from elsewhere scored other data:\n{got}\n{want}")
    # An older checkpoint records no data: its run's config.json's relative path, from
    # elsewhere, is refused (it was made absolute from here, another file: review 46).
    older = os.path.join(OUT, "er_older")
    os.makedirs(older)
    tokens(os.path.join(older, "data.bin"), 7)
    ok(["train"] + model + ["--data", "data.bin", "--run-dir", os.path.join(older, "r")],
       cwd=older)
    as_older_checkpoint(os.path.join(older, "r/checkpoint"))
    # (An older build recorded --data as given beside an absolute run directory, too.)
    with open(os.path.join(older, "r", "config.json")) as f:
        recorded = json.load(f)
    recorded["data"]["token_path"] = "data.bin"
    with open(os.path.join(older, "r", "config.json"), "w") as f:
        json.dump(recorded, f)
    refused(["eval", "--resume", os.path.join(older, "r/checkpoint")], "relative to where it ran",
            cwd=elsewhere)


def case_eval_defaults():
    """Note [What eval scores by default]: without --data, the run's validation split (its
    other tokens it trained on), the same as --data FILE --split validation; --split all every
    token. A relative --data beside an absolute --run-dir, and one through a link and "..", name
    the file the run read from anywhere (hunt 52). A refusal's advice is eval's: no --run-dir,
    no --vocab for a model's own vocabulary."""
    d = os.path.join(OUT, "ed")
    os.makedirs(os.path.join(d, "a", "d"))
    os.makedirs(os.path.join(d, "b", "d"))
    tokens(os.path.join(d, "a", "d", "data.bin"), 7)
    tokens(os.path.join(d, "b", "d", "data.bin"), 13)
    run_dir = os.path.join(d, "run")
    ok(["train"] + MODEL + ["--data", "d/data.bin", "--run-dir", run_dir], cwd=os.path.join(d, "a"))
    ck = os.path.join(run_dir, "checkpoint")
    mine = os.path.join(d, "a", "d", "data.bin")
    val = ok(["eval", "--resume", ck, "--data", mine, "--split", "validation"])
    whole = ok(["eval", "--resume", ck, "--data", mine])
    check(mean_loss(val) != mean_loss(whole), "the validation split scored as every token")
    for cwd in (os.path.join(d, "a"), os.path.join(d, "b")):
        out = ok(["eval", "--resume", ck], cwd=cwd)
        check("its validation split" in out and mean_loss(out) == mean_loss(val),
              f"eval without --data from {cwd}:\n{out}")
        out = ok(["eval", "--resume", ck, "--config", os.path.join(run_dir, "config.json"),
                  "--split", "all"], cwd=cwd)
        check(mean_loss(out) == mean_loss(whole), f"eval with the run's config from {cwd}:\n{out}")
    # A path through a link and "..": the file the kernel reads, not the one the path cuts to.
    os.makedirs(os.path.join(d, "real", "sub"))
    os.symlink(os.path.join(d, "real", "sub"), os.path.join(d, "lnk"))
    tokens(os.path.join(d, "real", "tokens.bin"), 7)
    tokens(os.path.join(d, "tokens.bin"), 13)
    ok(["train"] + MODEL + ["--data", "lnk/../tokens.bin", "--run-dir", "r2"], cwd=d)
    got = ok(["eval", "--resume", os.path.join(d, "r2", "checkpoint")])
    want = ok(["eval", "--resume", os.path.join(d, "r2", "checkpoint"), "--data",
               os.path.join(d, "real", "tokens.bin"), "--split", "validation"])
    check(mean_loss(got) == mean_loss(want), f"eval scored another file than the run read:\n{got}")
    # A --config of one's own naming token files is the user's data: scored whole, as --data.
    own = os.path.join(d, "own.json")
    with open(own, "w") as f:
        json.dump({"data": {"kind": "tokens", "token_path": mine}}, f)
    out = ok(["eval", "--resume", ck, "--config", own])
    check(mean_loss(out) == mean_loss(whole) and "validation split" not in out,
          f"eval with a config of one's own:\n{out}")
    # Advice that eval takes.
    with open(os.path.join(d, "other.json"), "w") as f:
        f.write('{"model": {"seq_len": 8, "vocab": 256}}')
    out = refused(["eval", "--resume", ck, "--config", os.path.join(d, "other.json")],
                  "model.seq_len")
    check("--config " + os.path.join(run_dir, "config.json") in out, f"advice:\n{out}")
    with open(os.path.join(d, "oov.bin"), "wb") as f:
        f.write(struct.pack("<4096H", *[300 if i == 500 else i % 256 for i in range(4096)]))
    out = refused(["eval", "--resume", ck, "--data", os.path.join(d, "oov.bin")],
                  "token id 300", "tokenizer the model was trained with")
    check("--vocab" not in out, f"eval advised --vocab for a checkpoint's model:\n{out}")
