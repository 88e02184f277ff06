"""Where a training step's time goes, one part of a block at a time, next to the nanoGPT baseline's.

bench_nanogpt.py gives one ratio per model; this script splits it. At the benchmark shape it times
forward + backward of each part of a block on the same input, interleaved, median over repeats:
  - each mixer kind's layer, the kernels op it calls (attention, delta rule, linear attention) alone, on the
    inputs that layer 0 of a model of that kind gave it on a random batch, and the rest of the layer (the
    difference: projections, convs, gates, norms);
  - the baseline's attention (q|k|v matmul, SDPA, output matmul), MLP (4x GELU) and LayerNorm against ours
    (the attention layer above, SwiGLU, RMSNorm).
The last column scales a part to a whole step (layers x per layer; norms: 2 per layer + 1), so the
per-part differences can be added up against bench_nanogpt.py's step times.

    python bench/bench_layers.py --threads 1                     # attn, kda, gdn at the nanoGPT shape
    python bench/bench_layers.py --kinds attn mla linear --repeat 11
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels  # noqa: E402
from bench_nanogpt import NanoBlock, add_shape_args, check_args, hybrid_config  # noqa: E402
from model import GPT, ConfigError  # noqa: E402
from studies.recall_heads import capture_ops  # noqa: E402


def first_op(model, args):
    """(op name, op, args, kwargs) of the first kernels op that layer 0 of `model` calls on a random batch."""
    calls = capture_ops(model, torch.randint(0, args.vocab, (args.B, args.T)))
    _, name, op_args, kwargs = next(call for call in calls if call[0] == 0)
    return name, getattr(kernels, name), op_args, kwargs


def op_runner(name, op, args, kwargs):
    """forward + backward of a captured op, gradients into every float input."""
    leaves = [a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
              for a in args]

    def run():
        out = op(*leaves, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return run


def layer_runner(module, x):
    def run():
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
    return run


class NanoAttention(nn.Module):
    """The baseline block's attention: q|k|v in one matmul, causal SDPA, output matmul."""

    def __init__(self, block: NanoBlock):
        super().__init__()
        self.block = block

    def forward(self, x):
        B, T, d = x.shape
        b = self.block
        q, k, v = b.qkv(x).split(d, dim=-1)
        heads = lambda t: t.view(B, T, b.n_heads, d // b.n_heads).transpose(1, 2)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return b.proj(y.transpose(1, 2).reshape(B, T, d))


class NanoMLP(nn.Module):
    def __init__(self, block: NanoBlock):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.fc_out(F.gelu(self.block.fc(x)))


def parts(args):
    """[(part, runner, per-step count, baseline part or None)] at the benchmark shape."""
    x = torch.randn(args.B, args.T, args.d, requires_grad=True)
    nano = NanoBlock(args.d, args.heads)
    rows = [("nanoGPT attention", layer_runner(NanoAttention(nano), x), args.layers, None),
            ("nanoGPT MLP (4d GELU)", layer_runner(NanoMLP(nano), x), args.layers, None),
            ("nanoGPT LayerNorm", layer_runner(nano.ln1, x), 2 * args.layers + 1, None)]
    block = None
    for kind in args.kinds:
        model = GPT(hybrid_config(kind, args))
        block = model.blocks[0]
        rows.append((f"{kind} layer", layer_runner(block.mixer, x), args.layers, "nanoGPT attention"))
        name, *captured = first_op(model, args)
        rows.append((f"{kind}: its {name} op", op_runner(name, *captured), args.layers, None))
    rows.append(("SwiGLU MLP", layer_runner(block.mlp, x), args.layers, "nanoGPT MLP (4d GELU)"))
    rows.append(("RMSNorm", layer_runner(block.norm1, x), 2 * args.layers + 1, "nanoGPT LayerNorm"))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["attn", "kda", "gdn"], help="mixer kinds (one layer each)")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=3, help="timed calls per repeat")
    p.add_argument("--repeat", type=int, default=9, help="interleaved repeats (median reported)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        check_args(args, ("steps", "repeat"))
        for kind in args.kinds:
            hybrid_config(kind, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = parts(args)
    for _, run, _, _ in rows:                                     # warm-up
        run()
    times = {name: [] for name, *_ in rows}
    for _ in range(args.repeat):
        for name, run, _, _ in rows:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"forward + backward ms, d={args.d} layers={args.layers} heads={args.heads} T={args.T} B={args.B} fp32, "
          f"threads={torch.get_num_threads()}, median of {args.repeat} interleaved repeats of {args.steps} calls")
    print(f"{'part':<34} {'ms':>8} {'x per step':>10} {'per step':>9}   against the baseline")
    for name, _, count, base in rows:
        against = "" if base is None else f"{ms[name] - ms[base]:+8.2f} ms ({(ms[name] - ms[base]) * count:+.1f} per step)"
        print(f"{name:<34} {ms[name]:8.2f} {count:>10} {ms[name] * count:9.1f}   {against}")
        op = f"{name.split()[0]}: its "
        for other in ms:
            if other.startswith(op):                              # the layer without its op, by difference
                rest = ms[name] - ms[other]
                print(f"{'  ' + name + ' less the op':<34} {rest:8.2f} {count:>10} {rest * count:9.1f}")
    return ms


if __name__ == "__main__":
    sys.exit(2 if main() == 2 else 0)
