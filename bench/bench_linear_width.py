"""How fast a linear layer runs at output widths that are and are not multiples of 16, and what
model.linear (which pads such widths, model.PaddedLinear) gains over F.linear at each.

On the CPU MKL's sgemm runs a training-sized product whose result is not a multiple of 16 wide well below
its speed at the next multiple of 16 (2,048 rows x 256 -> 683: 52 against 89 GFLOP/s at 688 on a 2-core AMD
EPYC, one thread). For each (rows, k -> n) this prints GFLOP/s of F.linear and of model.linear, forward and
forward + backward, interleaved, median of --repeat rounds.

    python bench/bench_linear_width.py --threads 1
    python bench/bench_linear_width.py --rows 512 1024 2048 4096 --widths 683 688 --k 256
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_qwen3next import interleave  # noqa: E402
from model import linear  # noqa: E402


def runners(x, w):
    """forward and forward + backward of F.linear and model.linear on x [rows, k], w [n, k]."""
    def forward(f):
        def run():
            with torch.no_grad():
                f(x, w)
        return run

    def both(f):
        def run():
            y = f(x, w)
            y.backward(torch.ones_like(y))
        return run
    return {"F.linear fwd": forward(F.linear), "linear fwd": forward(linear),
            "F.linear fwd+bwd": both(F.linear), "linear fwd+bwd": both(linear)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2048], help="rows of x (batch x length)")
    p.add_argument("--k", type=int, default=256, help="input width")
    p.add_argument("--widths", type=int, nargs="+", default=[257, 512, 683, 688, 704, 1365, 1376],
                   help="output widths n")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"linear k={args.k} -> n, fp32, threads={torch.get_num_threads()}, GFLOP/s (median of {args.repeat}); "
          f"model.linear pads n (and k in backward) to a multiple of 16 where it is >= 256 and rows >= 1,024")
    print(f"{'rows':>6} {'n':>6} | {'F.linear fwd':>12} {'linear fwd':>10} {'x':>5} | "
          f"{'F.linear f+b':>12} {'linear f+b':>10} {'x':>5}")
    for rows in args.rows:
        for n in args.widths:
            x = torch.randn(rows, args.k, requires_grad=True)
            w = torch.randn(n, args.k, requires_grad=True)
            s = {name: statistics.median(t) for name, t in interleave(runners(x, w), args.repeat).items()}  # seconds
            flop = 2 * rows * args.k * n
            rate = {name: flop * (3 if "bwd" in name else 1) / t / 1e9 for name, t in s.items()}
            print(f"{rows:>6} {n:>6} | {rate['F.linear fwd']:>12.1f} {rate['linear fwd']:>10.1f} "
                  f"{s['F.linear fwd'] / s['linear fwd']:>4.2f}x | {rate['F.linear fwd+bwd']:>12.1f} "
                  f"{rate['linear fwd+bwd']:>10.1f} {s['F.linear fwd+bwd'] / s['linear fwd+bwd']:>4.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
