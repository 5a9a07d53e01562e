"""cli_trust cases about the file systems under a run's paths: names near the system's limits, and
what is on the disk when the disk stops taking writes."""
import fcntl
import json
import os
import shutil
import subprocess

from trust_common import OUT, TZ, check, ok, read, refused, write_config


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


def case_full_disks():
    # Hunt 49, on tmpfs mounts as root (skipped elsewhere): a metrics line cut by a full disk is
    # cut back to the last whole line; a resume that fails on a full disk has not written its
    # flags over the run's config.json; a full disk's error names the path given and says what
    # to do; help lost on a full disk is an error; plan's calibration runs where there is room.
    if os.geteuid() != 0:
        print("      (full_disks: not root, no tmpfs: skipped)")
        return
    mounts = []

    def tmpfs(name, size):
        mnt = os.path.join(OUT, name)
        os.makedirs(mnt)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", mnt],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
            return None
        mounts.append(mnt)
        return mnt

    shape = ["--layers", "2", "--width", "64", "--heads", "4", "--batch-size", "4", "--quiet"]
    try:
        m = tmpfs("fd_metrics", "4k")  # room for some ten metrics lines
        if m is None:
            print("      (full_disks: tmpfs cannot be mounted here: skipped)")
            return
        metrics = os.path.join(m, "metrics.jsonl")
        refused(["train", *shape, "--steps", "20", "--run-dir", os.path.join(OUT, "fd_run"),
                 "--metrics", metrics], "writing the metrics file", "the disk is full")
        with open(metrics, "rb") as f:
            text = f.read()
        check(text.endswith(b"\n"), f"a metrics line cut by a full disk was left: {text[-60:]!r}")
        for line in text.splitlines():
            json.loads(line)

        r = tmpfs("fd_resume", "4M")
        rd = os.path.join(r, "r")
        ok(["train", *shape, "--steps", "20", "--run-dir", rd])
        config = read(os.path.join(rd, "config.json"))
        lines = read(os.path.join(rd, "metrics.jsonl")).splitlines(keepends=True)
        with open(os.path.join(rd, "metrics.jsonl"), "wb") as f:
            f.write(b"".join(lines[:1] + [b"GARBAGE\n"] + lines[1:]))  # a resume rewrites it
        st = os.statvfs(r)
        with open(os.path.join(r, "filler"), "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - 4096))
        refused(["train", "--resume", rd + "/checkpoint", *shape, "--steps", "30", "--lr", "0.5"],
                "the disk is full")
        check(read(os.path.join(rd, "config.json")) == config,
              "a resume that failed on a full disk wrote its flags over the run's config.json")

        full = tmpfs("fd_full", "4k")
        with open(os.path.join(full, "filler"), "wb") as f:
            f.write(b"\0" * 4096)
        model = os.path.join(full, "model.safetensors")
        refused(["export", rd + "/checkpoint", "-o", model], "writing " + model,
                "the disk is full: free space there")
        for args in (["--help"], ["--version"], ["train", "--help"]):
            with open("/dev/full", "w") as dev_full:
                p = subprocess.run([TZ] + args, stdout=dev_full, stderr=subprocess.PIPE)
            check(p.returncode == 1 and b"could not be written" in p.stderr,
                  f"{args} on a full stdout: exit {p.returncode}")

        # The calibration reserves 256 MiB of swap: where the run directory's disk has less, it
        # runs under $TMPDIR (it refused, advising the run's budgets, which changed nothing).
        small = tmpfs("fd_plan", "20M")
        out = ok(["plan", *shape, "--run-dir", os.path.join(small, "r"), "--nvme-budget", "1MiB",
                  "--no-advice"], env=dict(os.environ, TZ_RATES_FILE=os.path.join(OUT, "fd.rates"),
                                           TMPDIR=OUT))
        check("has under" in out and f"runs under {OUT}" in out, f"plan on a small disk:\n{out}")

        # Note [The NVMe space reserved is what the placement puts there]: a budget of 50 TiB
        # reserves the 34 MiB placed there; plan warns only where those do not fit (it warned of
        # the whole budget, for a run that then trained).
        big = ["--nvme-budget", "50T", "--host-budget", "13MiB", "--steps", "2", "--quiet"]
        room = tmpfs("fd_nvme", "64M")
        out = ok(["plan", *big, "--nvme-path", os.path.join(room, "nv"), "--run-dir",
                  os.path.join(OUT, "fd_nv"), "--no-advice"])
        check("but: train reserves" not in out, f"plan warned of NVMe room there is:\n{out}")
        ok(["train", *big, "--nvme-path", os.path.join(room, "nv"), "--run-dir",
            os.path.join(OUT, "fd_nv")])
        out = ok(["plan", *big, "--nvme-path", os.path.join(small, "nv"), "--run-dir",
                  os.path.join(OUT, "fd_nv2"), "--no-advice"])
        check("but: train reserves what the placement puts on NVMe (33.69 MiB)" in out,
              f"plan did not warn of NVMe room there is not:\n{out}")
        refused(["train", *big, "--nvme-path", os.path.join(small, "nv"), "--run-dir",
                 os.path.join(OUT, "fd_nv2")], "free there")
    finally:
        for mnt in reversed(mounts):
            subprocess.run(["umount", "-l", mnt])
