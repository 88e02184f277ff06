"""Training throughput of hybrid's models against a nanoGPT-style baseline, side by side in one process.

The baseline (NanoGPT below) is written here from nanoGPT's public description: learned position
embeddings, pre-LayerNorm blocks, one fused q|k|v projection, causal SDPA, a 4x GELU MLP, tied
embedding/head, cross-entropy on the logits, AdamW (betas 0.9/0.95, weight decay on matrices only).
Both models see the same batch shape and vocabulary, train in fp32 with the same learning rate, and
their steps (forward + backward + optimizer step) are interleaved: repeat r times model A, model B, ...
so a noisy machine slows them alike. Printed: tokens/s (median over repeats) and the ratio to the baseline
(and to `attn` when it runs), the median of the per-repeat ratios with an interval for it (median_interval):
a ratio whose interval straddles a target has not shown it either way.

    python bench/bench_nanogpt.py                                  # dense attention vs the baseline
    python bench/bench_nanogpt.py --kinds attn kda gdn mla --threads 1
    python bench/bench_nanogpt.py --kinds attn attn_nope --threads 1   # what RoPE costs
    python bench/bench_nanogpt.py --kinds attn kda --threads 1 --compile   # every model compiled, the baseline too
    python bench/bench_nanogpt.py --steps 2 --repeat 1 --T 32 --B 2   # a quick smoke run
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import GPT, ConfigError, ModelConfig  # noqa: E402
from train import make_optimizer  # noqa: E402
from config import TrainConfig  # noqa: E402


class NanoBlock(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)                            # q, k, v in one matmul
        self.proj = nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):                                         # x [B, T, d]
        x = x + self.attend(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def attend(self, x):
        """q|k|v in one matmul, causal SDPA, output matmul (bench_layers.py times it alone)."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        heads = lambda t: t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def mlp(self, x):
        return self.fc_out(F.gelu(self.fc(x)))


class NanoGPT(nn.Module):
    """The baseline: token + learned position embeddings, n pre-LN blocks, final LayerNorm, tied head."""

    def __init__(self, vocab, d, n_layer, n_heads, max_len):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(NanoBlock(d, n_heads) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def nano_optimizer(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def _order_statistic(n, level=0.95):
    """(k, coverage): the largest k whose order statistics x_(k), x_(n+1-k) of n draws hold their median with
    probability 1 - 2 P(Binomial(n, 1/2) < k) >= level; k = 1 (the range) when none does."""
    k, coverage = 1, 1 - 2 * 0.5 ** n
    for j in range(2, n // 2 + 1):
        c = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
        if c < level:
            break
        k, coverage = j, c
    return k, coverage


def median_interval(values, level=0.95):
    """(median, low, high, coverage): the median of `values` and a distribution-free interval for the median
    of what they are draws of: the order statistics x_(k) and x_(n+1-k) of _order_statistic (15 values: x_(4),
    x_(12), 96.5%). With fewer than 6 values no interval reaches 95%: the range, and its coverage (5 values:
    93.8%)."""
    x, n = sorted(values), len(values)
    k, coverage = _order_statistic(n, level)
    return statistics.median(x), x[k - 1], x[n - k], coverage


def ratio_text(nums, dens, name):
    """'0.97x name [0.95, 0.99]': the median of the per-repeat ratios nums[i] / dens[i] and median_interval's
    interval (paired repeats, so a slow minute that slows both cancels)."""
    mid, low, high, _ = median_interval([a / b for a, b in zip(nums, dens)])
    return f"{mid:5.2f}x {name} [{low:.2f}, {high:.2f}]"


def ratio_note(n):
    """The line under a table of ratio_text figures over n repeats."""
    return (f"(ratios: the median of the {n} per-repeat ratios; [low, high]: a {_order_statistic(n)[1]:.1%} "
            f"distribution-free interval for it)")


def hybrid_config(kind, args):
    """A one-kind hybrid model at the benchmark shape (MHA attention with RoPE for `attn`; `attn_nope`
    is the same without RoPE, like the baseline, which pays nothing for its learned positions)."""
    return ModelConfig.from_dict(hybrid_layers(kind, args))


def hybrid_layers(kind, args):
    """hybrid_config's model section as a dict (bench_revisions.py hands it to other revisions)."""
    H, D = args.heads, args.d // args.heads
    mixers = {"attn": {"kind": "attn", "n_heads": H},
              "attn_nope": {"kind": "attn", "n_heads": H, "rope": False},
              "kda": {"kind": "kda", "n_heads": H, "head_dim": D},
              "gdn": {"kind": "gdn", "n_heads": H, "head_dim": D},
              "linear": {"kind": "linear", "n_heads": H, "head_dim": D},
              "mla": {"kind": "mla", "n_heads": H, "kv_lora_rank": D, "qk_nope_dim": D // 2,
                      "qk_rope_dim": D // 2, "v_head_dim": D}}
    if kind not in mixers:
        raise ConfigError(f"--kinds: unknown kind {kind!r}; allowed: {', '.join(mixers)}")
    return {"vocab_size": args.vocab, "d_model": args.d, "n_layer": args.layers, "pattern": [kind],
            "layers": {kind: mixers[kind]}}


def add_shape_args(p):
    """The benchmark shape's flags: width, depth, heads, length, batch, vocabulary."""
    for name, default in (("d", 256), ("layers", 4), ("heads", 4), ("T", 256), ("B", 8), ("vocab", 257)):
        p.add_argument(f"--{name}", type=int, default=default)


def check_args(args, more=()):
    """A ConfigError naming the first shape flag (or flag in `more`) below 1, or heads not dividing d."""
    for name in ("d", "layers", "heads", "T", "B", "vocab", *more):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}: must be an integer >= 1 (got {getattr(args, name)})")
    if args.d % args.heads:
        raise ConfigError(f"--heads: must divide --d={args.d} (got {args.heads})")


def parse_checked(p, argv):
    """Parse argv; check the shape flags, --steps, --repeat and every --kinds before any model is built (None
    after one error line if one is bad); apply --threads."""
    args = p.parse_args(argv)
    try:
        check_args(args, ("steps", "repeat"))
        for kind in args.kinds:
            hybrid_config(kind, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def train_step(model, opt, x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["attn"], help="hybrid mixer kinds (one model each)")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    p.add_argument("--repeat", type=int, default=5, help="interleaved repeats (median reported)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every model, the baseline too (nanoGPT's train.py compiles by default)")
    args = parse_checked(p, argv)
    if args is None:
        return 2
    cfgs = {kind: hybrid_config(kind, args) for kind in args.kinds}
    torch.manual_seed(0)
    lr = 1e-3
    models = {"nanogpt": NanoGPT(args.vocab, args.d, args.layers, args.heads, args.T)}
    opts = {"nanogpt": nano_optimizer(models["nanogpt"], lr)}
    for kind in args.kinds:
        models[kind] = GPT(cfgs[kind])
        opts[kind] = make_optimizer(models[kind], TrainConfig(lr=lr))
    x = torch.randint(0, args.vocab, (args.B, args.T))
    y = torch.roll(x, -1, dims=1)
    run = {name: torch.compile(m) if args.compile else m for name, m in models.items()}
    for name in models:                                           # warm-up (with --compile: the compile)
        t0 = time.perf_counter()
        train_step(run[name], opts[name], x, y)
        if args.compile:
            print(f"{name}: compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    rates = {name: [] for name in models}
    for _ in range(args.repeat):
        for name in models:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(run[name], opts[name], x, y)
            rates[name].append(args.steps * args.B * args.T / (time.perf_counter() - t0))
    print(f"training tokens/s, d={args.d} layers={args.layers} heads={args.heads} T={args.T} B={args.B} "
          f"vocab={args.vocab} fp32, {'torch.compile (inductor)' if args.compile else 'eager'}, "
          f"threads={torch.get_num_threads()}, median of {args.repeat} interleaved repeats of {args.steps} steps")
    for name, r in rates.items():
        params = sum(q.numel() for q in models[name].parameters()) / 1e6
        vs_attn = ""
        if "attn" in rates and name not in ("attn", "nanogpt"):
            vs_attn = f"  {ratio_text(r, rates['attn'], 'attn')}"
        vs_base = "the baseline" if name == "nanogpt" else ratio_text(r, rates["nanogpt"], "nanogpt")
        print(f"{name:>9}: {statistics.median(r):9,.0f} tok/s  {vs_base}{vs_attn}  "
              f"({params:.2f}M params)", flush=True)
    print(ratio_note(args.repeat))
    return {name: statistics.median(r) for name, r in rates.items()}


if __name__ == "__main__":
    sys.exit(2 if main() == 2 else 0)
