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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels  # noqa: E402
from bench_nanogpt import NanoBlock, add_shape_args, hybrid_config, parse_checked  # noqa: E402
from model import GPT  # noqa: E402
from studies.recall_heads import capture_ops  # noqa: E402


def first_op(model, args):
    """(op name, op, args, kwargs) of the first kernels op that layer 0 of `model` calls on a random batch."""
    calls = capture_ops(model, torch.randint(0, args.vocab, (args.B, args.T)))
    _, name, op_args, kwargs = next(call for call in calls if call[0] == 0)
    return name, getattr(kernels, name), op_args, kwargs


def backward_of(step):
    """A runner: step() (an output, or a tuple whose first item is it), then its backward against ones."""
    def run():
        out = step()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return run


def op_runner(op, args, kwargs):
    """forward + backward of a captured op, gradients into every float input."""
    leaves = [a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
              for a in args]
    return backward_of(lambda: op(*leaves, **kwargs))


def parts(args):
    """[(part, runner, per-step count, baseline part or None)] at the benchmark shape."""
    x = torch.randn(args.B, args.T, args.d, requires_grad=True)
    nano = NanoBlock(args.d, args.heads)
    rows = [("nanoGPT attention", backward_of(lambda: nano.attend(x)), args.layers, None),
            ("nanoGPT MLP (4d GELU)", backward_of(lambda: nano.mlp(x)), args.layers, None),
            ("nanoGPT LayerNorm", backward_of(lambda: nano.ln1(x)), 2 * args.layers + 1, None)]
    for kind in args.kinds:
        model = GPT(hybrid_config(kind, args))
        block = model.blocks[0]
        layer = backward_of(lambda mixer=block.mixer: mixer(x))
        rows.append((f"{kind} layer", layer, args.layers, "nanoGPT attention"))
        name, *captured = first_op(model, args)
        rows.append((f"{kind}: its {name} op", op_runner(*captured), args.layers, None))
    rows.append(("SwiGLU MLP", backward_of(lambda: block.mlp(x)), args.layers, "nanoGPT MLP (4d GELU)"))
    rows.append(("RMSNorm", backward_of(lambda: block.norm1(x)), 2 * args.layers + 1, "nanoGPT LayerNorm"))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["attn", "kda", "gdn"], help="mixer kinds (one layer each)")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=3, help="timed calls per repeat")
    p.add_argument("--repeat", type=int, default=9, help="interleaved repeats (median reported)")
    p.add_argument("--threads", type=int, default=None)
    args = parse_checked(p, argv)
    if args is None:
        return 2
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
        diff = None if base is None else ms[name] - ms[base]
        against = "" if diff is None else f"{diff:+8.2f} ms ({diff * count:+.1f} per step)"
        print(f"{name:<34} {ms[name]:8.2f} {count:>10} {ms[name] * count:9.1f}   {against}")
        op = f"{name.split()[0]}: its "
        for other in ms:
            if other.startswith(op):                              # the layer without its op, by difference
                rest = ms[name] - ms[other]
                print(f"{'  ' + name + ' less the op':<34} {rest:8.2f} {count:>10} {rest * count:9.1f}")
    return ms


if __name__ == "__main__":
    sys.exit(2 if main() == 2 else 0)
