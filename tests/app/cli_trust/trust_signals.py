"""Signals, gone readers and faults found late in a run.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import fcntl
import os
import shutil
import signal
import struct
import subprocess
import termios
import time

from trust_common import (TZ, OUT, Failure, check, refused, ok, run, write_config, train_small,
                          read_then_go, read, start_long_run, mpirun_env)


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
    # report and plan wait on a FIFO input as `cat` does; a signal ends them with a message
    # (hunt 47: status 130 and not a word), and nothing written.
    for cmd in (["report", fifo, "-o", os.path.join(OUT, "g_page.html")],
                ["plan", "--trace", fifo]):
        p = subprocess.Popen([TZ] + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=OUT)
        time.sleep(0.7)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=10)[0].decode(errors="replace")
        check(p.returncode == 130 and f"during the {cmd[0]}: it stops now" in out,
              f"{cmd[0]} waiting on a FIFO, then SIGINT: status {p.returncode}\n{out}")
    check(not os.path.exists(os.path.join(OUT, "g_page.html")), "an ended report left its page")
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


def case_run_signals():
    """A stop the run cannot miss: its stdout's reader gone (`| head`, a `| tee` ended by the same
    Ctrl-C) still saves a checkpoint and exits 0; a closed stdout prints nowhere, not into the
    run's files; a second signal 3 s after the first ends a run blocked where no flag reaches it
    (a FIFO output whose reader does not read) with 128 + the signal and no partial file; an
    interrupted export leaves no temporary file; a stop at an evaluation step evaluates it, or
    leaves it to the resume, which makes it first."""
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
        # The pipe fills (a fixed 4 s was too short under a sanitizer's build): what it holds
        # stops growing, short of its 64 KiB by less than a metrics line (58967 bytes here).
        deadline = time.time() + 90
        held, still = 0, 0
        while time.time() < deadline:
            buf = bytearray(4)
            fcntl.ioctl(holder, termios.FIONREAD, buf)
            now = int.from_bytes(buf, "little")
            still = still + 1 if now == held and now >= 32768 else 0
            held = now
            if still >= 15:  # (3 s without growth: not a pause of a busy machine)
                break
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)  # the same burst: still only a request
        # The stop is honoured though the metrics line cannot be written (Note [A metrics
        # reader that stopped reading]): the run saves and ends, its error naming the file.
        try:
            out = p.communicate(timeout=20)[0].decode()
        except subprocess.TimeoutExpired:
            p.kill()
            raise Failure("a SIGTERM did not end a run blocked on a FIFO")
        check(p.returncode == 1 and "not being read" in out and "A checkpoint of step" in out,
              f"a run blocked on a FIFO, then SIGTERM: status {p.returncode}\n{out}")
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
    # is in the metrics before the save, or (a signal cuts an evaluation short: Note [An
    # evaluation a signal cuts short]) the checkpoint records it undone and the resumed run makes
    # it first: the resumed run's metrics miss none.
    p = start_long_run("v_eval", "--eval-every", "1")
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    check(p.wait(timeout=60) == 0, "a run stopped at an evaluation step")
    metrics = os.path.join(OUT, "v_eval", "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    last = max(m["step"] for m in rows if "loss" in m)
    if not any(m["step"] == last and "val_loss" in m for m in rows):
        with open(os.path.join(OUT, "v_eval", "checkpoint", "manifest.json")) as f:
            m = json.load(f)
        check(m["step"] == last and m["user_state"].get("eval_pending") is True,
              f"the evaluation of step {last}, where the run stopped, is missing and not pending")
        ok(["train", "--resume", os.path.join(OUT, "v_eval", "checkpoint"), "--steps",
            str(last + 1), "--quiet"])
        rows = [json.loads(line) for line in open(metrics)]
        check(any(m["step"] == last and "val_loss" in m for m in rows),
              f"the resumed run did not make the evaluation of step {last}")


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
    # Whichever ends last refuses to replace the other's report (on a loaded machine the long
    # run's 400 small steps can end first).
    short_rc, short_out = run(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "w_r2"),
                               "--report", report, "--steps", "2", "--quiet"])
    theirs = read(report)
    out = long_run.communicate(timeout=120)[0].decode(errors="replace")
    if short_rc != 0:
        # (At its end, or at its start when the long run had ended before it began.)
        check(long_run.returncode == 0 and read(report) == theirs and
              ("written by another process" in short_out and
               os.path.exists(os.path.join(OUT, "w_r2", "checkpoint", "manifest.json")) or
               "here already" in short_out),
              "a report another run wrote meanwhile (the long run ended first):\n"
              f"{short_out}\n{out}")
    elif long_run.returncode == 0:
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


def case_eval_swap_signal():
    """An evaluation whose --nvme-path names a new file (its swap file, made there) and that a
    signal ends leaves no swap file behind: a rerun was refused for the file it left."""
    base = os.path.join(OUT, "es_base")
    train_small(base, "--html", "none", "--trace", "none", steps=2)
    tok = os.path.join(OUT, "es_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<2000000H", *([1, 2, 3, 4] * 500000)))
    swap = os.path.join(OUT, "es_swap")
    p = subprocess.Popen([TZ, "eval", "--resume", base + "/checkpoint", "--data", tok,
                          "--batch-size", "1", "--nvme-path", swap, "--host-budget", "1500KiB"],
                         stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=OUT)
    deadline = time.time() + 60
    while not os.path.exists(swap) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=60)[1].decode()
    check(p.returncode == 130, f"eval ended with {p.returncode}, not 130\n{err}")
    check(not os.path.exists(swap) or (os.path.isdir(swap) and not os.listdir(swap)),
          "the evaluation's swap file stayed after the signal")
    # SIGKILL: no clean-up runs. A --nvme-path that was not there is a directory made for the
    # swap, whose file has no name: at most the empty directory stays, and the rerun runs (a
    # named 256 MiB file stayed, and the rerun was refused for it: hunt 50).
    shutil.rmtree(swap, ignore_errors=True)
    args = [TZ, "eval", "--resume", base + "/checkpoint", "--data", tok, "--batch-size", "1",
            "--nvme-path", swap, "--host-budget", "1500KiB"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=OUT)
    deadline = time.time() + 60
    while not os.path.exists(swap) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    time.sleep(0.3)
    p.kill()
    p.wait(timeout=60)
    check(not os.path.exists(swap) or (os.path.isdir(swap) and not os.listdir(swap)),
          f"a killed evaluation left {swap} with something in it")
    small = os.path.join(OUT, "es_tok_small.bin")
    with open(small, "wb") as f:
        f.write(struct.pack("<2000H", *([1, 2, 3, 4] * 500)))
    rc, out = run([a if a != tok else small for a in args[1:]], timeout=120)
    check(rc == 0, f"an evaluation after a killed one: {rc}\n{out}")
    # Note [Directories another process took]: the directories eval made for its swap, taken
    # by another process meanwhile (a train locking the run directory around them), stay with
    # the lock file when eval ends (it removed both, and a second run into it was not refused:
    # review 51). (This process holds the lock, as a train does.)
    run_dir = os.path.join(OUT, "es_taken")
    swap = os.path.join(run_dir, "nvme")
    p = subprocess.Popen(args[:-4] + ["--nvme-path", swap, "--host-budget", "1500KiB"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=OUT)
    deadline = time.time() + 60
    while not os.path.exists(swap) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    lock = os.open(os.path.join(run_dir, ".tierzero.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1].decode()
        check(os.path.isdir(swap) and os.path.exists(os.path.join(run_dir, ".tierzero.lock")),
              f"eval removed what another process holds: {os.listdir(OUT)}\n{err}")
    finally:
        os.close(lock)


def case_killed_before_checkpoint():
    # A run SIGKILLed before its first save leaves a checkpoint directory without a manifest:
    # `--resume` of it says the run stopped before its first checkpoint and gives the command
    # that starts it again in place, which (followed as given) trains.
    write_config(os.path.join(OUT, "small.json"))
    name = "kb_run"
    rd = os.path.join(OUT, name)
    p = start_long_run(name)  # (train.checkpoint_every 0: saved at the end)
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        m = os.path.join(rd, "metrics.jsonl")
        if os.path.exists(m) and b'"loss"' in read(m):
            break
        time.sleep(0.1)
    p.kill()
    p.wait()
    check(not os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          "the killed run saved a checkpoint: the case tests nothing")
    out = refused(["train", "--resume", os.path.join(name, "checkpoint"), "--quiet"],
                  "stopped before it saved its first checkpoint", "--overwrite")
    # Under mpirun the lead says it once (the others each printed a bare NotFound: hunt 46).
    mpirun, env = mpirun_env()
    if mpirun:
        p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--resume",
                            os.path.join(name, "checkpoint"), "--quiet"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120, env=env, cwd=OUT)
        ranked = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and ranked.count("error:") == 1 and
              "stopped before it saved its first checkpoint" in ranked,
              f"2 ranks resuming a run killed before its first save:\n{ranked}")
    advice = out[out.index("tierzero train --config"):].split(" (replaces")[0].split()[1:]
    ok(advice + ["--steps", "3", "--quiet"])
    check(os.path.exists(os.path.join(rd, "checkpoint", "manifest.json")),
          f"the advised command saved no checkpoint: {advice}")


def act_during_train(args, at, act, name, wait):
    """Starts `tierzero train ARGS --log-every 1`, calls act(process) once `at` is in its output
    (the run still going), and waits `wait` s for it to end, status 0: (seconds from the act to
    the end, the output)."""
    log = os.path.join(OUT, name + ".log")
    with open(log, "w") as f:
        p = subprocess.Popen([TZ, "train", "--log-every", "1"] + args, stdout=f,
                             stderr=subprocess.STDOUT, cwd=OUT)
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline and at not in open(log).read():
        time.sleep(0.02)
    check(p.poll() is None, f"{name}: the run ended before '{at}' was acted on")
    act(p)
    t0 = time.time()
    try:
        p.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        p.kill()
        raise Failure(f"{name}: still running {wait} s after it was acted on")
    out = open(log).read()
    check(p.returncode == 0, f"{name}: exit status {p.returncode}\n{out}")
    return time.time() - t0, out


def case_eval_signal():
    """Note [An evaluation a signal cuts short]: one SIGTERM in a long evaluation stops it
    within a batch, where it was acted on only after it and a step (the step-0 evaluation of
    100000 batches: more than 10 minutes; a scheduler's SIGKILL comes first). The step-0 one and
    a scheduled one: saved with the evaluation undone, which the resume makes first; the last
    one: the run saves, reports and says the evaluation is not made."""
    base = write_config(os.path.join(OUT, "ev.json"), train={"eval_batches": 20000})

    def stopped_in_eval(args, after, name):
        """Starts train, sends SIGTERM 1 s after `after` is in its output; (seconds, output)."""
        def term(p):
            time.sleep(1)
            p.send_signal(signal.SIGTERM)
        return act_during_train(["--config", base] + args, after, term, name, wait=60)

    def pending(rd):
        with open(os.path.join(rd, "checkpoint", "manifest.json")) as f:
            m = json.load(f)
        return m["step"], m["user_state"].get("eval_pending", False)

    rd = os.path.join(OUT, "ev_start")
    secs, out = stopped_in_eval(["--run-dir", rd], "tierzero train:", "ev_start")
    check(secs < 8 and "interrupted in the evaluation of step 0" in out,
          f"the step-0 evaluation stopped {secs:.1f} s after SIGTERM\n{out}")
    check(pending(rd) == (0, True), f"step-0 checkpoint: {pending(rd)}")
    # A scheduled evaluation (step 4 of a run resumed from step 2).
    rd = os.path.join(OUT, "ev_sched")
    train_small(rd, "--html", "none", "--trace", "none", steps=2)
    secs, out = stopped_in_eval(["--run-dir", rd, "--resume", rd + "/checkpoint", "--steps", "6",
                                 "--eval-every", "4"], "step     4/", "ev_sched")
    check(secs < 8 and "its evaluation cut short" in out,
          f"a scheduled evaluation stopped {secs:.1f} s after SIGTERM\n{out}")
    # What the signal says it does is what the run does (it said "finishing this step").
    check("received: ending the evaluation at its next batch" in out,
          f"the signal's message does not say the evaluation ends\n{out}")
    check(pending(rd) == (4, True), f"checkpoint: {pending(rd)}")
    # The last evaluation: nothing to resume makes it; the run saves and reports.
    rd = os.path.join(OUT, "ev_last")
    train_small(rd, "--html", "none", "--trace", "none", steps=2)
    secs, out = stopped_in_eval(["--run-dir", rd, "--resume", rd + "/checkpoint", "--steps", "3"],
                                "step     3/", "ev_last")
    check(secs < 8 and "interrupted in the last evaluation" in out and
          "received: ending the last evaluation" in out,
          f"the last evaluation stopped {secs:.1f} s after SIGTERM\n{out}")
    check(pending(rd) == (3, False) and os.path.exists(os.path.join(rd, "report.json")),
          f"checkpoint: {pending(rd)}; the report is written")


def case_dirs_moved():
    """Note [A directory moved under the run] and Note [Run files removed under the run]: a
    checkpoint directory moved aside and replaced by a symbolic link to another run's, mid-run:
    the other run's checkpoint is untouched, the save follows the moved directory; the whole run
    directory removed mid-run: its metrics (every line), config.json and checkpoint are there at
    the end, and the run resumes."""
    # (Steps of a few milliseconds: enough of them that the run is still going when acted on.)
    cfg = write_config(os.path.join(OUT, "dm.json"), train={"steps": 2000, "checkpoint_every": 500})
    victim = os.path.join(OUT, "dm_victim")
    ok(["train", "--config", cfg, "--run-dir", victim, "--steps", "40", "--quiet"])
    before = {n: read(os.path.join(victim, "checkpoint", n))
              for n in os.listdir(os.path.join(victim, "checkpoint"))}

    def during(rd, at, act, name):
        return act_during_train(["--config", cfg, "--run-dir", rd], at, lambda p: act(), name,
                                wait=120)[1]

    rd = os.path.join(OUT, "dm_link")

    def swap():
        os.rename(os.path.join(rd, "checkpoint"), os.path.join(rd, "checkpoint.orig"))
        os.symlink(os.path.join(victim, "checkpoint"), os.path.join(rd, "checkpoint"))
    out = during(rd, "step     5/", swap, "dm_link")
    after = {n: read(os.path.join(victim, "checkpoint", n))
             for n in os.listdir(os.path.join(victim, "checkpoint"))}
    check(after == before, f"another run's checkpoint changed under a symbolic link\n{out}")
    with open(os.path.join(rd, "checkpoint.orig", "manifest.json")) as f:
        check(json.load(f)["step"] == 2000, "the moved checkpoint directory holds no step 2000")
    check("was moved to" in out, f"the move is not said\n{out}")
    # Note [A directory made again is locked again]: a checkpoint directory removed mid-run and
    # made again by the save of step 500 is refused to a second run while this one trains.
    rd, second = os.path.join(OUT, "dm_ck"), []

    def remove_checkpoint():
        shutil.rmtree(os.path.join(rd, "checkpoint"))
        log, deadline = os.path.join(OUT, "dm_ck.log"), time.time() + 60
        while time.time() < deadline and "step   501/" not in open(log).read():
            time.sleep(0.02)
        second.append(run(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "dm_ck2"),
                           "--checkpoint", os.path.join(rd, "checkpoint"), "--steps", "3",
                           "--overwrite", "--quiet"]))
    during(rd, "step     5/", remove_checkpoint, "dm_ck")
    check(second and second[0][0] == 1 and "another tierzero process" in second[0][1],
          f"a second run into the checkpoint directory made again was not refused: {second}")
    rd = os.path.join(OUT, "dm_gone")
    out = during(rd, "step     5/", lambda: shutil.rmtree(rd), "dm_gone")
    with open(os.path.join(rd, "metrics.jsonl")) as f:
        steps = [json.loads(l).get("step") for l in f]
    check(set(range(2001)) <= set(steps), f"metrics lines lost with the run directory: {steps[:8]}")
    check(os.path.exists(os.path.join(rd, "config.json")), "config.json not written again")
    ok(["train", "--resume", os.path.join(rd, "checkpoint"), "--steps", "2002", "--quiet"])
