#!/usr/bin/env python3
"""cli_trust_test.py TIERZERO OUT_DIR [CASE...]: the CLI people can trust with their runs (issue 41).

One case per class of fault, each through the `tierzero` binary as a user runs it:
  outputs       what an output path names decides how it is written (docs/outputs.md): a device
                node, a FIFO, a symlink, a directory, a user's file beside the output
  nvme_path     a config's engine.nvme_path naming a user's file: never truncated or removed
  self_export   an export never writes over the checkpoint or config it reads
  run_dir       a new run into a directory holding another run is refused; --overwrite replaces it
  config_elsewhere  a run's config.json with another --run-dir writes there; a moved run resumes
  lock          two runs into one directory at once: the second is refused, the first is intact;
                no plan, page or export is written into a running run's directory
  config_json   a run whose config.json cannot be written stops before training
  resume_exact  10 + 10 resumed steps equal 20 uninterrupted, loss for loss, with skipped steps
  resume_other_split  a resume under another split of ranks and accumulation continues the data
  resume_older_config  an older build's config.json (fewer fields) resumes its run
  profile_step  --profile-step of a step the run does not profile (its warm-up, or passed) is refused
  resume_model  resuming with another model shape (--heads) is refused
  checkpoint_model  a checkpoint records its model: saved outside its run directory, it
                evaluates and exports without --config (or with one naming no model field), at
                the machine's budgets; what the user names is kept (another model refused);
                train refuses rather than revert a moved run's settings to the defaults;
                --resume RUN/checkpoint of a run that saved elsewhere names where
  resume_notes  an evaluation a data error left undone is made by the resume; a resume that
                takes other rows or other files than the checkpoint's run says so
  resume_settings  a resume that changes AdamW's settings, the lr below 4 digits, or the
                layout of 8-bit moments says so
  resume_older_checkpoint  an older build's checkpoint takes its model and settings from its
                run's config.json (another --heads refused, a new schedule noted), or says so
  ranks_agree   ranks started with different configs fail with the fields named (mpirun ':')
  plan_hpz      hpZ's node gathers and host secondary partition: the plan's bytes per link are
                the run's; device shards through host collectives: plan refuses as train does
  rank_stops_in_save  a rank stopped while it saves: the job aborted in about the timeout
  rank_never_reads  a rank blocked on its config or gone before it joined: the job ends at the
                collective deadline; one rank's text a FIFO, a data error on both: no trace left
  ranks_faults  two ranks whose data changes or whose metrics file fails mid-run: all save first
  readers       a directory, /dev/zero, a huge sparse file, deep or duplicate-key JSON: an error
  setup_signal  SIGINT/SIGTERM while set-up blocks on a FIFO ends the process promptly
  eval_recorded_data  eval --resume without --data scores its run's files only by an absolute path
  eval_defaults  eval without --data scores the run's validation split, the file it read from
                any directory; its refusals advise what eval takes
  eval_swap_signal  a signal ends an evaluation whose swap file it made: the file goes too
  dirs_moved    a checkpoint directory swapped for a link to another run's mid-run: that one
                untouched, the save follows the moved one; a run directory removed mid-run: its
                metrics, config.json and checkpoint written again, the run resumes
  eval_signal   one SIGTERM in a long evaluation of train stops it within a batch: saved with
                the evaluation undone (the resume makes it), or the last one said not made
  run_signals   a stdout reader gone, a closed stdout, a run blocked on a full FIFO, an export
  late_faults   faults found late: a config the report cannot hold, a finished run resumed, a
                foreign manifest.json, a set-up failing after config.json, data changing mid-run
  ranges        sizes at the ends of their ranges, absurd rates, a report of nonsense values
  file_size_limit  a checkpoint or export past `ulimit -f`: an error naming the limit, no
                core, no temporary left, the resumed checkpoint unchanged
  address_space_limit  `ulimit -v` or `ulimit -s` too small: refused naming the limit (not a
                SIGSEGV or "a bug"), nothing of the run left; a low soft limit is raised;
                4096 CPU Adam threads under `ulimit -v` train (no std::terminate)
  resume_elsewhere  a run resumed from another working directory (its config.json's relative
                paths) continues in place, bit for bit
  thread_limit  `ulimit -u` under an arena of 16 threads: oneTBB held to what can start, no
                std::terminate
  pids_limit    a cgroup's pids.max under an arena of 64 threads: trains, or an error naming it
  memory_limit  budgets over the machine's memory, or a cgroup's limit where one can be made
                here: refused before anything is allocated, not ended by the OOM killer
  export_paths  `export DIR/` and `export .` find the run's config
  models_in     a Hugging Face directory's context, files and seeding of a resumed run
  plan_device   a plan's rates are measured on the device the planned run computes on
  plan_refuses_as_train  what train refuses at set-up has no plan; an --init-from not here is said
  figures       figures a user reads against what they count: the step's NVMe optimizer
                bytes, the header's model states
  plan_largest_times  plan --largest times its answer's own shape, as a plan of that model alone
  plan_of_another_config  `train --plan` refuses a plan of another config; plan refuses data
                train would refuse
  plan_advice   each change plan advises (a budget, a smaller batch or sequence) fits when planned
  device_fit_early  a device too small for the activations: refused at set-up, before the
                step-0 evaluation (plan's own words); the budget that fits trains
  plan_limits   a limit on the address space (ulimit -v): plan says what train refuses
  plan_device_states  8-bit moments kept on the device: the plan's device peak is the run's
  plan_files    plan files, rates files and warm-up traces edited: refused where read, before a
                run trains, naming the file and field; a resumed run's recorded plan gone is said
  long_paths    a run directory or output too deep or too long for the names written at the end:
                refused at set-up, nothing left (it trained, then could not save)
  full_disks    a full disk under the metrics, a resume, an export, stdout and plan's
                calibration: whole lines kept, the run's config.json kept, the path named
  metrics_durable  a power cut (an ext4 image shut down) after the last checkpoint: the metrics
                of its steps are on the disk too
  output        a line every --log-every steps without a terminal; one line in place on one
  stdout_data   an output that is stdout holds the data alone (the command's lines on stderr)
  resume_copy   a resume into another run directory says it is a copy, and how to continue in
                place; a moved run's refusal names its config and directory
  flag_forms    --name=value, numbers as a shell user writes them (.001), an lr below the
                default floor
  resume_mistakes  a mistyped --resume, a manifest removed, a recorded profile step past a
                shorter resume: said as what they are
  older_files   a config.json and a plan of the build before model.token_ids; a glob under a
                directory whose name has glob characters
  outputs_taken  a --report another process wrote meanwhile: kept, and the run's config.json
                records where its own went, so a resume does not replace it
The cases live in cli_trust/ by theme (trust_outputs, trust_resume, trust_ranks, trust_signals,
trust_inputs, trust_plans, trust_disks, trust_config, trust_eval); trust_common.py holds what
they share.
Every failure must be an `error:` line and exit status 1 or 2: never a signal, an abort, an
uncaught exception or a hang.
"""
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_trust"))

import trust_config  # noqa: E402
import trust_disks  # noqa: E402
import trust_eval  # noqa: E402
import trust_inputs  # noqa: E402
import trust_outputs  # noqa: E402
import trust_plans  # noqa: E402
import trust_ranks  # noqa: E402
import trust_resume  # noqa: E402
import trust_signals  # noqa: E402
from trust_common import OUT, ONLY, Failure, write_config  # noqa: E402

CASES = sorted((n[5:], f) for m in (trust_config, trust_disks, trust_eval, trust_inputs,
                                     trust_outputs, trust_plans, trust_ranks, trust_resume,
                                     trust_signals)
               for n, f in vars(m).items() if n.startswith("case_"))


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
