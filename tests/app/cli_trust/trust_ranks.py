"""Several ranks under mpirun: configs that disagree, and faults mid-run.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import struct
import subprocess
import time

from trust_common import (TZ, OUT, check, mpirun_env, read_then_go, read)


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
    # The training iterations' collectives, evaluations' left out (Note [The collectives of
    # training]): what a step's measured collectives are (figures hunt 47: the whole run's).
    ranks = json.load(open(os.path.join(OUT, "a_nvme", "report.json")))["ranks"]
    check(0 < ranks["train_comm_seconds"] < ranks["comm_seconds"],
          f"the training iterations' collectives: {ranks}")
    # export, eval and report are one process's jobs: under mpirun they are refused, not run twice
    # (two reports raced for one page).
    for cmd in (["export", os.path.join(OUT, "a_nvme", "checkpoint"), "-o",
                 os.path.join(OUT, "a_export.safetensors")],
                ["eval", "--resume", os.path.join(OUT, "a_nvme", "checkpoint"), "--data",
                 "/dev/null"],
                ["report", os.path.join(OUT, "a_nvme", "report.json"), "-o",
                 os.path.join(OUT, "a_page.html")]):
        p = subprocess.run([mpirun, "-np", "2", TZ] + cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120, env=env, cwd=OUT)
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and "without mpirun" in out, f"{cmd[0]} under mpirun:\n{out}")
    check(not os.path.exists(os.path.join(OUT, "a_export.safetensors")), "an export ran")
    check(not os.path.exists(os.path.join(OUT, "a_page.html")), "a report ran")
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


def case_rank_stops_in_save():
    # A rank stopped (SIGSTOP: a hung file system) while it writes its part of a checkpoint: the
    # others' save times out in its agreement (collective_timeout_s). That failure was taken as
    # one the ranks agreed on, and the rank left waited in MPI_Finalize for the stopped one,
    # forever (hunt 46). Now the job is aborted within about the timeout, an error line saying
    # why; the stopped rank is killed with it.
    mpirun, env = mpirun_env()
    if not mpirun:
        return
    cfg = os.path.join(OUT, "ss.json")
    with open(cfg, "w") as f:
        json.dump({"model": {"n_layer": 4, "d_model": 192, "n_head": 4},
                   "train": {"steps": 100000, "batch_size": 8, "eval_every": 0,
                             "eval_batches": 1, "checkpoint_every": 5},
                   "engine": {"device_budget": "16 MiB", "host_budget": "24 MiB",
                              "nvme_budget": "256 MiB"},
                   "output": {"html": "none", "trace": "none"},
                   "ranks": {"collective_timeout_s": 5}}, f)
    for target in ("1", "0"):
        rd = os.path.join(OUT, "ss_run" + target)
        p = subprocess.Popen([mpirun, "-np", "2", TZ, "train", "--config", cfg, "--run-dir", rd,
                              "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, cwd=OUT)
        stopped = None
        try:
            deadline = time.time() + 60
            while stopped is None and time.time() < deadline and p.poll() is None:
                for pid in os.listdir("/proc"):
                    if not pid.isdigit():
                        continue
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            if not f.read().startswith(TZ.encode() + b"\0train\0--config\0" +
                                                       cfg.encode()):
                                continue
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            if b"OMPI_COMM_WORLD_RANK=" + target.encode() + b"\0" not in f.read():
                                continue
                        if any(".states-" in os.readlink(f"/proc/{pid}/fd/{fd}") and
                               os.readlink(f"/proc/{pid}/fd/{fd}").endswith(".tmp")
                               for fd in os.listdir(f"/proc/{pid}/fd")):
                            os.kill(int(pid), 19)  # SIGSTOP
                            stopped = int(pid)
                            break
                    except OSError:
                        continue
            if stopped is None:
                print(f"      (rank_stops_in_save: rank {target}'s save was not caught; skipped)")
                continue
            t0 = time.time()
            try:
                out = p.communicate(timeout=60)[0].decode(errors="replace")
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0].decode(errors="replace")
                check(False, f"rank {target} stopped in a save: the job hung\n{out[-2000:]}")
            check(p.returncode not in (0, None) and "did not complete in 5 s" in out,
                  f"rank {target} stopped in a save: exit {p.returncode} after "
                  f"{time.time() - t0:.0f} s\n{out[-2000:]}")
        finally:
            if p.poll() is None:
                p.kill()
            if stopped is not None:
                try:
                    os.kill(stopped, 9)
                except OSError:
                    pass


def case_rank_never_reads():
    # Hunt 49: a rank blocked on an input before it joined the job (a FIFO as its config) held
    # the others in MPI_Init for good, and one that ended without joining (`train --help`) did
    # too: every rank joins first (Note [Every rank joins before it reads]), so the others wait in
    # a collective, whose deadline ends the job. A FIFO as one rank's text is refused at once,
    # and a data error on one rank ends every rank without the job's abort: the run directory
    # goes (its nvme/ was left behind about half the time).
    mpirun, env = mpirun_env()
    if not mpirun:
        return
    d = os.path.join(OUT, "never")
    for sub in ("a", "b"):
        os.makedirs(os.path.join(d, sub))
    with open(os.path.join(d, "a", "c.json"), "w") as f:
        f.write('{"model": {"n_layer": 2, "d_model": 64, "n_head": 4}, "train": {"steps": 3, '
                '"batch_size": 8}, "ranks": {"collective_timeout_s": 5}}')
    os.mkfifo(os.path.join(d, "b", "c.json"))
    base = ["train", "--config", "c.json", "--quiet", "--run-dir", os.path.join(d, "run")]
    for peer in ([TZ] + base, [TZ, "train", "--help"]):
        t0 = time.time()
        try:
            p = subprocess.run([mpirun, "-np", "1", "-wdir", os.path.join(d, "a"), TZ] + base +
                               [":", "-np", "1", "-wdir", os.path.join(d, "b")] + peer,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90,
                               env=env)
        except subprocess.TimeoutExpired:
            check(False, f"a rank that never reads its config ({peer[1:]}): the job hung")
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and "did not complete in 5 s" in out,
              f"a rank that never reads its config: exit {p.returncode} after "
              f"{time.time() - t0:.0f} s\n{out[-2000:]}")
    # A FIFO as one rank's --text; then token ids past the vocabulary on both ranks.
    with open(os.path.join(d, "a", "t.txt"), "w") as f:
        f.write("some text to learn from. " * 400)
    os.mkfifo(os.path.join(d, "b", "t.txt"))
    text = ["train", "--layers", "2", "--width", "64", "--heads", "4", "--steps", "3", "--quiet",
            "--text", "t.txt", "--run-dir", os.path.join(d, "run_text")]
    p = subprocess.run([mpirun, "-np", "1", "-wdir", os.path.join(d, "a"), TZ] + text +
                       [":", "-np", "1", "-wdir", os.path.join(d, "b"), TZ] + text,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90, env=env)
    out = p.stdout.decode(errors="replace")
    check(p.returncode != 0 and "rank 1 of 2: error:" in out and "is a FIFO" in out and
          "MPI_ABORT" not in out and not os.path.exists(os.path.join(d, "run_text")),
          f"one rank's text a FIFO (refused together, nothing left):\n{out[-2000:]}")
    # One rank's flag refused before it has a communicator: the job ends at once, not at the
    # others' collective deadline (review 49).
    t0 = time.time()
    p = subprocess.run([mpirun, "-np", "1", "-wdir", os.path.join(d, "a"), TZ] + base +
                       [":", "-np", "1", "-wdir", os.path.join(d, "a"), TZ] + base +
                       ["--steps", "-5"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90, env=env)
    out = p.stdout.decode(errors="replace")
    check(p.returncode != 0 and "rank 1 of 2: error:" in out and "train.steps" in out and
          time.time() - t0 < 4.5, f"one rank's bad flag: {time.time() - t0:.1f} s\n{out[-2000:]}")
    tokens = os.path.join(d, "v300.bin")
    with open(tokens, "wb") as f:
        f.write(struct.pack("<20000H", *[(i * 7) % 300 for i in range(20000)]))
    for attempt in range(3):
        rd = os.path.join(d, f"run_vocab{attempt}")
        p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--layers", "2", "--width", "64",
                            "--heads", "4", "--steps", "3", "--seq-len", "16", "--quiet",
                            "--data", tokens, "--run-dir", rd],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90, env=env)
        out = p.stdout.decode(errors="replace")
        check(p.returncode != 0 and "error:" in out and "MPI_ABORT" not in out,
              f"token ids past the vocabulary on 2 ranks:\n{out[-2000:]}")
        left = sorted(os.listdir(rd)) if os.path.exists(rd) else None
        check(left is None, f"a refused 2-rank run left {rd}: {left}")


def case_plan_hpz():
    """ZeRO++'s hpZ, its secondary partition in host memory: a chunk's later gathers of an
    iteration are node gathers whose part crosses the link, not full ones; the plan's bytes per
    link are the run's, and the profile traces those copies (hunt 51). Plans of several ranks
    with device parameter shards and host collectives are refused, as the run is."""
    mpirun, env = mpirun_env()
    if not mpirun:
        return
    d = os.path.join(OUT, "ph")
    os.makedirs(d)
    cfg = os.path.join(d, "cfg.json")
    with open(cfg, "w") as f:
        json.dump({"zeropp": {"hpz": True}, "ranks": {"ranks_per_node": 1}}, f)
    plan = os.path.join(d, "plan.json")
    run_dir = os.path.join(d, "run")
    p = subprocess.run([TZ, "plan", "--config", cfg, "--steps", "3", "--ranks", "2", "--run-dir",
                        run_dir, "--json", plan], capture_output=True, timeout=120, cwd=OUT)
    check(p.returncode == 0, f"plan: {p.stderr.decode()}")
    p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--config", cfg, "--steps", "3",
                        "--run-dir", run_dir, "--plan", plan, "--quiet"], capture_output=True,
                       timeout=240, cwd=OUT, env=env)
    check(p.returncode == 0, f"train: {p.stdout.decode()}{p.stderr.decode()}")
    with open(os.path.join(run_dir, "report.json")) as f:
        rows = [r for r in json.load(f)["prediction"]["compared"] if r["unit"] == "bytes"]
    for r in rows:
        check(r["predicted"] == r["measured"],
              f"{r['what']}: predicted {r['predicted']}, measured {r['measured']}")
    check(any(r["what"] == "H2D per iteration" for r in rows), f"no H2D row: {rows}")
    with open(cfg, "w") as f:
        json.dump({"engine": {"device_shard_budget": "8 MiB"}, "ranks": {"collectives": "host"}},
                  f)
    p = subprocess.run([TZ, "plan", "--config", cfg, "--ranks", "2"], capture_output=True,
                       timeout=120, cwd=OUT)
    check(p.returncode == 1 and b"device_shard_budget 0" in p.stderr,
          f"plan of device shards through host collectives: {p.returncode} {p.stderr.decode()}")
