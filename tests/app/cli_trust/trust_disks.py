"""cli_trust cases about the file systems under a run's paths: names near the system's limits, and
what is on the disk when the disk stops taking writes."""
import fcntl
import json
import os
import shutil
import subprocess

from trust_common import OUT, check, ok, refused, write_config


def case_long_paths():
    # Note [Room for the names a run writes late]: a run directory whose path leaves no room for
    # the checkpoint's files trained every step and lost them at its first save ("File name too
    # long"). It is refused at set-up now, and leaves nothing.
    deep = os.path.join(OUT, "lp")
    path = deep
    while len(path) < 4000:
        path = os.path.join(path, "d" * 200)
    path = path[:4060]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cfg = os.path.join(OUT, "small.json")
    refused(["train", "--config", cfg, "--run-dir", path], "too long for the files written there")
    check(not os.path.exists(path), "a refused run left its run directory")
    # An output named as long as a name may be (255 bytes) is written: its temporary leaves the
    # name out. One longer is refused at set-up.
    rd = os.path.join(OUT, "lp_run")
    longest = os.path.join(OUT, "r" * 250 + ".json")
    ok(["train", "--config", cfg, "--run-dir", rd, "--report", longest, "--quiet"])
    check(os.path.exists(longest), "a report of a 255-byte name was not written")
    rd2 = os.path.join(OUT, "lp_run2")
    refused(["train", "--config", cfg, "--run-dir", rd2, "--report",
             os.path.join(OUT, "r" * 251 + ".json")], "--report", "longer than a name")
    check(not os.path.exists(rd2), "a refused run left its run directory")
    # A deep directory with room for its names trains and saves.
    fits = path[:3900].rstrip("/")
    ok(["train", "--config", cfg, "--run-dir", fits, "--quiet"])
    check(os.path.exists(os.path.join(fits, "checkpoint", "manifest.json")),
          "a run in a deep directory with room for its names saved nothing")


FS_IOC_GOINGDOWN = 0x8004587D  # _IOR('X', 125, __u32)
GOING_NOLOGFLUSH = 2  # the file system stops at once, its journal not flushed: a power cut


def case_metrics_durable():
    # Note [The metrics on disk before the checkpoint that follows them]: after a power cut the
    # checkpoint of the last step resumed bit for bit and metrics.jsonl was empty: its lines were
    # written, not on the disk. Simulated with an ext4 image's FS_IOC_GOINGDOWN (what `xfs_io -x
    # -c shutdown` asks), as root where a loop device can be mounted; skipped elsewhere.
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    if os.geteuid() != 0 or not os.path.exists(mkfs):
        print("      (metrics_durable: no ext4 image can be made here: skipped)")
        return
    img, mnt = os.path.join(OUT, "md.img"), os.path.join(OUT, "md_mnt")
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    os.makedirs(mnt)
    if subprocess.run([mkfs, "-q", "-F", img], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0 or \
            subprocess.run(["mount", "-o", "loop", img, mnt], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL).returncode != 0:
        print("      (metrics_durable: no loop device can be mounted here: skipped)")
        return
    mounted = True
    try:
        cfg = write_config(os.path.join(OUT, "md_cfg.json"),
                           train={"steps": 12, "batch_size": 8, "eval_every": 0,
                                  "eval_batches": 1, "checkpoint_every": 6})
        rd = os.path.join(mnt, "r")
        ok(["train", "--config", cfg, "--run-dir", rd, "--quiet"])
        fd = os.open(mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_GOINGDOWN, GOING_NOLOGFLUSH.to_bytes(4, "little"))
        except OSError as e:
            print(f"      (metrics_durable: FS_IOC_GOINGDOWN refused ({e}): skipped)")
            return
        finally:
            os.close(fd)
        subprocess.run(["umount", mnt], check=True)
        mounted = False
        subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
        mounted = True
        ck = os.path.join(rd, "checkpoint", "manifest.json")
        check(os.path.exists(ck), "the checkpoint did not survive the shutdown")
        with open(os.path.join(rd, "metrics.jsonl"), "rb") as f:
            lines = [json.loads(line) for line in f.read().splitlines() if line.strip(b"\0 ")]
        steps = sorted({m["step"] for m in lines if "loss" in m})
        check(steps == list(range(1, 13)),
              f"the metrics on disk after a shutdown hold the steps {steps}, not 1..12 (the "
              "checkpoint of step 12 survived)")
    finally:
        if mounted:
            subprocess.run(["umount", mnt])
