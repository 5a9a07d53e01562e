"""Inputs: special files, Hugging Face directories, flags at the ends of their ranges, limits.

Cases of cli_trust_test.py (see its docstring); each `case_NAME` is run by name."""
import json
import os
import re
import shutil
import struct
import subprocess

from trust_common import (OUT, check, run, refused, ok, write_config, train_small, read,
                          limited_cgroup, into_cgroup, mpirun_env, TZ)


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
    os.makedirs(os.path.join(OUT, "x_ckpt"))  # (a checkpoint path that is there: its config read)
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
    # A tierzero export records its model (metadata tierzero.model); a record missing a field
    # (edited: n_head) is refused, where the run's default for it was taken silently.
    one = os.path.join(OUT, "mi_one.safetensors")
    ok(["export", base + "/checkpoint", "-o", one, "--overwrite"])
    with open(one, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    model = json.loads(header["__metadata__"]["tierzero.model"])
    check(model.get("n_head") == 4, f"the export records {model}")
    ok(["eval", "--init-from", one, "--data", tok])
    del model["n_head"]
    header["__metadata__"]["tierzero.model"] = json.dumps(model)
    text = json.dumps(header).encode()
    edited = os.path.join(OUT, "mi_edited.safetensors")
    with open(edited, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)
    refused(["eval", "--init-from", edited, "--data", tok], "lacks n_head", "edited")
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
    refused(["train", "--init-from", hf, "--data", tok, "--steps", "1", "--run-dir",
             os.path.join(OUT, "mi_nv"), "--nvme-path", hf + "/swap", "--nvme-budget", "64MiB"],
            "--nvme-path", "inside the model directory")
    check(not os.path.exists(hf + "/swap"), "a refused run made its swap directory in the model's")
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
    # Weights finite when loaded whose products overflow (lm_head 3e38): a loss that is not a
    # number is an error, not "mean loss -nan" and exit 0.
    big = os.path.join(OUT, "mi_big")
    shutil.copytree(hf, big)
    blob = bytearray(read(os.path.join(big, "model.safetensors")))
    n = struct.unpack("<Q", blob[:8])[0]
    t = json.loads(blob[8:8 + n])["lm_head.weight"]
    val = {"F32": struct.pack("<f", 3e38), "BF16": struct.pack("<f", 3e38)[2:],
           "F16": struct.pack("<e", 60000.0)}[t["dtype"]]
    for i in range(8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1], len(val)):
        blob[i:i + len(val)] = val
    with open(os.path.join(big, "model.safetensors"), "wb") as f:
        f.write(blob)
    refused(["eval", "--init-from", big, "--data", tok], "not a number", "overflows")
    # A run it seeds is the model of the window's context: its export says so (it said the 32
    # positions, and transformers would attend past the window: another model).
    swr = os.path.join(OUT, "mi_swr")
    ok(["train", "--init-from", sw, "--data", tok, "--seq-len", "16", "--steps", "1", "--run-dir",
        swr, "--quiet"])
    ok(["export", swr + "/checkpoint", "--format", "hf", "-o", swr + "_hf"])
    with open(os.path.join(swr + "_hf", "config.json")) as f:
        out_cfg = json.load(f)
    check(out_cfg.get("max_position_embeddings") == 16 or out_cfg.get("sliding_window") == 16,
          f"the export of a run seeded from a window of 16 says {out_cfg}")
    # Note [What a stopped export leaves]: an export killed part way leaves its lock file, a
    # partial file and no config.json; the next export into it says so and what to do (it said
    # "holds files" of files `ls` does not show). A user's own files are refused as before.
    stopped = os.path.join(OUT, "mi_stopped")
    os.makedirs(stopped)
    for name in (".tierzero.lock", ".model.safetensors.tz-999999-0.tmp"):
        open(os.path.join(stopped, name), "wb").close()
    refused(["export", swr + "/checkpoint", "--format", "hf", "-o", stopped],
            "stopped before its end", "rm -r " + stopped)
    with open(os.path.join(stopped, "notes.txt"), "w") as f:
        f.write("mine")
    rc, out = run(["export", swr + "/checkpoint", "--format", "hf", "-o", stopped])
    check(rc != 0 and "holds files" in out and "stopped before" not in out and
          read(os.path.join(stopped, "notes.txt")) == b"mine",
          f"an export into a directory of a user's files: exit {rc}\n{out}")
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
    # The same where the flag changes the architecture (hunt 47: reset without a word).
    tied = write_config(os.path.join(OUT, "y_tied.json"),
                        model={"tie_embeddings": True, "attention_bias": True})
    rd = os.path.join(OUT, "y_run4b")
    ok(["train", "--config", tied, "--run-dir", rd, "--steps", "1", "--arch", "llama"] + small)
    m = json.load(open(rd + "/config.json"))["model"]
    check(m["arch"] == "llama" and m["tie_embeddings"] and m["attention_bias"],
          f"--arch llama reset what the config asked for: {m}")
    # Activation checkpointing turns off from the command line as well as on (hunt 47).
    rd = os.path.join(OUT, "y_run4c")
    ok(["train", "--config", cfg, "--run-dir", rd, "--steps", "1", "--device-budget", "64MiB",
        "--no-checkpoint-activations"] + small)
    check(not json.load(open(rd + "/config.json"))["model"]["activation_checkpointing"],
          "--no-checkpoint-activations left activation checkpointing on")
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
    digits = write_config(os.path.join(OUT, "y_digits.json"), data={"digits": 5})
    refused(["train", "--config", digits, "--text", text, "--run-dir",
             os.path.join(OUT, "y_run5c")] + small, "data.digits", "addition task's")
    # A rotary field of a GPT-2, whose positions are learned (a Llama config without its arch).
    rope = write_config(os.path.join(OUT, "y_rope.json"), model={"rope_theta": 500000})
    refused(["train", "--config", rope, "--run-dir", os.path.join(OUT, "y_run5b")] + small,
            "model.rope_theta", "arch \"llama\"")
    slow = write_config(os.path.join(OUT, "y_slow.json"), engine={"host_link_bandwidth": 1e-300})
    refused(["train", "--config", slow, "--run-dir", os.path.join(OUT, "y_run7")],
            "host_link_bandwidth")
    rc, out = run(["train", "--config", cfg, "--run-dir", os.path.join(OUT, "y_run8"), "--steps",
                   "1"] + small, env=dict(os.environ, TZ_GPT_FUSED_ATTENTION="no"))
    # A TZ_* the command cannot use: status 2 before it starts, as every tunable's (it failed
    # after the set-up, status 1, Note [The GPT's own tunables]); it leaves nothing, and the
    # corrected command runs.
    check(rc == 2 and "TZ_GPT_FUSED_ATTENTION" in out, f"TZ_GPT_FUSED_ATTENTION=no:\n{out}")
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
    # Seeds are names, any 64-bit value: model.seed 2^62 trained, saved, then failed writing its
    # report, which held it as a quantity past 4.6e18 (hunt 50).
    seeds = write_config(os.path.join(OUT, "x_seeds.json"), model={"seed": 2**64 - 1},
                         data={"seed": 2**64 - 1})
    ok(["train", "--config", seeds, "--run-dir", os.path.join(OUT, "x_seeds"), "--steps", "1",
        "--quiet"])
    ok(["report", os.path.join(OUT, "x_seeds", "report.json"), "-o", os.path.join(OUT, "x_seeds.html")])
    # A RoPE factor a float keeps as 0 made every gradient infinite: every step skipped, exit 0.
    tiny = write_config(os.path.join(OUT, "x_rope.json"), model={"arch": "llama",
                                                                  "rope_factor": 1e-300})
    refused(["train", "--config", tiny, "--run-dir", rd], "rope_factor", "[1e-6, 1e6]")
    # eval's --batch-size is of its windows: 2^21 windows of 8 tokens is 2^24 tokens, however
    # long the model's context (9: its run's config checked the batch against that: hunt 50).
    tok = os.path.join(OUT, "x_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<4000H", *([1, 2, 3, 4] * 1000)))
    ok(["eval", "--resume", os.path.join(OUT, "x_seeds", "checkpoint"), "--data", tok,
        "--seq-len", "8", "--batch-size", str(2**21), "--device-budget", "256MiB"])
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
        refused(["report", path, "-o", page, "--trace", os.path.join(OUT, "x_t.json"),
                 "--overwrite"], "lane")
        check(read(page) == b"my page", "a report that could not be traced replaced the page")


def case_memory_limit():
    # Budgets over the memory this process may use: refused before anything is allocated, with
    # the limit named and a budget that fits (Note [Host memory within the process's limit]),
    # where the kernel's OOM killer ended the run with SIGKILL and nothing printed. A model whose
    # states are about 1.5x this machine's memory, under a host budget four times it.
    with open("/proc/meminfo") as f:
        physical = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
    layers = max(1, int(physical * 1.5 / (14 * 12 * 4096 * 4096)) + 1)
    rd = os.path.join(OUT, "ml_run")
    out = refused(["train", "--layers", str(layers), "--width", "4096", "--heads", "32",
                   "--host-budget", str(physical * 4), "--run-dir", rd],
                  "more than this process may use", "physical memory",
                  "Give host_budget (--host-budget) at most")
    check(not os.path.exists(rd), f"a refused run left {rd}\n{out}")
    # plan agrees with train: a config within its budgets but over this machine's memory is
    # said to be refused here (a narrow model, which plan times in a moment).
    deep = max(1, int(physical * 1.5 / (14 * 12 * 512 * 512)) + 1)
    # (--no-advice: the search for the largest model that fits, past 1700 layers, took over
    # 120 s under a sanitizer's build)
    out = ok(["plan", "--layers", str(deep), "--width", "512", "--heads", "8", "--host-budget",
              str(physical * 4), "--device-budget", "1GiB", "--no-advice"], timeout=300)
    check("more than this process may use" in out and "train would refuse it" in out,
          f"plan of a run over this machine's memory does not say train refuses it\n{out}")
    # The same under a cgroup's limit (a container, a batch job), where one can be made here.
    d = limited_cgroup("memory", 1 << 30)
    if d is None:
        print("      (memory_limit: no memory cgroup can be made here; the cgroup part is left out)")
        return
    try:
        rc, out = run(["train", "--layers", "8", "--width", "1024", "--heads", "16", "--steps",
                       "3", "--host-budget", "8GiB", "--device-budget", "1GiB", "--run-dir", rd],
                      timeout=300, preexec_fn=into_cgroup(d))
        check(rc == 1 and "more than this process may use" in out and d in out,
              f"a run over its cgroup's memory: exit status {rc}\n{out}")
        check(not os.path.exists(rd), f"a refused run left {rd}\n{out}")
        # A run within the limit is not refused.
        small = os.path.join(OUT, "small.json")
        rc, out = run(["train", "--config", small, "--run-dir", rd], timeout=300,
                      preexec_fn=into_cgroup(d))
        check(rc == 0, f"a small run under a 1 GiB cgroup: exit status {rc}\n{out}")
        # Activations past the limit, on the simulated device, whose memory is host memory: the
        # OOM killer ended it after its step-0 evaluation, exit 137 and no word (hunt 49).
        rd = os.path.join(OUT, "ml_act")
        rc, out = run(["train", "--batch-size", "2048", "--device-budget", "2GiB",
                       "--no-checkpoint-activations", "--steps", "2", "--run-dir", rd],
                      timeout=300, preexec_fn=into_cgroup(d))
        check(rc == 1 and "its activations" in out and "more than this process may use" in out and
              "eval  step" not in out, f"activations over a cgroup's memory: exit {rc}\n{out}")
        check(not os.path.exists(rd), f"a refused run left {rd}\n{out}")
        # Two ranks on this machine, each within the limit and together past it: their
        # activations were counted for one rank alone, and the OOM killer ended them.
        mpirun, menv = mpirun_env()
        if mpirun:
            rd = os.path.join(OUT, "ml_ranks")
            p = subprocess.run([mpirun, "-np", "2", TZ, "train", "--batch-size", "1024",
                                "--device-budget", "2GiB", "--no-checkpoint-activations",
                                "--steps", "2", "--run-dir", rd], env=menv, timeout=300,
                               preexec_fn=into_cgroup(d), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            check(p.returncode != 0 and "2 ranks on this machine need" in p.stdout and
                  p.stdout.count("more than this process may use") == 1 and
                  "eval  step" not in p.stdout,
                  f"two ranks over a cgroup's memory: exit {p.returncode}\n{p.stdout}")
    finally:
        os.rmdir(d)


def case_one_model_two_spellings():
    # A model's n_kv_head 0 means n_head's count, d_ff 0 its architecture's width: a native
    # Llama run records 0, one seeded from a model directory the counts. Compared as they
    # compute, the same model written either way is not refused (it was: "drop any override",
    # hunt 46); another count still is.
    tok = os.path.join(OUT, "ms_tok.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<8192H", *[(i * 7) % 256 for i in range(8192)]))
    a, b = os.path.join(OUT, "ms_a"), os.path.join(OUT, "ms_b")
    ok(["train", "--arch", "llama", "--layers", "2", "--width", "64", "--heads", "4", "--vocab",
        "256", "--seq-len", "32", "--data", tok, "--steps", "2", "--run-dir", a, "--quiet"])
    ok(["export", a + "/checkpoint", "-o", a + ".safetensors"])
    ok(["export", a + "/checkpoint", "--format", "hf", "-o", a + "_hf"])
    ok(["train", "--init-from", a + "_hf", "--data", tok, "--steps", "2", "--run-dir", b,
        "--quiet"])
    ok(["export", b + "/checkpoint", "-o", b + ".safetensors"])
    loss = lambda out: re.search(r"mean loss ([0-9.]+)", out).group(1)
    base = loss(ok(["eval", "--resume", a + "/checkpoint", "--data", tok]))
    for args in (["--resume", a + "/checkpoint", "--kv-heads", "4"],
                 ["--init-from", a + ".safetensors", "--kv-heads", "4"],
                 ["--init-from", a + "_hf", "--kv-heads", "4"]):
        check(loss(ok(["eval"] + args + ["--data", tok])) == base, f"eval {args}: another loss")
    for args in (["--resume", b + "/checkpoint", "--kv-heads", "0"],
                 ["--init-from", b + ".safetensors", "--kv-heads", "0"]):
        ok(["eval"] + args + ["--data", tok])
    dff = write_config(os.path.join(OUT, "ms_dff.json"), {"model": {"arch": "llama", "d_ff": 192}})
    check(loss(ok(["eval", "--resume", a + "/checkpoint", "--config", dff, "--data", tok])) == base,
          "d_ff 192 written out: another loss")
    refused(["eval", "--resume", a + "/checkpoint", "--kv-heads", "2", "--data", tok],
            "n_kv_head")
    refused(["eval", "--init-from", b + ".safetensors", "--kv-heads", "2", "--data", tok],
            "n_kv_head")
    # A window longer than the context trained, within the positions the model knows: scored
    # from the checkpoint as from its export (it was refused as another seq_len).
    g, gs = os.path.join(OUT, "ms_g"), os.path.join(OUT, "ms_gs")
    ok(["train", "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "256", "--seq-len",
        "16", "--data", tok, "--steps", "1", "--run-dir", g, "--quiet"])
    ok(["export", g + "/checkpoint", "--format", "hf", "-o", g + "_hf"])
    ok(["train", "--init-from", g + "_hf", "--seq-len", "8", "--data", tok, "--steps", "1",
        "--run-dir", gs, "--quiet"])
    ok(["export", gs + "/checkpoint", "-o", gs + ".safetensors"])
    want = loss(ok(["eval", "--init-from", gs + ".safetensors", "--data", tok, "--seq-len", "16"]))
    check(loss(ok(["eval", "--resume", gs + "/checkpoint", "--data", tok, "--seq-len", "16"])) ==
          want, "a window within the positions: the checkpoint and its export disagree")
