"""torch.compile against eager: training tokens/s of the same model, side by side in one process.

For each model (the embedded default config, then one-kind models at the bench_nanogpt shape), two copies
with the same weights train on the same batch: eager, and torch.compile(model) as train.py does with
`train.compile: true` (Inductor). Printed: the compile time (the first compiled step, minus an eager
step), the graph breaks Dynamo counted, tokens/s of both (median over interleaved repeats) and the ratio
(the median of the per-repeat ratios, with bench_nanogpt.median_interval's interval for it).

    python bench/bench_compile.py --threads 1                           # default model + attn kda gdn linear mla
    python bench/bench_compile.py --models default kda --steps 2 --repeat 3
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import TrainConfig, load_config  # noqa: E402
from model import GPT  # noqa: E402
from train import make_optimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_nanogpt import hybrid_config, ratio_text  # noqa: E402


def step(model, opt, x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def bench(name, mc, B, T, steps, repeat, lr=1e-3):
    torch.manual_seed(0)
    eager = GPT(mc)
    module = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(module)
    opts = {"eager": make_optimizer(eager, TrainConfig(lr=lr)), "compiled": make_optimizer(module, TrainConfig(lr=lr))}
    fns = {"eager": eager, "compiled": compiled}
    x = torch.randint(0, mc.vocab_size, (B, T))
    y = torch.roll(x, -1, dims=1)
    t0 = time.perf_counter()
    loss_e = step(eager, opts["eager"], x, y)
    t_eager = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_c = step(compiled, opts["compiled"], x, y)
    t_compile = time.perf_counter() - t0 - t_eager
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    rates = {n: [] for n in fns}
    for _ in range(repeat):
        for n, m in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(m, opts[n], x, y)
            rates[n].append(steps * B * T / (time.perf_counter() - t0))
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    print(f"{name:>8} (B={B} T={T}): compile {t_compile:5.0f} s, {breaks} graph breaks, first loss eager "
          f"{loss_e:.5f} compiled {loss_c:.5f}; eager {e:7,.0f} tok/s, compiled {c:7,.0f} tok/s: "
          f"{ratio_text(rates['compiled'], rates['eager'], '(compiled/eager)')}", flush=True)
    return dict(compile_s=t_compile, graph_breaks=breaks, eager=e, compiled=c)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["default", "attn", "kda", "gdn", "linear", "mla"],
                   help="`default` (configs/default.yaml at its batch shape) and/or mixer kinds")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--T", type=int, default=256, help="kinds: sequence length")
    p.add_argument("--B", type=int, default=8, help="kinds: batch size")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats (median reported)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"training tokens/s, fp32, eager vs torch.compile (inductor), threads={torch.get_num_threads()}, "
          f"median of {args.repeat} interleaved repeats of {args.steps} steps")
    out = {}
    for name in args.models:
        if name == "default":
            cfg = load_config(None)
            out[name] = bench(name, cfg.model, cfg.train.batch_size, cfg.train.seq_len, args.steps, args.repeat)
        else:
            out[name] = bench(name, hybrid_config(name, args), args.B, args.T, args.steps, args.repeat)
    return out


if __name__ == "__main__":
    main()
