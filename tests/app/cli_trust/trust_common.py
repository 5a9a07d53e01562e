"""What every cli_trust case uses: running tierzero, checking its refusals, small configs."""
import json
import os
import shutil
import subprocess
import sys
import time

# The driver's arguments (cli_trust_test.py TIERZERO OUT_DIR [CASE...]).
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


def nobody_runs(case):
    """Whether tierzero can be run as `nobody` from OUT: this process is root (root's limits and
    permissions are not enforced, so cases about them run as `nobody`) and `nobody` may reach the
    binary, its libraries and OUT (a clone under a private home, as CI's, is not). Says why not
    where it cannot; the caller then skips the part that needs it."""
    if os.geteuid() != 0:
        print(f"      ({case}: not root: the part run as `nobody` is skipped)")
        return False
    os.chmod(OUT, 0o777)

    def as_nobody():
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    try:
        p = subprocess.run([TZ, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=60, cwd=OUT, preexec_fn=as_nobody)
        if p.returncode == 0:
            return True
        why = p.stdout.decode(errors="replace").strip().splitlines()[-1:] or [f"status {p.returncode}"]
        why = why[0]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    print(f"      ({case}: `nobody` cannot run {TZ} from {OUT} here ({why}): that part is skipped)")
    return False


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


def start_long_run(name, *extra, console=subprocess.DEVNULL, **kw):
    """A run of a million steps on the small config in OUT/name, to be stopped by a signal."""
    cfg = os.path.join(OUT, "small.json")
    return subprocess.Popen([TZ, "train", "--config", cfg, "--run-dir", os.path.join(OUT, name),
                             "--steps", "1000000"] + list(extra), stdout=console,
                            stderr=subprocess.STDOUT if console == subprocess.PIPE
                            else subprocess.DEVNULL, cwd=OUT, **kw)


def limited_cgroup(controller, limit):
    """A cgroup of this test's own whose `controller` ("memory" or "pids") is limited to `limit`
    (cgroup v1's hierarchy of that controller, or v2 with it enabled), or None where this machine
    does not let one be made. The caller removes it (os.rmdir) once its processes have ended."""
    name = f"tz_cli_trust_{controller}_{os.getpid()}"
    v1_file = {"memory": "memory.limit_in_bytes", "pids": "pids.max"}[controller]
    v2_file = {"memory": "memory.max", "pids": "pids.max"}[controller]
    for base, limit_file in ((f"/sys/fs/cgroup/{controller}", v1_file),
                             ("/sys/fs/cgroup", v2_file)):
        d = os.path.join(base, name)
        try:
            # (v1's root has no limit file of its own, pids.max; its hierarchy has tasks.)
            if not os.path.exists(os.path.join(base, "tasks" if base.endswith(controller)
                                               else "cgroup.subtree_control")):
                continue
            os.mkdir(d)
        except OSError:
            continue
        try:
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(str(limit))
            # A process may be moved into it (cgroup v2 delegation may refuse: EBUSY, EACCES).
            subprocess.run(["true"], preexec_fn=into_cgroup(d), check=True, timeout=30)
            return d
        except (OSError, subprocess.SubprocessError):
            for _ in range(50):  # (empty once the probe is reaped)
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.1)
    return None


def into_cgroup(d):
    """A preexec_fn that moves the child into cgroup directory `d`."""
    def enter():
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return enter

