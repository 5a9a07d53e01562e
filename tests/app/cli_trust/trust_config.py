"""Configs and flags as a user writes them, and the run a resume with them makes: a resume that
is a copy says so; values written as people write them are read as they mean them.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import shutil

from trust_common import OUT, check, ok, refused, write_config


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
