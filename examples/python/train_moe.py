#!/usr/bin/env python3
"""Train a small transformer language model with MoE blocks twice: once with afdep.MoE and
once with a plain-PyTorch MoE of the same function and the same initial weights (same data,
same optimizer), and write both loss curves and step times.

The corpus is synthetic: token sequences from a fixed random Markov chain over a small
vocabulary (seeded; each token has three likely successors), so the model has something
learnable and the loss falls well below log(vocab) (the uniform guess). On the CPU the MoE runs afdep's oracle in float32; on CUDA afdep's GPU layer in
bfloat16 (both runs use bfloat16 MoE parameters there).

    python examples/python/train_moe.py --device cpu --steps 300 --out out/
    python examples/python/train_moe.py --device cuda --steps 300 --out out/

Writes OUT/train_moe.csv (step, loss of each run), OUT/train_moe.json (settings, final
losses, median step times) and OUT/train_moe.png (both curves; only when matplotlib is
installed, else says so).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import afdep
from afdep.reference import ReferenceMoE


class Corpus:
    """Sequences from a random Markov chain: each token has 3 likely successors."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 0.5
        top = torch.randint(0, vocab, (vocab, 3), generator=g)
        logits.scatter_(1, top, 4.0)
        self.p = torch.softmax(logits, dim=-1)
        self.vocab = vocab
        self.entropy = float(-(self.p * self.p.log()).sum(-1).mean())

    def batch(self, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
        seq = torch.randint(0, self.vocab, (batch, 1), generator=g)
        for _ in range(length):
            p = self.p[seq[:, -1]]
            seq = torch.cat([seq, torch.multinomial(p, 1, generator=g)], dim=1)
        return seq  # [batch, length + 1]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, moe: nn.Module, moe_dtype: torch.dtype):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.moe = moe
        self.moe_dtype = moe_dtype

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x)
        b, t, d = h.shape
        y = self.moe(h.reshape(b * t, d).to(self.moe_dtype).contiguous())
        return x + y.reshape(b, t, d).to(x.dtype)


class LM(nn.Module):
    def __init__(self, vocab, d, heads, layers, length, moe_args, moe_dtype):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.02)
        self.blocks = nn.ModuleList(
            Block(d, heads, afdep.MoE(**moe_args).to(moe_dtype), moe_dtype) for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.emb(tokens) + self.pos[:t]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def train(model, corpus, args, device, label):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)  # same batches for both runs
    losses, times = [], []
    for step in range(args.steps):
        seq = corpus.batch(args.batch, args.length, g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"{label}: non-finite loss at step {step}")
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"{label:>8} step {step:4d} loss {losses[-1]:.4f} ({times[-1] * 1e3:.1f} ms)",
                  flush=True)
    return losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--shared", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="train_moe_out")
    args = ap.parse_args()

    device = torch.device(args.device)
    moe_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(args.seed)
    corpus = Corpus(args.vocab, args.seed)
    moe_args = dict(d_model=args.d_model, width=args.width, experts=args.experts,
                    top_k=args.top_k, shared=args.shared)
    afdep_lm = LM(args.vocab, args.d_model, 4, args.layers, args.length, moe_args, moe_dtype)
    torch_lm = copy.deepcopy(afdep_lm)
    for blk in torch_lm.blocks:
        blk.moe = ReferenceMoE(blk.moe)  # the same weights, plain torch ops
    afdep_lm.to(device)
    torch_lm.to(device)

    runs = {}
    for label, model in (("afdep", afdep_lm), ("pytorch", torch_lm)):
        runs[label] = train(model, corpus, args, device, label)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_moe.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_afdep", "loss_pytorch", "step_s_afdep", "step_s_pytorch"])
        for i in range(args.steps):
            w.writerow([i, runs["afdep"][0][i], runs["pytorch"][0][i], runs["afdep"][1][i],
                        runs["pytorch"][1][i]])
    tail = max(1, args.steps // 10)
    summary = {
        "settings": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "moe_dtype": str(moe_dtype),
        "initial_loss": {k: v[0][0] for k, v in runs.items()},
        f"final_loss_mean_last_{tail}": {k: statistics.fmean(v[0][-tail:]) for k, v in runs.items()},
        "median_step_ms_after_10": {
            k: 1e3 * statistics.median(v[1][10:] or v[1]) for k, v in runs.items()
        },
        "max_abs_loss_difference": max(
            abs(a - b) for a, b in zip(runs["afdep"][0], runs["pytorch"][0])
        ),
        "log_vocab": math.log(args.vocab),
        "corpus_entropy_mean": corpus.entropy,
    }
    (out / "train_moe.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: wrote {out / 'train_moe.csv'} (no PNG)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (k, v), style in zip(runs.items(), ("-", "--")):
        ms = summary["median_step_ms_after_10"][k]
        ax.plot(v[0], style, label=f"{k} MoE (median step {ms:.1f} ms)", linewidth=1.2)
    ax.axhline(corpus.entropy, color="gray", linewidth=0.8, label="corpus entropy (the floor)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(
        f"MoE LM on {summary['device']}: afdep.MoE vs plain PyTorch ({moe_dtype}); "
        f"max |Δloss| {summary['max_abs_loss_difference']:.2g}",
        fontsize=10,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "train_moe.png", dpi=120)
    print(f"wrote {out / 'train_moe.png'}")


if __name__ == "__main__":
    main()
