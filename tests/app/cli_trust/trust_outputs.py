"""Output paths, run directories, locks and config.json: what a path names decides how it is
written, and no file the run did not create is replaced or removed.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import shutil
import pty
import re
import signal
import stat
import struct
import subprocess
import threading
import time

from trust_common import (TZ, OUT, check, run, refused, ok, write_config, train_small, read,
                          limited_cgroup, into_cgroup,
                          losses, nobody_runs)


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
    # An existing file (hunt 45: a user's notes, through a link, were replaced) is refused
    # unless --overwrite asks for it.
    refused(["export", ckpt, "-o", link], "exists", "--overwrite")
    check(read(target) == b"old", "a refused export changed the link's target")
    ok(["export", ckpt, "-o", link, "--overwrite"])
    check(os.path.islink(link), "the symlink was replaced by a file")
    check(read(target)[:8] != b"old", "the link's target was not written")
    # The same for report's page and trace, and plan's JSON (unchecked before session 46).
    for args in (["report", ok_run + "/report.json", "-o", link],
                 ["report", ok_run + "/report.json", "--trace", link],
                 ["plan", "--config", os.path.join(OUT, "small.json"), "--json", link,
                  "--no-advice"]):
        before = read(target)
        refused(args, "exists", "--overwrite")
        check(read(target) == before, f"a refused {args[0]} changed the link's target")
        ok(args + ["--overwrite"])
        check(os.path.islink(link) and read(target) != before,
              f"{args[0]} --overwrite did not write through the link")
    # /dev/stdout that a shell pointed at a file is written to, not refused as an existing file.
    piped = os.path.join(OUT, "o_piped.st")
    with open(piped, "wb") as f:
        p = subprocess.run([TZ, "export", ckpt, "-o", "/dev/stdout"], stdout=f,
                           stderr=subprocess.PIPE, cwd=OUT, timeout=120)
    check(p.returncode == 0 and os.path.getsize(piped) > 1000,
          f"export -o /dev/stdout > FILE: {p.stderr.decode()}")
    # "-o -" is standard output too (it wrote a file named "-": hunt 51).
    with open(piped + ".dash", "wb") as f:
        p = subprocess.run([TZ, "export", ckpt, "-o", "-"], stdout=f, stderr=subprocess.PIPE,
                           cwd=OUT, timeout=120)
    check(p.returncode == 0 and read(piped + ".dash") == read(piped) and
          not os.path.exists(os.path.join(OUT, "-")), f"export -o - > FILE: {p.stderr.decode()}")
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


def case_metrics_disk_full():
    """A metrics file whose disk fills mid-run: the run stops and saves the step whose line it
    could not write; a resume in place, once there is room, writes that line (Note [Metrics lines
    a stop left unwritten]), so the file holds every step once with an uninterrupted run's
    losses. Needs a small file system to fill (root's tmpfs); skipped where none can be mounted."""
    cfg = write_config(os.path.join(OUT, "md.json"), train={"steps": 60, "batch_size": 8,
                                                             "eval_every": 25, "eval_batches": 1})
    ref = os.path.join(OUT, "md_ref")
    ok(["train", "--config", cfg, "--run-dir", ref, "--quiet"])
    small = os.path.join(OUT, "md_small")
    os.makedirs(small)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", small],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        print("  (no tmpfs could be mounted: skipped)")
        return
    try:
        rd, ck = os.path.join(small, "r"), os.path.join(OUT, "md_ck")
        out = refused(["train", "--config", cfg, "--run-dir", rd, "--checkpoint", ck, "--quiet"],
                      "metrics file", "A checkpoint of step")
        check(os.path.exists(os.path.join(ck, "manifest.json")), "a full metrics disk: no save\n" + out)
        # The advice, followed as given, continues the run (its checkpoint outside the run
        # directory: the run's config names both; `--resume CK --checkpoint CK` was refused).
        advised = "--config " + rd + "/config.json --resume " + ck
        check(advised in out, f"the resume advised is not '{advised}':\n{out}")
        subprocess.run(["mount", "-o", "remount,size=1m", small], check=True)
        ok(["train"] + advised.split() + ["--quiet"])
        got = [json.loads(line) for line in open(os.path.join(rd, "metrics.jsonl"))]
        want = [json.loads(line) for line in open(os.path.join(ref, "metrics.jsonl"))]
        key = lambda m: (m["step"], "loss" in m)
        steps = [key(m) for m in got]
        check(len(steps) == len(set(steps)), f"a line twice after the resume: {steps}")
        check(steps == [key(m) for m in want],
              f"lines missing or out of order after the resume: {steps} against "
              f"{[key(m) for m in want]}")
        for g, w in zip(sorted(got, key=key), sorted(want, key=key)):
            for f in ("loss", "val_loss", "lr", "grad_norm"):
                check(g.get(f) == w.get(f), f"step {g['step']}: {f} {g.get(f)} against {w.get(f)}")
    finally:
        subprocess.run(["umount", small])


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
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
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
    refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir", run_dir,
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
    # A user's own file named by --report beside a new run directory: refused naming the flag
    # (not as another run's outputs, and not with advice to change --run-dir), and kept.
    mine = os.path.join(OUT, "r_mine.json")
    with open(mine, "w") as f:
        f.write('{"mine": 1}')
    out = refused(["train", "--config", os.path.join(OUT, "small.json"), "--run-dir",
                   os.path.join(OUT, "r_new"), "--steps", "3", "--report", mine],
                  mine + " (--report)", "--report PATH")
    check("another run" not in out and "--run-dir DIR" not in out,
          f"a user's file called another run's outputs:\n{out}")
    check(read(mine) == b'{"mine": 1}', "the user's file named by --report changed")


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


def case_lock():
    run_dir = os.path.join(OUT, "l_run")
    cfg = os.path.join(OUT, "small.json")
    done = os.path.join(OUT, "l_done")
    train_small(done, "--html", "none", "--trace", "none", steps=2)
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
        # Nor does any other command write into it (a plan replaced its metrics, a page its
        # config.json).
        refused(["plan", "--config", cfg, "--json", run_dir + "/metrics.jsonl", "--no-advice"],
                "a tierzero run that is running")
        refused(["report", done + "/report.json", "-o", run_dir + "/config.json"],
                "a tierzero run that is running")
        refused(["export", done + "/checkpoint", "-o", run_dir + "/m.safetensors"],
                "a tierzero run that is running")
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


def case_export_paths():
    run_dir = os.path.join(OUT, "p_run")
    train_small(run_dir)
    ok(["export", run_dir + "/checkpoint/", "-o", os.path.join(OUT, "p_1.st")])
    ok(["export", ".", "-o", os.path.join(OUT, "p_2.st")], cwd=run_dir + "/checkpoint")
    ok(["export", "checkpoint/.", "-o", os.path.join(OUT, "p_3.st")], cwd=run_dir)
    check(read(os.path.join(OUT, "p_1.st")) == read(os.path.join(OUT, "p_2.st")),
          "the exports differ")
    # A checkpoint whose path begins with '-': after --, or said how to write it.
    dash = os.path.join(OUT, "-p_dash")
    shutil.copytree(run_dir, dash)
    refused(["export", "-p_dash/checkpoint", "-o", "p_7.st"], "./-p_dash/checkpoint")
    ok(["export", "--", "-p_dash/checkpoint", "-o", "p_7.st"])
    check(read(os.path.join(OUT, "p_1.st")) == read(os.path.join(OUT, "p_7.st")),
          "the export after -- differs")
    ok(["report", "--", "-p_dash/report.json"])
    # Budgets of the export's own (where the run's do not fit the memory it may use: the advice
    # of its refusal names --host-budget), a host budget short of the run's, the rest swapped to
    # NVMe, and one that holds it all: the same tensors.
    ok(["export", run_dir + "/checkpoint", "-o", os.path.join(OUT, "p_4.st"), "--host-budget",
        "1536KiB", "--nvme-budget", "64MiB"])
    ok(["export", run_dir + "/checkpoint", "-o", os.path.join(OUT, "p_5.st"), "--host-budget",
        "256MiB", "--nvme-budget", "0"])
    for name in ("p_4.st", "p_5.st"):
        check(read(os.path.join(OUT, "p_1.st")) == read(os.path.join(OUT, name)),
              f"the export with budgets of its own ({name}) differs")
    refused(["export", run_dir + "/checkpoint", "-o", os.path.join(OUT, "p_6.st"), "--host-budget",
             "64KiB", "--nvme-budget", "0"], "host_budget")
    refused(["export", run_dir + "/checkpoint", "-o", os.path.join(OUT, "p_6.st"),
             "--nvme-budget"], "--nvme-budget needs a value")
    check(not os.path.exists(os.path.join(OUT, "p_6.st")), "a refused export left its output")
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


def case_stdout_data():
    """Note [Data on standard output]: an output that is the process's stdout holds the data
    alone (the command's own lines go to stderr): an export streamed into a file loads, a trace
    or plan streamed into one parses."""
    run_dir = os.path.join(OUT, "sd_run")
    train_small(run_dir, "--trace", "none", steps=2)
    streamed = os.path.join(OUT, "sd_m.safetensors")
    for args, path in [(["export", run_dir + "/checkpoint", "-o", "/dev/stdout"], streamed),
                       (["report", run_dir + "/report.json", "-o", "/dev/stdout"],
                        os.path.join(OUT, "sd_page.html")),
                       (["plan", "--config", os.path.join(OUT, "small.json"), "--json",
                         "/dev/stdout", "--no-advice"], os.path.join(OUT, "sd_plan.json"))]:
        with open(path, "wb") as f:
            p = subprocess.run([TZ] + args, stdout=f, stderr=subprocess.PIPE, cwd=OUT, timeout=120)
        check(p.returncode == 0, f"{args}: exit status {p.returncode}\n{p.stderr.decode()}")
    data = read(streamed)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    check(8 + n + end == len(data), "the streamed export holds more than its tensors")
    ok(["train", "--init-from", streamed, "--steps", "1", "--run-dir",
        os.path.join(OUT, "sd_from"), "--quiet", "--html", "none", "--trace", "none"])
    json.load(open(os.path.join(OUT, "sd_plan.json")))
    check(read(os.path.join(OUT, "sd_page.html")).rstrip().endswith(b"</html>"),
          "the streamed page has text after it")


def case_file_size_limit():
    # A file past the process's size limit (`ulimit -f`) raised SIGXFSZ: the run ended with a
    # core and no word (exit 153), its temporary left behind. Now the write fails as any write:
    # an error naming the limit, nothing half-written left, the last checkpoint as it was.
    import resource

    def limit(n):
        def set_limit():
            # As a shell starts it: SIGXFSZ at its default (Python ignores it, and children
            # inherit that).
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
        return set_limit
    cfg = write_config(os.path.join(OUT, "fs_cfg.json"), model={"n_layer": 1, "d_model": 32,
                                                                 "n_head": 2},
                       train={"steps": 10, "checkpoint_every": 5})
    a = os.path.join(OUT, "fs_run")
    ok(["train", "--config", cfg, "--run-dir", a, "--quiet"])
    ckpt = os.path.join(a, "checkpoint")
    before = {n: read(os.path.join(ckpt, n)) for n in os.listdir(ckpt)}
    b = os.path.join(OUT, "fs_copy")
    for args in (["train", "--config", cfg, "--resume", ckpt, "--steps", "20", "--run-dir", b],
                 ["export", ckpt, "--format", "safetensors", "-o", os.path.join(OUT, "fs.st")],
                 ["export", ckpt, "--format", "hf", "--dtype", "fp32", "-o",
                  os.path.join(OUT, "fs_hf")]):
        rc, out = run(args, preexec_fn=limit(40 * 1024))
        check(rc == 1 and "ulimit -f" in out, f"{args} past the file-size limit: {rc}\n{out}")
        for d in (OUT, b, os.path.join(b, "checkpoint")):
            left = [n for n in os.listdir(d) if n.endswith(".tmp")] if os.path.isdir(d) else []
            check(not left, f"{args} left {left} in {d}")
    check({n: read(os.path.join(ckpt, n)) for n in os.listdir(ckpt)} == before,
          "the checkpoint resumed changed")


def case_address_space_limit():
    # Under a small address-space limit (`ulimit -v`) the allocator crashed inside OpenMP's start
    # (SIGSEGV) or a thread would not start ("a bug in tierzero", the run's config.json left); a
    # 64 KiB stack limit overran the main thread's stack (SIGSEGV). Each is now refused before
    # anything is made, naming the limit to raise (Note [The process's stack and address space]).
    import resource
    # (A sanitizer's runtime reserves terabytes of address space before main: under ASan the
    # address-space part cannot run.)
    libs = subprocess.run(["ldd", TZ], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
    sanitized = b"libasan" in libs or b"libtsan" in libs
    cases = [(resource.RLIMIT_STACK, "ulimit -s", (64 << 10, 256 << 10)),
             (resource.RLIMIT_NOFILE, "ulimit -n", (8, 32))]
    if not sanitized:
        cases.append((resource.RLIMIT_AS, "ulimit -v", (100 << 20, 150 << 20, 900 << 20)))
        # Under 16 KiB the allocator's start before main overran the stack (SIGSEGV, most runs:
        # where the stack begins is random): said from the executable's .preinit_array (Note [The
        # stack before the libraries start]). Not under a sanitizer, whose own start runs first.
        # (With a small environment: the loader's own start, before any code of ours, takes
        # the stack the environment leaves, and under 16 KiB a large one is enough to fail it.)
        cases.append((resource.RLIMIT_STACK, "ulimit -s", (16 << 10,) * 8))
    small_env = {"PATH": "/usr/bin:/bin"}
    for res, flag, amounts in cases:
        for n in amounts:
            rd = os.path.join(OUT, f"as_run_{n}")
            rc, out = run(["train", "--layers", "1", "--width", "32", "--heads", "2", "--steps",
                           "3", "--run-dir", rd, "--quiet"],
                          preexec_fn=lambda: resource.setrlimit(res, (n, n)),
                          env=small_env if n < (64 << 10) else None)
            check(rc == 1 and flag in out and "a bug" not in out,
                  f"under {flag} {n}: exit status {rc}\n{out}")
            check(not os.path.exists(rd), f"under {flag} {n}: a refused run left {rd}")
    # A soft limit under a hard one that allows enough is raised, and the run goes on.
    rd = os.path.join(OUT, "as_run_soft")
    rc, out = run(["train", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "3",
                   "--run-dir", rd, "--quiet"],
                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_STACK,
                                                        (64 << 10, resource.RLIM_INFINITY)))
    check(rc == 0, f"a 64 KiB soft stack limit under no hard one: exit status {rc}\n{out}")
    if not sanitized:
        for _ in range(4):
            rc, out = run(["--version"], env=small_env, preexec_fn=lambda: resource.setrlimit(
                resource.RLIMIT_STACK, (16 << 10, resource.RLIM_INFINITY)))
            check(rc == 0, f"a 16 KiB soft stack limit under no hard one: exit status {rc}\n{out}")
    # The simulated device maps its whole capacity: a limit just above what passes the 1 GiB
    # floor but under the device's budget crashed in the first product; refused at set-up.
    if not sanitized:
        rd = os.path.join(OUT, "as_run_dev")
        lim = 1100 << 20
        rc, out = run(["train", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "3",
                       "--device-budget", "900MiB", "--run-dir", rd, "--quiet"],
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (lim, lim)))
        check(rc == 1 and "ulimit -v" in out, f"a device budget over the address space: {rc}\n{out}")
        check(not os.path.exists(rd), f"a refused run left {rd}")
        # An arena of 4096 threads (the most cpu_threads takes) whose 4 MiB stacks pass the
        # limit: a worker that could not start threw on oneTBB's thread (std::terminate, exit
        # 134) after the step-0 evaluation. Held to the stacks an eighth of the limit holds, it
        # trains (Note [Threads within the address space]).
        rd = os.path.join(OUT, "as_run_threads")
        cfg = os.path.join(OUT, "as_threads.json")
        with open(cfg, "w") as f:
            f.write('{"engine": {"cpu_threads": 4096}}')
        lim = 2000 << 20
        rc, out = run(["train", "--config", cfg, "--steps", "2", "--run-dir", rd, "--quiet"],
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (lim, lim)))
        check(rc == 0, f"4096 CPU Adam threads under ulimit -v 2000 MiB: exit status {rc}\n{out}")


def case_thread_limit():
    # Note [Threads within the user's process limit]: under `ulimit -u`, oneTBB's workers started
    # from one another threw where nothing catches (std::terminate, exit 134) once an arena wanted
    # more threads than the limit left (CPU Adam's arena of engine.cpu_threads: 16 here, as on a
    # 16-core host). The limit is measured at start and oneTBB held to it: the run trains. As
    # `nobody` (root's limit is not enforced); skipped where this process cannot become it.
    if not nobody_runs("thread_limit"):
        return
    import resource
    cfg = write_config(os.path.join(OUT, "tl.json"), engine={"cpu_threads": 16,
                                                             "device_budget": "4 MiB",
                                                             "host_budget": "6 MiB",
                                                             "nvme_budget": "64 MiB"})
    os.chmod(OUT, 0o777)
    for limit in (16, 20, 24):
        rd = os.path.join(OUT, f"tl_run{limit}")

        def as_nobody(limit=limit):
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        rc, out = run(["train", "--config", cfg, "--run-dir", rd, "--quiet"], timeout=300,
                      preexec_fn=as_nobody, env=dict(os.environ, HOME=OUT))
        check(rc in (0, 1) and "terminate called" not in out,
              f"a run under ulimit -u {limit}: exit status {rc}\n{out}")
        check(rc == 0 or "ulimit -u" in out, f"under ulimit -u {limit}, a failure not naming "
                                             f"the limit:\n{out}")


def case_pids_limit():
    # Note [A container's pids limit]: a cgroup's pids.max (docker --pids-limit, a pod's pid
    # limit) refuses threads as `ulimit -u` does, but getrlimit does not show it, so oneTBB was
    # not held to it: CPU Adam's arena of 64 threads (engine.cpu_threads) under pids.max 16..40
    # ended in std::terminate (exit 134, hunt 45). Now it trains; a limit too low for the run's
    # own threads is an error naming the pids limit. Where a pids cgroup can be made here.
    d = limited_cgroup("pids", 40)
    if d is None:
        print("      (pids_limit: no pids cgroup can be made here; the case is left out)")
        return
    cfg = write_config(os.path.join(OUT, "pl.json"), engine={"cpu_threads": 64,
                                                             "device_budget": "4 MiB",
                                                             "host_budget": "6 MiB",
                                                             "nvme_budget": "64 MiB"})
    try:
        for limit in (16, 24, 40, 4):
            with open(os.path.join(d, "pids.max"), "w") as f:
                f.write(str(limit))
            rd = os.path.join(OUT, f"pl_run{limit}")
            rc, out = run(["train", "--config", cfg, "--run-dir", rd, "--quiet"], timeout=300,
                          preexec_fn=into_cgroup(d))
            check("terminate called" not in out and rc in (0, 1),
                  f"a run under pids.max {limit}: exit status {rc}\n{out}")
            check(rc == 0 or limit < 12, f"a run under pids.max {limit} failed:\n{out}")
            check(rc == 0 or "pids limit" in out,
                  f"under pids.max {limit}, a failure not naming the pids limit:\n{out}")
    finally:
        for _ in range(50):  # (the cgroup empties as its last process is reaped)
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.1)



def case_figures():
    # Figures a user reads, against what they count (figures hunt 47).
    small = ["--layers", "2", "--width", "64", "--heads", "2", "--batch-size", "8"]
    # The profiled step's NVMe optimizer traffic is its NVMe groups read and written: the
    # read-ahead's reads, in the last backward before Step, were left out (7 of 10 transfers).
    rd = os.path.join(OUT, "fg_nvme")
    ok(["train", "--steps", "4", "--host-budget", "2MiB", "--device-budget", "1MiB",
        "--run-dir", rd, "--quiet"] + small)
    report = json.load(open(os.path.join(rd, "report.json")))
    on_nvme = [g["bytes"] for g in report["optimizer"]["sub_groups"] if g["tier"] == "nvme"]
    got = report["profile"]["links"]["nvme_optimizer"]["bytes"]
    check(on_nvme and got == 2 * sum(on_nvme),
          f"the step's NVMe optimizer bytes {got}, its NVMe groups {on_nvme} both ways")
    # The header's model states are the run's: 16 bytes a parameter only for bf16 compute with
    # fp32 moments and no accumulation.
    for flags, per in (([], 16), (["--dtype", "fp32"], 20), (["--optimizer-states", "int8"],
                                                            2 + 2 + 4 + 2 + 8 / 64),
                       (["--grad-accumulation", "2"], 18)):
        rd = os.path.join(OUT, "fg_header")
        shutil.rmtree(rd, ignore_errors=True)
        out = ok(["train", "--steps", "1", "--run-dir", rd, "--quiet"] + small + flags)
        m = re.search(r"(\d+) parameters \(([0-9.]+) MiB of model states\)", out)
        check(m is not None and abs(float(m.group(2)) - int(m.group(1)) * per / 2**20) < 0.051,
              f"{flags}: the header's model states, {per} bytes a parameter:\n{out}")
