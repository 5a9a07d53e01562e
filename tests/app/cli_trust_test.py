#!/usr/bin/env python3
"""cli_trust_test.py TIERZERO OUT_DIR [CASE...]: the CLI people can trust with their runs (issue 41).

One case per class of fault, each through the `tierzero` binary as a user runs it:
  outputs       what an output path names decides how it is written (docs/outputs.md): a device
                node, a FIFO, a symlink, a directory, a user's file beside the output
  nvme_path     a config's engine.nvme_path naming a user's file: never truncated or removed
  self_export   an export never writes over the checkpoint or config it reads
  run_dir       a new run into a directory holding another run is refused; --overwrite replaces it
  config_elsewhere  a run's config.json with another --run-dir writes there; a moved run resumes
  lock          two runs into one directory at once: the second is refused, the first is intact
  config_json   a run whose config.json cannot be written stops before training
  resume_exact  10 + 10 resumed steps equal 20 uninterrupted, loss for loss, with skipped steps
  resume_model  resuming with another model shape (--heads) is refused
  resume_notes  an evaluation a data error left undone is made by the resume; a resume that
                takes other rows or other files than the checkpoint's run says so
  ranks_agree   ranks started with different configs fail with the fields named (mpirun ':')
  ranks_faults  two ranks whose data changes or whose metrics file fails mid-run: all save first
  readers       a directory, /dev/zero, a huge sparse file, deep or duplicate-key JSON: an error
  setup_signal  SIGINT/SIGTERM while set-up blocks on a FIFO ends the process promptly
  run_signals   a stdout reader gone, a closed stdout, a run blocked on a full FIFO, an export
  late_faults   faults found late: a config the report cannot hold, a finished run resumed, a
                foreign manifest.json, a set-up failing after config.json, data changing mid-run
  ranges        sizes at the ends of their ranges, absurd rates, a report of nonsense values
  export_paths  `export DIR/` and `export .` find the run's config
  models_in     a Hugging Face directory's context, files and seeding of a resumed run
  plan_device   a plan's rates are measured on the device the planned run computes on
  output        a line every --log-every steps without a terminal; one line in place on one
Every failure must be an `error:` line and exit status 1 or 2: never a signal, an abort, an
uncaught exception or a hang.
"""
import json
import os
import pty
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

TZ = os.path.abspath(sys.argv[1])
OUT = os.path.abspath(sys.argv[2])
ONLY = set(sys.argv[3:])

SMALL = {
    "model": {"n_layer": 2, "d_model": 64, "n_head": 4},
    "train": {"steps": 6, "batch_size": 8, "eval_every": 0, "eval_batches": 1},
    "engine": {"device_budget": "4 MiB", "host_budget": "6 MiB", "nvme_budget": "64 MiB"},
    "output": {"html": "none", "trace": "none"},
}


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def run(args, timeout=120, **kw):
    """Runs tierzero; returns (rc, stdout+stderr)."""
    p = subprocess.run([TZ] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout, cwd=kw.pop("cwd", OUT), **kw)
    return p.returncode, p.stdout.decode(errors="replace")


def refused(args, *needles, timeout=60, cwd=None):
    """The command fails cleanly (status 1 or 2, an error line naming `needles`)."""
    rc, out = run(args, timeout=timeout, cwd=cwd or OUT)
    check(rc in (1, 2), f"{args}: exit status {rc}, expected a clean refusal\n{out}")
    check("error:" in out, f"{args}: no error line\n{out}")
    for bad in ("terminate called", "Aborted", "what():", "Segmentation", "MPI_ERR"):
        check(bad not in out, f"{args}: '{bad}' in the output\n{out}")
    for n in needles:
        check(n in out, f"{args}: the error does not say '{n}'\n{out}")
    return out


def ok(args, timeout=120, cwd=None, env=None):
    rc, out = run(args, timeout=timeout, cwd=cwd or OUT, env=env)
    check(rc == 0, f"{args}: exit status {rc}\n{out}")
    return out


def write_config(path, cfg=None, **sections):
    c = json.loads(json.dumps(cfg or SMALL))
    for sec, fields in sections.items():
        c.setdefault(sec, {}).update(fields)
    with open(path, "w") as f:
        json.dump(c, f)
    return path


def train_small(run_dir, *extra, steps=6):
    cfg = write_config(os.path.join(OUT, "small.json"))
    return ok(["train", "--config", cfg, "--run-dir", run_dir, "--steps", str(steps),
               "--quiet"] + list(extra))


def mpirun_env():
    """(mpirun, its environment as root on 2 cores), or (None, None) when there is no mpirun."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("  (no mpirun: skipped)")
        return None, None
    return mpirun, dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMPI_MCA_rmaps_base_oversubscribe="1")


def read_then_go(reader, lines, p):
    """Reads a FIFO until `lines` lines (or 60 s, or `p` ends), then closes it: its writer's
    next line fails (EPIPE, as a full disk's ENOSPC)."""
    got, deadline = b"", time.time() + 60
    while got.count(b"\n") < lines and time.time() < deadline and p.poll() is None:
        try:
            got += os.read(reader, 65536)
        except BlockingIOError:
            time.sleep(0.05)
    os.close(reader)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def losses(metrics):
    rows = [json.loads(line) for line in open(metrics)]
    return [(m["step"], m["loss"], m["applied"], m["loss_scale"], m["lr"]) for m in rows
            if "loss" in m]


# ---- cases ----------------------------------------------------------------------------------

def case_outputs():
    ok_run = os.path.join(OUT, "o_run")
    train_small(ok_run)
    ckpt = os.path.join(ok_run, "checkpoint")
    # A character device of our own (the same as /dev/null), so a regression cannot break the
    # machine's /dev/null: it must stay a device node.
    dev = os.path.join(OUT, "o_null")
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        dev = None
    if dev:
        ino = os.stat(dev).st_ino
        ok(["export", ckpt, "-o", dev])
        ok(["report", os.path.join(ok_run, "report.json"), "-o", dev])
        ok(["plan", "--config", os.path.join(OUT, "small.json"), "--json", dev])
        run_dev = os.path.join(OUT, "o_dev")
        ok(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dev,
            "--steps", "2", "--quiet", "--report", dev, "--html", dev, "--trace", dev,
            "--metrics", dev])
        st = os.stat(dev)
        check(stat.S_ISCHR(st.st_mode) and st.st_ino == ino, "the device node was replaced")
    # /dev/stdout is the process's own descriptor: a shell's `>> file` is appended to, not
    # replaced through the link.
    appended = os.path.join(OUT, "o_appended.txt")
    with open(appended, "w") as f:
        f.write("kept\n")
    with open(appended, "a") as f:
        p = subprocess.run([TZ, "plan", "--config", os.path.join(OUT, "small.json"), "--json",
                            "/dev/stdout"], stdout=f, stderr=subprocess.PIPE, cwd=OUT, timeout=120)
    check(p.returncode == 0, f"plan --json /dev/stdout: {p.stderr.decode()}")
    text = read(appended).decode()
    check(text.startswith("kept\n") and '"prediction"' in text, f"/dev/stdout: {text[:200]}")
    # A FIFO whose reader waits receives the export; without a reader: refused, not a hang.
    fifo = os.path.join(OUT, "o_fifo")
    os.mkfifo(fifo)
    refused(["export", ckpt, "-o", fifo], "no reader", timeout=20)
    got = {}

    def reader():
        with open(fifo, "rb") as f:
            got["bytes"] = len(f.read())
    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.3)
    ok(["export", ckpt, "-o", fifo], timeout=30)
    t.join(10)
    check(got.get("bytes", 0) > 1000, f"the FIFO's reader got {got}")
    check(stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced")
    # A symlink: written through to its target, and stays a link.
    target, link = os.path.join(OUT, "o_target.st"), os.path.join(OUT, "o_link.st")
    with open(target, "w") as f:
        f.write("old")
    os.symlink(target, link)
    ok(["export", ckpt, "-o", link])
    check(os.path.islink(link), "the symlink was replaced by a file")
    check(read(target)[:8] != b"old", "the link's target was not written")
    dangling = os.path.join(OUT, "o_dangling")
    os.symlink(os.path.join(OUT, "o_missing"), dangling)
    refused(["export", ckpt, "-o", dangling], "symbolic link")
    check(os.path.islink(dangling) and not os.path.exists(os.path.join(OUT, "o_missing")),
          "a dangling link was followed or replaced")
    # A directory: refused, with nothing inside it touched.
    d = os.path.join(OUT, "o_dir")
    os.makedirs(d + "/inside")
    refused(["export", ckpt, "-o", d], "directory")
    # Refused before the work, not after it (plan calibrates first; export loads first).
    t0 = time.time()
    refused(["plan", "--config", os.path.join(OUT, "small.json"), "--json", d], "directory")
    refused(["report", ok_run + "/report.json", "-o", d], "directory")
    check(time.time() - t0 < 10, "plan --json DIR was refused only after its calibration")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
             os.path.join(OUT, "o_run2"), "--report", d], "directory")
    check(os.path.isdir(d + "/inside"), "the directory changed")
    # The temporary name never truncates a user's file beside the output.
    mine = os.path.join(OUT, "o_model.safetensors.tmp")
    with open(mine, "w") as f:
        f.write("the user's own file")
    ok(["export", ckpt, "-o", os.path.join(OUT, "o_model.safetensors")])
    check(read(mine) == b"the user's own file", "a user's .tmp file beside the output changed")
    left = [n for n in os.listdir(OUT) if ".tz-" in n]
    check(not left, f"temporary files left: {left}")


def case_nvme_path():
    # The default model's states need NVMe, so the export opens the NVMe store.
    run_dir = os.path.join(OUT, "n_run")
    ok(["train", "--run-dir", run_dir, "--steps", "2", "--quiet"])
    precious = os.path.join(OUT, "n_precious.txt")
    with open(precious, "w") as f:
        f.write("precious")
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    cfg["engine"]["nvme_path"] = precious
    with open(os.path.join(OUT, "n_cfg.json"), "w") as f:
        json.dump(cfg, f)
    # The export swaps to a directory of its own: the config's path is never touched.
    ok(["export", os.path.join(run_dir, "checkpoint"), "--config",
        os.path.join(OUT, "n_cfg.json"), "-o", os.path.join(OUT, "n_w.st")])
    check(read(precious) == b"precious", "the user's file named as the NVMe path changed")
    # Named as the NVMe path itself (the store refuses a file it did not create).
    tokens = os.path.join(OUT, "n_tokens.bin")
    with open(tokens, "wb") as f:
        f.write(b"".join(bytes([i % 200, 0]) for i in range(5000)))
    refused(["eval", "--resume", os.path.join(run_dir, "checkpoint"), "--data", tokens,
             "--nvme-path", precious], "existing file")
    check(read(precious) == b"precious", "eval changed the file named by --nvme-path")
    refused(["train", "--run-dir", os.path.join(OUT, "n_run2"), "--steps", "2", "--nvme-path",
             precious])
    check(read(precious) == b"precious", "train changed the file named by --nvme-path")


def case_self_export():
    run_dir = os.path.join(OUT, "s_run")
    train_small(run_dir)
    ckpt = os.path.join(run_dir, "checkpoint")
    manifest = read(ckpt + "/manifest.json")
    config = read(run_dir + "/config.json")
    refused(["export", ckpt, "-o", ckpt + "/manifest.json"], "inside the checkpoint")
    refused(["export", ckpt, "-o", run_dir + "/config.json"], "config")
    states = [n for n in os.listdir(ckpt) if n.startswith("states-")]
    refused(["export", ckpt, "-o", os.path.join(ckpt, states[0])], "inside the checkpoint")
    check(read(ckpt + "/manifest.json") == manifest, "the manifest changed")
    check(read(run_dir + "/config.json") == config, "the config changed")
    ok(["export", ckpt, "-o", os.path.join(OUT, "s_w.st")])
    # train: an output that is an input.
    text = os.path.join(OUT, "s_text.txt")
    with open(text, "w") as f:
        f.write("tierzero trains models far larger than GPU memory. " * 40)
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
             os.path.join(OUT, "s_run2"), "--text", text, "--metrics", text], "input")
    check(read(text).startswith(b"tierzero trains"), "the text was overwritten")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
             os.path.join(OUT, "s_run3"), "--report", os.path.join(OUT, "s_same"), "--html",
             os.path.join(OUT, "s_same")], "same file")


def case_run_dir():
    run_dir = os.path.join(OUT, "r_run")
    train_small(run_dir, steps=8)
    before = {n: read(os.path.join(run_dir, n)) for n in ("metrics.jsonl", "report.json")}
    manifest = read(run_dir + "/checkpoint/manifest.json")
    out = refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
                   "--steps", "3", "--quiet"], "--resume", "--overwrite")
    check(read(run_dir + "/checkpoint/manifest.json") == manifest, "the checkpoint changed")
    for n, b in before.items():
        check(read(os.path.join(run_dir, n)) == b, f"{n} changed")
    # --report elsewhere: still refused (the run's checkpoint and metrics are here).
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
             "--steps", "3", "--report", os.path.join(OUT, "r_elsewhere.json")], "--overwrite")
    # Resuming in place continues it; a killed writer's temporary file goes, a live one's stays.
    dead = os.path.join(run_dir, ".report.json.tz-999999999-0.tmp")
    live = os.path.join(run_dir, f".report.json.tz-{os.getpid()}-0.tmp")
    for t in (dead, live):
        with open(t, "w") as f:
            f.write("partial")
    ok(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir, "--steps",
        "10", "--quiet", "--resume", run_dir + "/checkpoint"])
    check(not os.path.exists(dead) and os.path.exists(live), "temporary files: dead kept or live removed")
    os.remove(live)
    # Files of this name in the run directory that the run would leave beside its own outputs
    # are listed, and --overwrite removes exactly what was listed.
    out = refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
                   "--steps", "3", "--report", os.path.join(OUT, "r_elsewhere.json")],
                  run_dir + "/report.json", run_dir + "/metrics.jsonl")
    # --overwrite replaces the run whole: no piece of the old one stays beside the new.
    ok(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir, "--steps",
        "3", "--quiet", "--overwrite", "--report", os.path.join(OUT, "r_elsewhere.json")])
    check(not os.path.exists(run_dir + "/report.json"), "the old run's report stayed")
    steps = [s for s, *_ in losses(run_dir + "/metrics.jsonl")]
    check(steps == [1, 2, 3], f"metrics after --overwrite: steps {steps}")
    info = json.load(open(run_dir + "/checkpoint/manifest.json"))
    check(info.get("step") == 3, f"the checkpoint after --overwrite is at step {info.get('step')}")


def case_config_elsewhere():
    """Note [A config's outputs follow --run-dir]: a run's config.json given as a template with
    another --run-dir writes there (not over the run it came from); a moved run directory resumes
    where it is now."""
    ra, rb = os.path.join(OUT, "e_ra"), os.path.join(OUT, "e_rb")
    train_small(ra)
    before = read(os.path.join(ra, "metrics.jsonl"))
    ok(["train", "--config", ra + "/config.json", "--run-dir", rb, "--resume", ra + "/checkpoint",
        "--steps", "8", "--quiet"])
    check(read(os.path.join(ra, "metrics.jsonl")) == before and
          os.path.exists(os.path.join(rb, "checkpoint", "manifest.json")) and
          os.path.exists(os.path.join(rb, "report.json")),
          "a run's config.json as a template wrote into the run it came from")
    moved = os.path.join(OUT, "e_moved")
    os.rename(rb, moved)
    ok(["train", "--config", moved + "/config.json", "--run-dir", moved, "--resume",
        moved + "/checkpoint", "--steps", "10", "--quiet"])
    check(not os.path.exists(rb) and
          json.load(open(os.path.join(moved, "checkpoint", "manifest.json")))["step"] == 10,
          "a moved run directory resumed elsewhere than where it is")
    # A new run directory saving into the checkpoint it resumes (another run's) is refused
    # without --overwrite, the checkpoint untouched.
    manifest = read(os.path.join(moved, "checkpoint", "manifest.json"))
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
             os.path.join(OUT, "e_new"), "--resume", moved + "/checkpoint", "--checkpoint",
             moved + "/checkpoint", "--steps", "12"], "the checkpoint this run resumes")
    check(read(os.path.join(moved, "checkpoint", "manifest.json")) == manifest and
          not os.path.exists(os.path.join(OUT, "e_new")),
          "a refused run changed the checkpoint it resumes, or left a run directory")


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
             ckpt, "--metrics", metrics, "--steps", "6"], "--checkpoint " + ckpt)
    check(read(metrics) == before and not os.path.exists(os.path.join(away, "metrics.jsonl")),
          "a refused resume changed the run's metrics")
    train_small(away, "--metrics", metrics, "--checkpoint", ckpt, "--resume", ckpt, steps=6)
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


def case_lock():
    run_dir = os.path.join(OUT, "l_run")
    cfg = os.path.join(OUT, "small.json")
    first = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", run_dir, "--steps",
                              "1000000", "--quiet"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, cwd=OUT)
    for _ in range(200):
        if os.path.exists(run_dir + "/metrics.jsonl") and os.path.getsize(
                run_dir + "/metrics.jsonl") > 0:
            break
        time.sleep(0.05)
    try:
        refused(["train", "--config", cfg, "--run-dir", run_dir, "--steps", "5", "--overwrite"],
                "another tierzero process")
        # An output into the running run's directory (its report, written when it ends).
        refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "l_third"), "--steps",
                 "5", "--report", run_dir + "/report.json"], "another tierzero run")
        refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "l_other"), "--steps",
                 "5", "--checkpoint", run_dir + "/checkpoint", "--overwrite"],
                "another tierzero process")
    finally:
        first.send_signal(signal.SIGINT)
        out = first.communicate(timeout=120)[0].decode()
    check(first.returncode == 0, f"the first run ended with {first.returncode}\n{out}")
    ok(["export", run_dir + "/checkpoint", "-o", os.path.join(OUT, "l_w.st")])
    # Every line of the metrics file whole, one writer's.
    for line in open(run_dir + "/metrics.jsonl"):
        json.loads(line)


def case_config_json():
    run_dir = os.path.join(OUT, "c_run")
    os.makedirs(run_dir + "/config.json/x")  # config.json cannot be written
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
             "--steps", "2"], "config")
    check(not os.path.exists(run_dir + "/metrics.jsonl"), "the run trained anyway")
    # A link as the run's config.json (to the user's own config): never written through.
    base = write_config(os.path.join(OUT, "c_base.json"))
    before = read(base)
    linked = os.path.join(OUT, "c_linked")
    os.makedirs(linked)
    os.symlink(base, linked + "/config.json")
    refused(["train", "--config", linked + "/config.json", "--run-dir", linked, "--steps", "2"],
            "symbolic link")
    check(read(base) == before, "the config a link pointed at was rewritten")
    # Someone's config.json in a fresh run directory: listed, not replaced silently.
    other = os.path.join(OUT, "c_other")
    os.makedirs(other)
    with open(other + "/config.json", "w") as f:
        f.write('{"model": {}}')
    refused(["train", "--config", base, "--run-dir", other, "--steps", "2"], "config.json",
            "--overwrite")
    check(read(other + "/config.json") == b'{"model": {}}', "a config.json was replaced")
    # A refused set-up writes nothing: config.json of a resumed run stays as it was.
    run_dir = os.path.join(OUT, "c_resumed")
    train_small(run_dir)
    before = read(run_dir + "/config.json")
    refused(["train", "--config", base, "--run-dir", run_dir, "--steps", "8", "--resume",
             run_dir + "/checkpoint", "--heads", "8"], "n_head")
    refused(["train", "--config", base, "--run-dir", run_dir, "--steps", "8", "--resume",
             run_dir + "/checkpoint", "--plan", os.path.join(OUT, "c_missing.json")])
    check(read(run_dir + "/config.json") == before, "a refused run rewrote config.json")
    # "none" outputs stay "none" in config.json, so starting from it keeps them off.
    written = json.load(open(run_dir + "/config.json"))
    check(written["output"]["html"] == "none" and written["output"]["trace"] == "none",
          f"config.json: {written['output']}")


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


def case_resume_model():
    run_dir = os.path.join(OUT, "m_run")
    train_small(run_dir)
    manifest = read(run_dir + "/checkpoint/manifest.json")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
             "--steps", "8", "--resume", run_dir + "/checkpoint", "--heads", "2"], "n_head",
            "--heads")
    check(read(run_dir + "/checkpoint/manifest.json") == manifest, "the checkpoint changed")


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


    # eval --resume without --data: a run's relative token path is not taken from elsewhere.
    rel = os.path.join(OUT, "rn_rel")
    ok(["train", "--config", cfg, "--data", "rn_tok/a.bin", "--run-dir", rel, "--steps", "2",
        "--quiet"])
    refused(["eval", "--resume", rel + "/checkpoint"], "--data PATH", "relative to where it ran")
    # A run directory given for its checkpoint is said first, everywhere.
    for cmd in (["train", "--config", cfg, "--run-dir", rd, "--resume", rd, "--steps", "100"],
                ["eval", "--resume", rd, "--data", os.path.join(d, "b.bin")],
                ["export", rd, "-o", os.path.join(OUT, "rn.st")]):
        refused(cmd, "is a run directory, not a checkpoint", rd + "/checkpoint")


def case_ranks_agree():
    mpirun, env = mpirun_env()
    if not mpirun:
        return
    cfg = os.path.join(OUT, "small.json")
    for name, extra, needle in [("width", ["--width", "128"], "model.d_model"),
                                ("lr", ["--lr", "0.01"], "train.lr"),
                                ("dtype", ["--dtype", "fp32"], "engine.compute_dtype"),
                                ("run_dir", ["--run-dir", os.path.join(OUT, "a_other")],
                                 "output.run_dir")]:
        run_dir = os.path.join(OUT, "a_" + name)
        base = [TZ, "train", "--config", cfg, "--run-dir", run_dir, "--steps", "3", "--quiet"]
        p = subprocess.run([mpirun, "-np", "1"] + base + [":", "-np", "1"] + base + extra,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, env=env,
                           cwd=OUT)
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0, f"{name}: ranks with different configs ran to exit 0\n{out}")
        check("different configurations" in out and needle in out,
              f"{name}: the error does not name {needle}\n{out}")
        check("MPI_ERR" not in out, f"{name}: an MPI error instead of ours\n{out}")
        check(not os.path.exists(run_dir + "/checkpoint/manifest.json"),
              f"{name}: a checkpoint was written")
    # A node's own NVMe path is its own business: ranks that differ only there run.
    run_dir = os.path.join(OUT, "a_nvme")
    base = [TZ, "train", "--config", cfg, "--run-dir", run_dir, "--steps", "3", "--quiet"]
    for attempt in (1, 2):
        p = subprocess.run([mpirun, "-np", "1"] + base + [":", "-np", "1"] + base +
                           ["--nvme-path", os.path.join(OUT, "a_nvme_other")] +
                           (["--overwrite"] if attempt == 2 else []),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, env=env,
                           cwd=OUT)
        out = p.stdout.decode(errors="replace")
        # (Once, under ctest -j2 beside other MPI jobs, mpirun exited 1 with every rank's work
        # done and no message from any rank or from mpirun: Open MPI's, retried once.)
        if p.returncode == 0 or "error" in out.lower() or "checkpoint: " not in out:
            break
        print(f"  (mpirun status {p.returncode} after a complete run, no message: retried)")
    check(p.returncode == 0, f"ranks differing in nvme_path only: status {p.returncode}\n"
          f"{out[:3000]}\n...\n{out[-1500:]}")
    # One relative path naming different files (each rank in its own directory, as on two
    # machines without a shared file system): the data differs, refused by every rank, no
    # directory left behind.
    for node, text in (("a_node0", "hello world, some text to learn. "),
                       ("a_node1", "other words entirely, not the same! ")):
        os.makedirs(os.path.join(OUT, node))
        with open(os.path.join(OUT, node, "d.txt"), "w") as f:
            f.write(text * 300)
    base = [TZ, "train", "--config", cfg, "--run-dir", "rd", "--text", "d.txt", "--steps", "3",
            "--quiet"]
    p = subprocess.run([mpirun, "-np", "1", "-wdir", os.path.join(OUT, "a_node0")] + base +
                       [":", "-np", "1", "-wdir", os.path.join(OUT, "a_node1")] + base,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, env=env,
                       cwd=OUT)
    out = p.stdout.decode(errors="replace")
    check(p.returncode != 0 and "the ranks read different data" in out,
          f"ranks reading different files under one path:\n{out}")
    for node in ("a_node0", "a_node1"):
        check(sorted(os.listdir(os.path.join(OUT, node))) == ["d.txt"],
              f"{node} keeps {os.listdir(os.path.join(OUT, node))}")
    # A rank that fails alone in its set-up ends the job, and neither it nor the rank ended by
    # the job's SIGTERM leaves a file or a lock behind (Note [A set-up ended by a signal leaves
    # nothing]): rank 1's NVMe directory blocked by a file (nothing is left); rank 0's --plan
    # unreadable (at most empty directories: rank 0 ends first, with rank 1's NVMe directory
    # still in the run directory).
    nvme = os.path.join(OUT, "a_blocked_nvme")
    os.makedirs(nvme)
    open(os.path.join(nvme, "rank1"), "w").close()
    bad_plan = os.path.join(OUT, "a_bad_plan.json")
    with open(bad_plan, "w") as f:
        f.write("{}")
    for name, extra, needle in (("nvme", ["--nvme-path", nvme], "rank 1 of 2: error"),
                                ("plan", ["--plan", bad_plan], "rank 0 of 2: error")):
        run_dir = os.path.join(OUT, "a_alone_" + name)
        p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--config", cfg, "--run-dir",
                            run_dir, "--steps", "3", "--quiet"] + extra,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                           env=env, cwd=OUT)
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and needle in out, f"{name}: a rank failing alone:\n{out}")
        left = [os.path.join(d, f) for d, _, fs in os.walk(run_dir) for f in fs]
        check(not left and (name != "nvme" or not os.path.exists(run_dir)),
              f"{name}: the run directory was left, with {left}\n{out}")
    check(sorted(os.listdir(nvme)) == ["rank1"], f"the NVMe path keeps {os.listdir(nvme)}")
    # Ranks whose checkpoint directories differ (each in its own working directory: machines
    # without a shared file system) are refused before the first step, nothing left behind.
    for node in ("a_wd0", "a_wd1"):
        os.makedirs(os.path.join(OUT, node))
    base = [TZ, "train", "--config", cfg, "--run-dir", "rd", "--steps", "3", "--quiet"]
    p = subprocess.run([mpirun, "-np", "1", "-wdir", os.path.join(OUT, "a_wd0")] + base +
                       [":", "-np", "1", "-wdir", os.path.join(OUT, "a_wd1")] + base,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, env=env,
                       cwd=OUT)
    out = p.stdout.decode(errors="replace")
    check(p.returncode != 0 and "not one directory the ranks share" in out and
          "step     1" not in out, f"ranks not sharing a checkpoint directory:\n{out}")
    for node in ("a_wd0", "a_wd1"):
        check(os.listdir(os.path.join(OUT, node)) == [], f"{node} keeps "
              f"{os.listdir(os.path.join(OUT, node))}")
    # export and eval are one process's jobs: under mpirun they are refused, not run twice.
    for cmd in (["export", os.path.join(OUT, "a_nvme", "checkpoint"), "-o",
                 os.path.join(OUT, "a_export.safetensors")],
                ["eval", "--resume", os.path.join(OUT, "a_nvme", "checkpoint"), "--data",
                 "/dev/null"]):
        p = subprocess.run([mpirun, "-np", "2", TZ] + cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120, env=env, cwd=OUT)
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and "without mpirun" in out, f"{cmd[0]} under mpirun:\n{out}")
    check(not os.path.exists(os.path.join(OUT, "a_export.safetensors")), "an export ran")
    # A save that one rank cannot write leaves no other rank's file behind (Note [A re-save never
    # renames over its manifest's]: an uncommitted save removes its files).
    ck = os.path.join(OUT, "a_ck_blocked")
    os.makedirs(os.path.join(ck, "states-3.w2.rank1.bin"))
    p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--config", cfg, "--run-dir",
                        os.path.join(OUT, "a_ck_run"), "--checkpoint", ck, "--steps", "3",
                        "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120, env=env, cwd=OUT)
    out = p.stdout.decode(errors="replace")
    check(p.returncode != 0 and sorted(os.listdir(ck)) == [".tierzero.lock",
                                                           "states-3.w2.rank1.bin"],
          f"a save one rank could not write left {sorted(os.listdir(ck))}\n{out}")


def case_ranks_faults():
    """Note [A checkpoint after a data error] with two ranks: a token file truncated mid-run, or
    the metrics file failing (its reader gone), stops both ranks between two steps, together:
    the steps trained are saved, the lead says why, no abort; the saved run resumes on both."""
    mpirun, env = mpirun_env()
    if not mpirun:
        return
    cfg = os.path.join(OUT, "small.json")
    tok = os.path.join(OUT, "f_tok.bin")
    data = bytes([7, 0, 200, 0]) * 262144  # 524288 uint16 tokens, 7 and 200
    with open(tok, "wb") as f:
        f.write(data)
    rd = os.path.join(OUT, "f_data")
    base = [mpirun, "-np", "2", TZ, "train", "--config", cfg, "--run-dir", rd, "--data", tok,
            "--vocab", "256", "--quiet"]
    p = subprocess.Popen(base + ["--steps", "1000000"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=OUT, env=env)
    metrics = os.path.join(rd, "metrics.jsonl")
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None and \
            (not os.path.exists(metrics) or read(metrics).count(b"\n") < 4):
        time.sleep(0.05)
    os.truncate(tok, 1000)
    out = p.communicate(timeout=120)[0].decode(errors="replace")
    for bad in ("MPI_ABORT", "MPI_Abort", "Aborted", "terminate called"):
        check(bad not in out, f"two ranks, a token file truncated mid-run: '{bad}'\n{out}")
    check(p.returncode != 0 and "changed while in use" in out and "A checkpoint of step" in out,
          f"two ranks, a token file truncated mid-run: status {p.returncode}\n{out}")
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          f"two ranks, a token file truncated mid-run: nothing saved\n{out}")
    check(out.count("changed while in use") == 1, f"the error said more than once:\n{out}")
    saved = json.load(open(os.path.join(rd, "checkpoint", "manifest.json")))["step"]
    with open(tok, "wb") as f:
        f.write(data)
    p = subprocess.run(base + ["--resume", rd + "/checkpoint", "--steps", str(saved + 3)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180, cwd=OUT,
                       env=env)
    out = p.stdout.decode(errors="replace")
    check(p.returncode == 0 and f"at step {saved}" in out, f"resuming the saved run:\n{out}")
    # The lead's metrics file failing mid-run: the other rank is on its way to the next step.
    mfifo = os.path.join(OUT, "f_mfifo")
    os.mkfifo(mfifo)
    reader = os.open(mfifo, os.O_RDONLY | os.O_NONBLOCK)
    rd = os.path.join(OUT, "f_mfail")
    p = subprocess.Popen([mpirun, "-np", "2", TZ, "train", "--config", cfg, "--run-dir", rd,
                          "--metrics", mfifo, "--steps", "1000000", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT, env=env)
    read_then_go(reader, 4, p)
    out = p.communicate(timeout=120)[0].decode(errors="replace")
    check(p.returncode != 0 and "metrics file" in out and "A checkpoint of step" in out and
          "MPI_ABORT" not in out,
          f"two ranks, a metrics file failing mid-run: status {p.returncode}\n{out}")
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          f"two ranks, a metrics file failing mid-run: nothing saved\n{out}")


def case_readers():
    d = os.path.join(OUT, "d_dir")
    os.makedirs(d)
    sparse = os.path.join(OUT, "d_sparse")
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    deep = os.path.join(OUT, "d_deep.json")
    with open(deep, "w") as f:
        f.write('{"model": {"n_layer": ' + "[" * 100000 + "]" * 100000 + "}}")
    dup = os.path.join(OUT, "d_dup.json")
    with open(dup, "w") as f:
        f.write('{"train": {"lr": 0.001, "steps": 3, "lr": 5}}')
    rd = os.path.join(OUT, "d_run")
    for bad, needle in [(d, "directory"), ("/dev/zero", "at most"), (sparse, "at most")]:
        refused(["train", "--config", bad, "--run-dir", rd], needle)
        refused(["train", "--text", bad, "--run-dir", rd], needle)
        refused(["report", bad], needle)
        refused(["plan", "--rates", bad], needle)
        refused(["plan", "--trace", bad], needle)
        refused(["train", "--plan", bad, "--run-dir", rd, "--config",
                 os.path.join(OUT, "small.json")], needle)
        refused(["export", os.path.join(OUT, "x_ckpt"), "--config", bad, "-o",
                 os.path.join(OUT, "d_w.st")], needle)
    refused(["train", "--init-from", d, "--run-dir", rd], "directory")
    refused(["train", "--resume", d, "--run-dir", rd])
    refused(["train", "--config", deep, "--run-dir", rd], "deeper than 64")
    refused(["train", "--config", dup, "--run-dir", rd], '"lr" twice')
    check(not os.path.exists(os.path.join(rd, "metrics.jsonl")), "a refused run trained")
    # A refused run leaves no trace: the directories it made are gone, and a directory of the
    # user's holds no lock file of it.
    fresh = os.path.join(OUT, "d_new", "deep", "run")
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", fresh, "--data",
             os.path.join(OUT, "d_missing.bin")], "no token file")
    check(not os.path.exists(os.path.join(OUT, "d_new")), "a refused run left its directories")
    users = os.path.join(OUT, "d_users")
    os.makedirs(users)
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", users, "--data",
             os.path.join(OUT, "d_missing.bin")], "no token file")
    check(os.listdir(users) == [], f"a refused run left {os.listdir(users)}")


def case_setup_signal():
    fifo = os.path.join(OUT, "g_fifo")
    os.mkfifo(fifo)
    ck = os.path.join(OUT, "g_ckpt")
    os.makedirs(ck)
    os.mkfifo(ck + "/manifest.json")
    cfg = os.path.join(OUT, "small.json")
    n = 0
    for extra in (["--text", fifo], ["--config", fifo], ["--plan", fifo, "--config", cfg],
                  ["--resume", ck, "--config", cfg], ["--init-from", fifo, "--config", cfg]):
        for sig in (signal.SIGINT, signal.SIGTERM):
            n += 1
            p = subprocess.Popen([TZ, "train", "--run-dir", os.path.join(OUT, f"g_run{n}")] +
                                 extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT)
            time.sleep(0.7)
            p.send_signal(sig)
            try:
                out = p.communicate(timeout=5)[0].decode()
            except subprocess.TimeoutExpired:
                p.kill()
                raise Failure(f"{extra}: {sig.name} during set-up did not end the process")
            # Either refused at once (a FIFO where a regular file must be) or ended by the
            # signal with a message.
            check(p.returncode in (1, 128 + sig),
                  f"{extra}: status {p.returncode} after {sig.name}\n{out}")
            check("error:" in out or "set-up" in out, f"{extra}: no message\n{out}")
    # What the set-up made goes with it, however the run directory is spelled (Note [A set-up
    # ended by a signal leaves nothing]).
    for spelled in ("./g_dot/run", "g_plain//run/"):
        p = subprocess.Popen([TZ, "train", "--config", cfg, "--text", fifo, "--run-dir", spelled],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT)
        time.sleep(0.7)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=10)[0].decode(errors="replace")
        top = os.path.join(OUT, spelled.lstrip("./").split("/")[0])
        check(not os.path.exists(top), f"--run-dir {spelled}: a signal in the set-up left "
              f"{[os.path.join(d, f) for d, ds, fs in os.walk(top) for f in ds + fs]}\n{out}")


def start_long_run(name, *extra, console=subprocess.DEVNULL, **kw):
    """A run of a million steps on the small config in OUT/name, to be stopped by a signal."""
    cfg = os.path.join(OUT, "small.json")
    return subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", os.path.join(OUT, name),
                             "--steps", "1000000"] + list(extra), stdout=console,
                            stderr=subprocess.STDOUT if console == subprocess.PIPE
                            else subprocess.DEVNULL, cwd=OUT, **kw)


def case_run_signals():
    """A stop the run cannot miss: its stdout's reader gone (`| head`, a `| tee` ended by the same
    Ctrl-C) still saves a checkpoint and exits 0; a closed stdout prints nowhere, not into the
    run's files; a second signal 3 s after the first ends a run blocked where no flag reaches it
    (a FIFO output whose reader does not read) with 128 + the signal and no partial file; an
    interrupted export leaves no temporary file; a stop at an evaluation step evaluates it."""
    cfg = os.path.join(OUT, "small.json")
    rd = os.path.join(OUT, "v_pipe")
    p = start_long_run("v_pipe", "--log-every", "1", console=subprocess.PIPE)
    for _ in range(3):
        p.stdout.readline()
    p.stdout.close()  # the reader is gone
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise Failure("a run whose stdout reader left did not stop after SIGINT")
    check(p.returncode == 0, f"stdout's reader gone, then SIGINT: status {p.returncode}")
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          "stdout's reader gone, then SIGINT: no checkpoint saved")
    # SIGHUP (an ssh session dropped) stops the run as SIGTERM does: a checkpoint, status 0.
    rd = os.path.join(OUT, "v_hup")
    p = start_long_run("v_hup", "--quiet")
    time.sleep(2)
    p.send_signal(signal.SIGHUP)
    p.wait(timeout=60)
    check(p.returncode == 0 and os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          f"SIGHUP: status {p.returncode}, checkpoint saved: "
          f"{os.path.exists(os.path.join(rd, 'checkpoint', 'manifest.json'))}")
    # Its console a pipe nobody reads (`2>&1 | less` left alone): the run blocks printing; the
    # signals' own messages must not block too, so a second signal still ends it.
    p = start_long_run("v_console", "--log-every", "1", console=subprocess.PIPE)
    time.sleep(4)  # 64 KiB of step lines fill the pipe
    p.send_signal(signal.SIGTERM)
    time.sleep(3.5)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        raise Failure("a run blocked on a full console pipe did not end on a second SIGTERM")
    p.stdout.close()
    # With --checkpoint none a stop says it saves nothing, and saves nothing.
    p = start_long_run("v_nockpt", "--checkpoint", "none", "--quiet", console=subprocess.PIPE)
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=60)[0].decode(errors="replace")
    check(p.returncode == 0 and "--checkpoint none: nothing is saved" in out and
          "saving a checkpoint" not in out, f"--checkpoint none, then SIGINT:\n{out}")
    # Under nohup (SIGHUP ignored from the start) SIGHUP stays ignored.
    p = start_long_run("v_nohup", "--quiet",
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    time.sleep(2)
    p.send_signal(signal.SIGHUP)
    time.sleep(1)
    check(p.poll() is None, "SIGHUP stopped a run started ignoring it (nohup)")
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    check(p.returncode == 0, f"nohup run, then SIGTERM: status {p.returncode}")
    rd = os.path.join(OUT, "v_closed")
    q = subprocess.run([TZ, "train", "--config", cfg, "--run-dir", rd], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=OUT, timeout=120,
                       preexec_fn=lambda: os.close(1))
    check(q.returncode == 0, f"stdout closed: status {q.returncode}")
    check(os.path.getsize(os.path.join(rd, ".tierzero.lock")) == 0,
          "stdout closed: the console went into the run's lock file")
    fifo = os.path.join(OUT, "v_fifo")
    os.mkfifo(fifo)
    holder = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    try:
        rd = os.path.join(OUT, "v_blocked")
        p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--metrics", fifo,
                              "--steps", "1000000", "--quiet"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, cwd=OUT)
        time.sleep(4)  # the pipe fills
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)  # the same burst: still only a request
        time.sleep(3.5)
        check(p.poll() is None or p.returncode == 0, "a burst of two signals ended the run")
        p.send_signal(signal.SIGTERM)
        try:
            out = p.communicate(timeout=20)[0].decode()
        except subprocess.TimeoutExpired:
            p.kill()
            raise Failure("a second SIGTERM 3 s later did not end a run blocked on a FIFO")
        check(p.returncode in (0, 128 + signal.SIGTERM), f"status {p.returncode}\n{out}")
        check(not [f for f in os.listdir(rd) if f.endswith(".tmp")], "a temporary file left")
    finally:
        os.close(holder)
    big = os.path.join(OUT, "v_big")
    ok(["train", "--config", cfg, "--run-dir", big, "--layers", "8", "--width", "512",
        "--heads", "8", "--host-budget", "512MiB", "--device-budget", "64MiB", "--nvme-budget", "0",
        "--steps", "1"],
       timeout=300)
    os.makedirs(os.path.join(OUT, "v_exp"))
    for sig in (signal.SIGINT, signal.SIGTERM):
        p = subprocess.Popen([TZ, "export", big + "/checkpoint", "-o",
                              os.path.join(OUT, "v_exp", "m.st")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=OUT)
        time.sleep(0.3)
        p.send_signal(sig)
        p.wait(timeout=60)
        left = [f for f in os.listdir(os.path.join(OUT, "v_exp")) if f.endswith(".tmp")]
        check(not left, f"an export ended by {sig.name} left {left}")
    # A plan stopped while it calibrates leaves nothing where it ran (its calibration run, the
    # run directory it made for it).
    cwd = os.path.join(OUT, "v_plan")
    os.makedirs(cwd)
    p = subprocess.Popen([TZ, "plan", "--calibrate", "--no-advice"], cwd=cwd,
                         env=dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, "v_rates.json")),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    check(os.listdir(cwd) == [], f"a plan stopped while it calibrated left {os.listdir(cwd)}")
    # Stopped at a step on the evaluation schedule (every step is, here): that step's evaluation
    # is in the metrics before the save, so the resumed run's metrics miss none.
    p = start_long_run("v_eval", "--eval-every", "1")
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    check(p.wait(timeout=60) == 0, "a run stopped at an evaluation step")
    rows = [json.loads(line) for line in open(os.path.join(OUT, "v_eval", "metrics.jsonl"))]
    last = max(m["step"] for m in rows if "loss" in m)
    check(any(m["step"] == last and "val_loss" in m for m in rows),
          f"the evaluation of step {last}, where the run stopped, is missing")


def case_late_faults():
    """Faults a run used to meet late: a config value its report cannot hold (refused before the
    run), a finished run resumed in place (refused, its report intact), a checkpoint directory
    holding another program's manifest.json (refused, even with --overwrite: nothing removed), a
    set-up failing after config.json was written (the directory keeps no trace, the corrected
    command runs), and a token file changing or the metrics file failing mid-run (the steps
    trained so far saved)."""
    cfg = os.path.join(OUT, "small.json")
    rope = write_config(os.path.join(OUT, "w_rope.json"), model={"n_layer": 2, "d_model": 64,
                                                                   "n_head": 4, "rope_theta": 1e19})
    refused(["train", "--config", rope, "--run-dir", os.path.join(OUT, "w_rope")], "rope_theta")
    check(not os.path.exists(os.path.join(OUT, "w_rope")), "a refused config left a run directory")
    rd = os.path.join(OUT, "w_done")
    train_small(rd)
    before = read(os.path.join(rd, "report.json"))
    refused(["train", "--config", cfg, "--run-dir", rd, "--resume", rd + "/checkpoint", "--steps",
             "6"], "nothing is left to train")
    check(read(os.path.join(rd, "report.json")) == before, "a finished run's report was rewritten")
    user = os.path.join(OUT, "w_user")
    os.makedirs(user)
    with open(os.path.join(user, "manifest.json"), "w") as f:
        f.write('{"name": "my web app"}')
    with open(os.path.join(user, "states-1.w1.rank0.bin"), "w") as f:
        f.write("mine")
    for extra in ([], ["--overwrite"]):
        refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_u"), "--checkpoint",
                 user] + extra, "not a tierzero checkpoint")
    # Text that is no JSON at all is not tierzero's either.
    user2 = os.path.join(OUT, "w_user2")
    os.makedirs(user2)
    with open(os.path.join(user2, "manifest.json"), "w") as f:
        f.write("my notes, not JSON")
    refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_u2"), "--checkpoint",
             user2, "--overwrite"], "not a tierzero checkpoint")
    check(read(os.path.join(user2, "manifest.json")) == b"my notes, not JSON",
          "a user's manifest.json that is not JSON was removed")
    check(sorted(os.listdir(user)) == ["manifest.json", "states-1.w1.rank0.bin"] and
          read(os.path.join(user, "manifest.json")) == b'{"name": "my web app"}',
          "a user's directory with a manifest.json was touched")
    fifo = os.path.join(OUT, "w_fifo")
    os.mkfifo(fifo)
    rd = os.path.join(OUT, "w_setup")
    refused(["train", "--config", cfg, "--run-dir", rd, "--metrics", fifo], "no reader")
    check(not os.path.exists(os.path.join(rd, "config.json")),
          "a run that failed its set-up left its config.json")
    ok(["train", "--config", cfg, "--run-dir", rd])
    tok = os.path.join(OUT, "w_tok.bin")
    with open(tok, "wb") as f:
        f.write(bytes([7, 0, 200, 0]) * 262144)  # 524288 uint16 tokens, 7 and 200
    rd = os.path.join(OUT, "w_data")
    p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--data", tok, "--vocab",
                          "256", "--steps", "1000000", "--quiet"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=OUT)
    time.sleep(3)
    os.truncate(tok, 1000)
    out = p.communicate(timeout=60)[0].decode()
    check(p.returncode == 1 and "changed while in use" in out and "A checkpoint of step" in out,
          f"a token file truncated mid-run: status {p.returncode}\n{out}")
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          "a token file truncated mid-run: nothing saved")
    # The metrics file failing mid-run (its reader gone: EPIPE, as a full disk's ENOSPC): the
    # steps trained so far saved, the error naming the file.
    mfifo = os.path.join(OUT, "w_mfifo")
    os.mkfifo(mfifo)
    reader = os.open(mfifo, os.O_RDONLY | os.O_NONBLOCK)
    rd = os.path.join(OUT, "w_mfail")
    p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--metrics", mfifo,
                          "--steps", "1000000", "--quiet"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=OUT)
    read_then_go(reader, 4, p)
    out = p.communicate(timeout=60)[0].decode()
    check(p.returncode == 1 and "metrics file" in out and "A checkpoint of step" in out,
          f"a metrics file failing mid-run: status {p.returncode}\n{out}")
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          "a metrics file failing mid-run: nothing saved")
    # Empty option values (an unset shell variable) are not the default; "none" is no name for
    # the metrics; weights holding NaN are refused before a run starts.
    for flag in ("--config", "--resume", "--init-from", "--data", "--run-dir"):
        refused(["train", flag, ""], "empty")
    refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_none"), "--metrics",
             "none"], "always writes its metrics")
    check(not os.path.exists(os.path.join(OUT, "none")), "a metrics file named none")
    rd = os.path.join(OUT, "w_nan")
    train_small(rd)
    st = os.path.join(OUT, "w_nan.st")
    ok(["export", rd + "/checkpoint", "-o", st])
    data = bytearray(read(st))
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    at = 8 + n + header[name]["data_offsets"][0]
    data[at:at + 4] = struct.pack("<f", float("nan")) if header[name]["dtype"] == "F32" else \
        b"\xc0\x7f\xc0\x7f"
    with open(st, "wb") as f:
        f.write(data)
    refused(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_nanrun"), "--init-from",
             st], "NaN or infinite", name)
    check(not os.path.exists(os.path.join(OUT, "w_nanrun")), "a refused init left a run directory")
    # Two runs started together into one metrics file outside their run directories: one runs,
    # the other is refused; every line of the file parses.
    shared = os.path.join(OUT, "w_shared.jsonl")
    ps = [subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", os.path.join(OUT, f"w_c{i}"),
                            "--metrics", shared, "--steps", "200", "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT)
          for i in (1, 2)]
    outs = [p.communicate(timeout=120)[0].decode() for p in ps]
    codes = sorted(p.returncode for p in ps)
    check(codes == [0, 1], f"two runs into one metrics file: statuses {codes}\n" + "\n".join(outs))
    for line in open(shared):
        json.loads(line)
    # Two runs naming one report: the one that ends last does not replace the other's (Note [An
    # output another run wrote meanwhile]); it says so, its checkpoint saved.
    report = os.path.join(OUT, "w_shared_report.json")
    long_run = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir",
                                 os.path.join(OUT, "w_r1"), "--report", report, "--steps", "400",
                                 "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=OUT)
    time.sleep(0.5)
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_r2"), "--report", report,
        "--steps", "2", "--quiet"])
    theirs = read(report)
    out = long_run.communicate(timeout=120)[0].decode(errors="replace")
    if long_run.returncode == 0:
        print("  (the long run ended before the short one started: not checked)")
    else:
        check(read(report) == theirs and "written by another process" in out and
              os.path.exists(os.path.join(OUT, "w_r1", "checkpoint", "manifest.json")),
              f"a report another run wrote meanwhile:\n{out}")


    # The report's directory gone at the end (Note [A report kept aside]): the report is kept in
    # a new file of the run directory, over nothing, and renders.
    rdir = os.path.join(OUT, "w_rdir")
    os.makedirs(rdir)
    rd = os.path.join(OUT, "w_aside")
    p = subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", rd, "--report",
                          os.path.join(rdir, "r.json"), "--steps", "100000", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT)
    time.sleep(2)
    shutil.rmtree(rdir)
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=60)[0].decode(errors="replace")
    check(p.returncode == 1 and "the report is kept in" in out and
          os.path.exists(os.path.join(rd, "report.json")),
          f"a report whose directory went: {os.listdir(rd)}\n{out}")
    ok(["report", os.path.join(rd, "report.json")])


def case_models_in():
    """A model brought from a Hugging Face directory: a context longer than its positions is
    refused (never silently cut); a run it seeded resumes and evaluates without it (moved away);
    --init-from with --resume is refused; a FIFO or directory for one of its files is refused at
    once; eval's window is the context a sliding window is checked against."""
    tok = os.path.join(OUT, "mi_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<20480H", *[(i * 7) % 256 for i in range(20480)]))
    base = os.path.join(OUT, "mi_base")
    ok(["train", "--arch", "llama", "--layers", "2", "--width", "64", "--heads", "4", "--vocab",
        "256", "--seq-len", "32", "--data", tok, "--steps", "2", "--run-dir", base, "--quiet"])
    hf = os.path.join(OUT, "mi_hf")
    ok(["export", base + "/checkpoint", "--format", "hf", "-o", hf])
    refused(["train", "--init-from", hf, "--data", tok, "--seq-len", "64", "--steps", "1",
             "--run-dir", os.path.join(OUT, "mi_long"), "--quiet"], "longer than the 32 positions")
    check(not os.path.exists(os.path.join(OUT, "mi_long")), "a refused context left a run")
    rd = os.path.join(OUT, "mi_run")
    ok(["train", "--init-from", hf, "--data", tok, "--steps", "2", "--run-dir", rd, "--quiet"])
    refused(["train", "--config", rd + "/config.json", "--resume", rd + "/checkpoint",
             "--init-from", hf, "--steps", "4", "--run-dir", rd, "--quiet"], "--init-from",
            "--resume")
    # A checkpoint or an empty directory given to --init-from is said to be what it is, before
    # anything is built.
    refused(["eval", "--init-from", base + "/checkpoint", "--data", tok], "--resume")
    os.makedirs(os.path.join(OUT, "mi_empty"))
    refused(["train", "--init-from", os.path.join(OUT, "mi_empty"), "--data", tok, "--run-dir",
             os.path.join(OUT, "mi_erun")], "without config.json")
    # A model directory whose weights are a link to a file elsewhere (the hub cache's layout):
    # no output is written over the file it links to, even with --overwrite.
    linked = os.path.join(OUT, "mi_linked")
    os.makedirs(linked)
    shutil.copy(os.path.join(hf, "config.json"), linked)
    blob = os.path.join(OUT, "mi_blob")
    shutil.copy(os.path.join(hf, "model.safetensors"), blob)
    os.symlink(blob, os.path.join(linked, "model.safetensors"))
    weights = read(blob)
    for flag in ("--report", "--metrics"):
        refused(["train", "--init-from", linked, "--data", tok, "--steps", "1", "--run-dir",
                 os.path.join(OUT, "mi_lrun"), flag, blob, "--overwrite", "--quiet"],
                "the run's input --init-from")
    check(read(blob) == weights, "an output was written over the weights a model directory links")
    moved = hf + ".moved"
    os.rename(hf, moved)
    try:
        out = ok(["eval", "--resume", rd + "/checkpoint", "--data", tok])
        check("mean loss" in out, f"eval of a run seeded from a directory:\n{out}")
        ok(["train", "--config", rd + "/config.json", "--resume", rd + "/checkpoint", "--steps",
            "4", "--run-dir", rd, "--quiet"])
    finally:
        os.rename(moved, hf)
    for name, make in (("model.safetensors", os.mkfifo), ("model.safetensors", os.mkdir),
                       ("config.json", os.mkfifo)):
        bad = os.path.join(OUT, "mi_bad")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(hf, bad)
        os.remove(os.path.join(bad, name))
        make(os.path.join(bad, name))
        refused(["eval", "--init-from", bad, "--data", tok], name, timeout=20)
    # A config.json that disagrees with its weights is refused from the headers, before the
    # machine-sized budgets are taken (a 65536 x 2048 model over 256 x 64 weights).
    for field, value, needle in (("vocab_size", 65536, "embed_tokens"),
                                 ("num_hidden_layers", 3, "2 blocks")):
        bad = os.path.join(OUT, "mi_cfg")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(hf, bad)
        with open(os.path.join(bad, "config.json")) as f:
            c = json.load(f)
        c[field] = value
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(c, f)
        refused(["eval", "--init-from", bad, "--data", tok], "disagree", needle, timeout=20)
    # Nothing written inside the model directory, the checkpoint included; a run directory
    # given as a model is pointed to --resume; one data source; a checkpoint is a directory.
    refused(["train", "--init-from", hf, "--data", tok, "--steps", "1", "--run-dir",
             os.path.join(OUT, "mi_ck"), "--checkpoint", hf + "/sub"], "inside the model directory")
    check(sorted(os.listdir(hf)) == ["config.json", "model.safetensors"], "the model dir changed")
    refused(["eval", "--init-from", base, "--data", tok], "tierzero run directory", "--resume")
    refused(["train", "--text", tok, "--data", tok, "--run-dir", os.path.join(OUT, "mi_two")],
            "one data source")
    refused(["eval", "--resume", base + "/checkpoint/manifest.json", "--data", tok],
            "not a checkpoint", base + "/checkpoint")
    sw = os.path.join(OUT, "mi_sw")
    shutil.copytree(hf, sw)
    with open(os.path.join(sw, "config.json")) as f:
        c = json.load(f)
    c["architectures"], c["sliding_window"] = ["MistralForCausalLM"], 16
    with open(os.path.join(sw, "config.json"), "w") as f:
        json.dump(c, f)
    ok(["eval", "--init-from", sw, "--data", tok, "--seq-len", "16"])
    refused(["eval", "--init-from", sw, "--data", tok], "sliding_window", "--seq-len 16")
    # An export --format hf that fails part way (room for the shards, not the index) is undone,
    # so the retry is not refused for a directory holding files. Needs a small file system to
    # fill (root's tmpfs); skipped where none can be mounted.
    small = os.path.join(OUT, "mi_small")
    os.makedirs(small)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", small],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        try:
            with open(os.path.join(small, "filler"), "wb") as f:
                f.write(bytes(163840))
            target = os.path.join(small, "m")
            args = ["export", base + "/checkpoint", "--format", "hf", "-o", target, "--dtype",
                    "bf16", "--max-shard-size", "100KB"]
            refused(args, "undone")
            check(not os.path.exists(target), f"a failed export left {os.listdir(small)}")
            os.remove(os.path.join(small, "filler"))
            ok(args)
        finally:
            subprocess.run(["umount", small])


def case_asked_for():
    """What a run asks for is what it gets (Note [Asked for, not different from the default]):
    a value equal to the default still counts, comments do not hide a field, a flag naming the
    architecture the config has changes nothing, a path that reads as a number is a path, and a
    setting nothing would read is refused instead of ignored."""
    cfg = os.path.join(OUT, "small.json")
    small = ["--layers", "1", "--width", "32", "--heads", "2", "--quiet"]
    src = os.path.join(OUT, "y_src")
    ok(["train", "--config", cfg, "--run-dir", src, "--seq-len", "64"] + small)
    hf = os.path.join(OUT, "y_hf")
    ok(["export", src + "/checkpoint", "--format", "hf", "-o", hf])
    text = os.path.join(OUT, "y_text.txt")
    with open(text, "w") as f:
        f.write("some text to learn from, over and over. " * 200)
    commented = os.path.join(OUT, "y_commented.json")
    with open(commented, "w") as f:
        f.write('// the context asked for\n{"model": {"seq_len": 16}}\n')
    rd = os.path.join(OUT, "y_run1")
    ok(["train", "--config", commented, "--init-from", hf, "--text", text, "--steps", "1",
        "--run-dir", rd, "--quiet"])
    check(json.load(open(rd + "/config.json"))["model"]["seq_len"] == 16,
          "a commented config's seq_len was replaced by the model directory's")
    out = ok(["train", "--init-from", hf, "--text", text, "--steps", "1", "--run-dir",
              os.path.join(OUT, "y_run2"), "--device-budget", "12MiB", "--host-budget", "16MiB"])
    check("budgets: device 12.0 MiB, host 16.0 MiB" in out, f"budgets given were resized:\n{out}")
    refused(["train", "--init-from", hf, "--text", text, "--steps", "1", "--run-dir",
             os.path.join(OUT, "y_run3"), "--layers", "5", "--width", "192", "--heads", "6"],
            "sets its own shape")
    llama = write_config(os.path.join(OUT, "y_llama.json"),
                         model={"arch": "llama", "tie_embeddings": True, "attention_bias": True})
    rd = os.path.join(OUT, "y_run4")
    ok(["train", "--config", llama, "--run-dir", rd, "--steps", "1", "--arch", "llama"] + small)
    m = json.load(open(rd + "/config.json"))["model"]
    check(m["tie_embeddings"] and m["attention_bias"], f"--arch llama reset the config's: {m}")
    # A path that reads as a number; an option where a value should be.
    ok(["train", "--config", cfg, "--run-dir", "123", "--steps", "1"] + small)
    check(os.path.isdir(os.path.join(OUT, "123")), "--run-dir 123 was not a directory 123")
    refused(["train", "--config", cfg, "--run-dir", "--overwrite"] + small, "needs a value")
    check(not os.path.exists(os.path.join(OUT, "--overwrite")), "a directory named --overwrite")
    # Settings nothing reads.
    stray = write_config(os.path.join(OUT, "y_stray.json"), data={"text_path": text})
    refused(["train", "--config", stray, "--run-dir", os.path.join(OUT, "y_run5")],
            "data.text_path", "data.kind")
    ok(["train", "--config", stray, "--text", text, "--steps", "1", "--run-dir",
        os.path.join(OUT, "y_run6")] + small)
    slow = write_config(os.path.join(OUT, "y_slow.json"), engine={"host_link_bandwidth": 1e-300})
    refused(["train", "--config", slow, "--run-dir", os.path.join(OUT, "y_run7")],
            "host_link_bandwidth")
    rc, out = run(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "y_run8"), "--steps",
                   "1"] + small, env=dict(os.environ, TZ_GPT_FUSED_ATTENTION="no"))
    check(rc == 1 and "TZ_GPT_FUSED_ATTENTION" in out, f"TZ_GPT_FUSED_ATTENTION=no:\n{out}")
    # (It fails at the model's first use, the step-0 evaluation, after the set-up: a run that
    # trained nothing leaves nothing, and the corrected command runs.)
    check(not os.path.exists(os.path.join(OUT, "y_run8")),
          "a run that trained nothing left its run directory")
    ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "y_run8"), "--steps", "1"] + small)
    # An export's config must be its checkpoint's model's.
    other = json.load(open(src + "/config.json"))
    other["model"]["n_head"] = 4
    with open(os.path.join(OUT, "y_h4.json"), "w") as f:
        json.dump(other, f)
    refused(["export", src + "/checkpoint", "--config", os.path.join(OUT, "y_h4.json"),
             "--format", "hf", "-o", os.path.join(OUT, "y_out")], "model.n_head")
    check(not os.path.exists(os.path.join(OUT, "y_out")), "a refused export wrote its directory")
    refused(["export", src + "/checkpoint", "-o", os.path.join(OUT, "y.safetensors"),
             "--max-shard-size", "1"], "--format hf")
    refused(["export", src + "/checkpoint", "-o"], "-o needs a value")


def case_ranges():
    cfg = os.path.join(OUT, "small.json")
    rd = os.path.join(OUT, "x_run")
    for flag in ("--device-budget", "--host-budget", "--nvme-budget"):
        refused(["train", "--config", cfg, "--run-dir", rd, flag, str(2**64 - 1)], "1 EiB")
        refused(["plan", "--config", cfg, flag, str(2**64 - 1)], "1 EiB")
    big = write_config(os.path.join(OUT, "x_chunk.json"), engine={"chunk_elems": 2**64 - 1})
    refused(["train", "--config", big, "--run-dir", rd], "chunk_elems")
    big2 = write_config(os.path.join(OUT, "x_chunk2.json"), engine={"chunk_elems": 2**62})
    refused(["train", "--config", big2, "--run-dir", rd], "chunk_elems")
    # A micro-batch whose token arrays alone would not fit in memory; a vocabulary the task's
    # tokens do not fit (both found before a run could replace another's files).
    refused(["train", "--config", cfg, "--run-dir", rd, "--batch-size", "1048576", "--seq-len",
             "65536"], "2^24 tokens")
    refused(["train", "--config", cfg, "--run-dir", rd, "--vocab", "5"], "model.vocab")
    refused(["eval", "--init-from", os.path.join(OUT, "missing.st"), "--data", "/dev/null",
             "--batch-size", "1048576"])
    for rates in ({"cpu_adam_params_per_s": 1e300}, {"h2d_bytes_per_s": 1e-300},
                  {"comm_latency_s": 1e30}, {"nvme_read_bytes_per_s": -1}):
        path = os.path.join(OUT, "x_rates.json")
        with open(path, "w") as f:
            json.dump(rates, f)
        out = refused(["plan", "--config", cfg, "--rates", path], list(rates)[0])
        check("nan" not in out.lower(), f"a plan of NaN: {out}")
    train_small(os.path.join(OUT, "x_ok"))
    report = json.load(open(os.path.join(OUT, "x_ok/report.json")))
    for value in (-5, 1e300):
        report["tiers"]["host"]["used"] = value
        path = os.path.join(OUT, "x_report.json")
        with open(path, "w") as f:
            json.dump(report, f)
        refused(["report", path, "-o", os.path.join(OUT, "x.html")], "tiers.host.used")
    check(not os.path.exists(os.path.join(OUT, "x.html")), "a page of a bad report was written")
    # A report whose profiled events cannot be traced replaces no page: both outputs are
    # rendered before either is written.
    report = json.load(open(os.path.join(OUT, "x_ok/report.json")))
    if report.get("profile", {}).get("events"):
        report["profile"]["events"][0]["lane"] = 5000
        path = os.path.join(OUT, "x_report_events.json")
        with open(path, "w") as f:
            json.dump(report, f)
        page = os.path.join(OUT, "x_users_page.html")
        with open(page, "w") as f:
            f.write("my page")
        refused(["report", path, "-o", page, "--trace", os.path.join(OUT, "x_t.json")], "lane")
        check(read(page) == b"my page", "a report that could not be traced replaced the page")


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
    check(rc == 0 and "use more ranks\n" in out, f"a plan's failure, cut:\n{out}")
    # A --rates FILE is written whatever HOME is.
    mine = os.path.join(OUT, "g_mine_rates.json")
    env = dict(os.environ, HOME=os.path.join(OUT, "g_no_home"), XDG_CACHE_HOME="")
    env.pop("TZ_RATES_FILE", None)
    ok(["plan", "--config", cfg, "--device", "host", "--no-advice", "--rates", mine,
        "--calibrate"], env=env, timeout=300)
    check(os.path.exists(mine), "plan --rates FILE --calibrate did not write FILE")
    # A home that does not exist gets no cache made in it.
    missing = os.path.join(OUT, "g_no_home")
    env = dict(os.environ, HOME=missing, XDG_CACHE_HOME="")
    env.pop("TZ_RATES_FILE", None)
    out = ok(["plan", "--config", cfg, "--device", "host", "--no-advice"], env=env, timeout=300)
    check(not os.path.exists(missing) and "not cached" in out,
          f"a plan made a cache in a home that does not exist:\n{out}")


def case_export_paths():
    run_dir = os.path.join(OUT, "p_run")
    train_small(run_dir)
    ok(["export", run_dir + "/checkpoint/", "-o", os.path.join(OUT, "p_1.st")])
    ok(["export", ".", "-o", os.path.join(OUT, "p_2.st")], cwd=run_dir + "/checkpoint")
    ok(["export", "checkpoint/.", "-o", os.path.join(OUT, "p_3.st")], cwd=run_dir)
    check(read(os.path.join(OUT, "p_1.st")) == read(os.path.join(OUT, "p_2.st")),
          "the exports differ")
    # The export records its model (Note [A safetensors file that records its model]): --init-from
    # it takes that model, and refuses a shape that is not it (another --heads: the same tensors).
    tok = os.path.join(OUT, "p_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<4000H", *[(i * 5) % 14 for i in range(4000)]))
    st = os.path.join(OUT, "p_1.st")
    refused(["eval", "--init-from", st, "--data", tok, "--heads", "2"], "model.n_head",
            "records a model")
    cfg = os.path.join(OUT, "small.json")
    mean = [line for line in ok(["eval", "--init-from", st, "--data", tok]).splitlines()
            if "mean loss" in line]
    same = [line for line in ok(["eval", "--init-from", st, "--data", tok, "--config", cfg])
            .splitlines() if "mean loss" in line]
    check(mean and same and mean[0].split("|")[0] == same[0].split("|")[0],
          f"eval of an export without its config: {mean} against {same}")
    # An output whose directory is missing is refused before any work, naming the directory.
    missing = os.path.join(OUT, "p_missing", "x.st")
    refused(["export", run_dir + "/checkpoint", "-o", missing], "its directory")
    refused(["report", run_dir + "/report.json", "-o", missing], "its directory")


def case_output():
    cfg = os.path.join(OUT, "small.json")
    out = ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "u_1"), "--steps",
              "200"])
    lines = [l for l in out.splitlines() if l.startswith("step ")]
    # The first step, then every 10th (the default: about 20 lines), the last among them.
    check(len(lines) == 21 and lines[-1].startswith("step   200/200"),
          f"{len(lines)} step lines by default for 200 steps:\n" + "\n".join(lines[:5]))
    out = ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "u_2"), "--steps",
              "200", "--log-every", "50"])
    lines = [l.split("|")[0].strip() for l in out.splitlines() if l.startswith("step ")]
    check(lines == ["step     1/200", "step    50/200", "step   100/200", "step   150/200",
                    "step   200/200"], f"--log-every 50: {lines}")
    check("elapsed" in out, "no elapsed time on the step lines")
    # The placement summary's tier lines are indented under it.
    head = out.split("eval")[0].splitlines()
    for tier in ("device:", "host:", "nvme:"):
        check(any(l.startswith("    " + tier) for l in head), f"'{tier}' not indented:\n{out}")
    # --quiet: no step lines.
    out = ok(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "u_3"), "--steps", "20",
              "--quiet"])
    check(not any(l.startswith("step ") for l in out.splitlines()), "step lines under --quiet")
    # A terminal: one line rewritten in place (carriage returns, few newlines).
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(OUT)
        os.execv(TZ, [TZ, "train", "--config", cfg, "--run-dir", os.path.join(OUT, "u_4"),
                      "--steps", "300"])
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    _, status = os.waitpid(pid, 0)
    text = data.decode(errors="replace")
    check(os.WEXITSTATUS(status) == 0, f"the run on a terminal failed:\n{text}")
    check(text.count("\rstep ") >= 2, f"no progress line rewritten in place:\n{text[:2000]}")
    check(text.count("\n") < 60, f"{text.count(chr(10))} lines on a terminal for 300 steps")
    check("left" in text and "tok/s" in text, "the progress line lacks tokens/s or time left")


CASES = [(n[5:], f) for n, f in sorted(globals().items()) if n.startswith("case_")]


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    write_config(os.path.join(OUT, "small.json"))
    failed = []
    for name, fn in CASES:
        if ONLY and name not in ONLY:
            continue
        t0 = time.time()
        try:
            fn()
            print(f"ok    {name} ({time.time() - t0:.1f} s)")
        except (Failure, subprocess.TimeoutExpired) as e:
            print(f"FAIL  {name}: {e}")
            failed.append(name)
        sys.stdout.flush()
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    print("all cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
