// `tierzero train --help`: the command's options, in the terms of docs/config.md.
#include "train.h"

namespace tierzero::app {

// train.h
const char* TrainHelp() {
  return R"(usage: tierzero train [--config FILE] [options]

Trains the built-in GPT (default: 2-digit addition, zero-padded, 1600 steps of 32 rows, with a
model whose states are 2.9x the device budget and larger than the host budget, so device, host
and NVMe are all used). Every config field is documented in docs/config.md; these options
override the config:

  --config FILE          JSON config (sections model, data, train, engine, output, ranks, zeropp)
  --steps N              optimizer steps               --batch-size N   rows per micro-batch
  --lr X                 peak learning rate            --eval-every N   steps between evaluations
  --device auto|cuda|host                              --dtype bf16|fp16|fp32
  --device-budget SIZE   --host-budget SIZE            --nvme-budget SIZE   --nvme-path DIR
  --grad-accumulation N  --layers N  --width N  --heads N
  --checkpoint-activations, --no-checkpoint-activations
                         keep only block inputs and recompute in backward, or keep every
                         activation (model.activation_checkpointing; on by default)
  --activations auto|fp32|bf16   the type activations are stored in (model.activations)
  --arch gpt2|llama      the architecture (model.arch; docs/models.md)   --kv-heads N
  --optimizer-states fp32|bf16|int8   how Adam's m and v are stored (engine.optimizer_states)
  --text FILE            train on a UTF-8 text file (byte-level) instead of addition
  --data PATH            train on token files: llm.c shards (uint16, or Llama 3's uint32) or
                         raw uint16 .bin (a file or a glob of shards; set model.vocab to the
                         tokenizer's, docs/data.md)
  --seq-len T            context length (model.seq_len)
  --vocab N              vocabulary size (model.vocab; a tokenizer's, for --data)
  --seed N               data seed
  --run-dir DIR          outputs (default runs/default)
  --metrics FILE         JSON lines, one per step and per evaluation (default RUN_DIR/metrics.jsonl)
  --report FILE          memory placement report (default RUN_DIR/report.json)
  --profile-step N       profile step N for the report (default: the first planned iteration)
  --html FILE            the report as an HTML page, charts that open offline
                         (default RUN_DIR/report.html; none: not written)
  --trace FILE           the profiled iteration as a Chrome trace for Perfetto
                         (default RUN_DIR/trace.json; none: not written)
  --checkpoint DIR       where checkpoints go (default RUN_DIR/checkpoint; none: no checkpoint)
  --resume DIR           continue from a checkpoint
  --init-from FILE|DIR   start from a safetensors file's parameters (tierzero's export records
                         its model, which the run takes) or a Hugging Face model directory
  --plan FILE            this run's `tierzero plan --json` file: the report (summary, page)
                         shows the prediction beside what the run measured
  --overwrite            replace another run's outputs in RUN_DIR (refused without it)
  --log-every N          without a terminal, a step line every N steps (default: ~20 lines)
  --quiet                no per-step lines

A run directory holding another run is refused: --resume RUN_DIR/checkpoint continues it,
--overwrite replaces it (docs/outputs.md). One process writes a run directory at a time.
Ctrl-C (SIGINT) or SIGTERM finishes the current step, saves a checkpoint and exits 0 (during the
run's set-up, before its first line, it ends the process at once: nothing is saved yet).
)";
}

}  // namespace tierzero::app
