"""The built-in GPT of tierzero (models/gpt/gpt.h) in PyTorch, for bench/torch_compare.sh.

Same architecture (GPT-2: learned positions, pre-LayerNorm blocks, tanh GELU, tied head), same
initialisation rule, same AdamW settings and schedule, same batches (tierzero's samplers of
models/gpt/data.cc ported below), fp32, everything in memory. Prints one JSON line with the
per-step wall times of the run (data made before the clock starts, as tierzero's is cheap).

    /usr/bin/python3 bench/torch_gpt.py --layers 5 --width 192 --heads 6 --seq 9 --batch 16 \
        --steps 150 --data addition --threads 2
"""
import argparse
import ctypes
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

M64 = (1 << 64) - 1


def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def row_key(seed, validation, index, r):
    return mix(mix(seed * 2 + (1 if validation else 0)) ^ ((mix(index) * 31) & M64) ^ r)


def addition_row(key, digits, seq, reverse=True):
    limit = 10**digits
    attempt = 0
    while True:
        r = mix(key ^ mix(attempt))
        a, b = r % limit, mix(r) % limit
        if mix((a * 1000003 + b) & M64) % 10 != 0:  # a training pair (not held out)
            break
        attempt += 1
    s = str(a + b)
    if reverse:
        s = s[::-1]
    s = f"{a}+{b}={s}\n"
    eq = s.index("=")
    tok = [ord(s[t]) if t < len(s) else 10 for t in range(seq)]
    tgt = [ord(s[t + 1]) if t + 1 < len(s) else 10 for t in range(seq)]
    mask = [1.0 if (t >= eq and t + 1 < len(s)) else 0.0 for t in range(seq)]
    return tok, tgt, mask


def make_batches(args, text):
    batches = []
    for step in range(args.steps):
        toks, tgts, masks = [], [], []
        for r in range(args.batch):
            key = row_key(args.seed, False, step, r)
            if args.data == "addition":
                tok, tgt, mask = addition_row(key, args.digits, args.seq)
            else:
                split = len(text) * 9 // 10
                span = split - args.seq - 1
                start = key % (span + 1)
                tok = list(text[start:start + args.seq])
                tgt = list(text[start + 1:start + args.seq + 1])
                mask = [1.0] * args.seq
            toks.append(tok)
            tgts.append(tgt)
            masks.append(mask)
        batches.append((torch.tensor(toks), torch.tensor(tgts), torch.tensor(masks)))
    return batches


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        hd = c // self.heads
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, seq, c, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(seq, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--data", choices=["addition", "text"], required=True)
    ap.add_argument("--text", default="")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    text = open(args.text, "rb").read() if args.data == "text" else b""
    batches = make_batches(args, text)
    model = Gpt(256, args.seq, args.width, args.layers, args.heads)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    warmup, min_lr = 50, args.lr / 10
    step_s, losses = [], []
    for step, (tok, tgt, mask) in enumerate(batches):
        t0 = time.perf_counter()
        if step < warmup:
            lr = args.lr * (step + 1) / warmup
        else:
            frac = (step - warmup) / max(1, args.steps - warmup)
            lr = min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(tok)
        per_token = F.cross_entropy(logits.view(-1, 256), tgt.view(-1), reduction="none")
        loss = (per_token * mask.view(-1)).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    blas = sorted({l.split()[-1] for l in open("/proc/self/maps") if "blas" in l})
    core = ""
    for path in blas:  # OpenBLAS names the kernels it picked (OPENBLAS_CORETYPE forces them)
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            core = lib.openblas_get_corename().decode()
            break
        except (OSError, AttributeError):
            pass
    print(json.dumps({"step_s": step_s, "loss": losses, "threads": torch.get_num_threads(),
                      "blas": blas, "blas_core": core, "torch": torch.__version__}))


if __name__ == "__main__":
    sys.exit(main())
