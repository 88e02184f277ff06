"""Accuracy against the length the models were trained at (issue 16; Kimi Linear fig. 4 plots its synthetic
tasks this way): the variants of sweeps that differ in train.seq_len, one series per layer pattern (kda, gdn,
kda+attn, ...) with x = train.seq_len. Each variant at its best lr (ablate.py's selection), the selection metric
of its seeds at the end or at training step --at_step (studies/seed_stats.py's values). Prints a markdown table
(mean ± std and seeds per length), each pair of series' difference of means at each length with its permutation
p, and plots the mean (thick) and every seed (thin). A variant in several sweep files pools its seeds.

    python studies/trained_length.py sweeps/palindrome_length.yaml --at_step 1000 \
        --out docs/palindrome_acc_vs_length.png
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
from data.tokens import DataError  # noqa: E402
from studies import accuracy_axes, save_accuracy_plot  # noqa: E402
from studies.seed_stats import chosen_variants, permutation_p, pooled_values  # noqa: E402


def series_name(cfg):
    """A run's layer pattern as a series label: its layer names in order, each once ("kda", "kda+attn")."""
    return "+".join(dict.fromkeys(cfg.model.pattern))


def by_length(sweeps, only=None, step=None):
    """({series: {train.seq_len: {seed: its metric}}}, (metric name, higher is better)) over the
    finished runs of the sweeps' variants (those in `only`, if given), each variant at its best lr in each
    sweep, its seeds pooled over the sweeps (seed_stats.pooled_values); two variants of one pattern at one
    length cannot share a cell."""
    pooled, metric = pooled_values(sweeps, only, step=step)
    out = {}
    for variant, (_, by_seed) in pooled.items():
        sweep = next(s for s in sweeps if variant in s["variants"])
        cfg = ablate.config_for(sweep, variant, seed=0)
        series, T = series_name(cfg), cfg.train.seq_len
        if T in out.setdefault(series, {}):
            raise ValueError(f"two variants train {series} at T = {T} ({variant} in {sweep['path']} is the "
                             "second): pick one with --only")
        out[series][T] = by_seed
    return out, metric


def tables(values, metric):
    """by_length()'s values as two markdown tables: each series per length, each pair's difference and p."""
    lengths = sorted({T for cells in values.values() for T in cells})
    head = "| series | " + " | ".join(f"T = {T}" for T in lengths) + " |\n|" + "---|" * (len(lengths) + 1) + "\n"
    seeds = {s: {T: list(by_seed.values()) for T, by_seed in cells.items()} for s, cells in values.items()}
    rows = [f"| {s} | " + " | ".join(f"{ablate.mean(c[T]):.3f} ± {ablate.std(c[T]):.3f} ({len(c[T])})" if T in c
                                     else "–" for T in lengths) + " |" for s, c in seeds.items()]
    pairs = []
    for (a, ca), (b, cb) in itertools.combinations(seeds.items(), 2):
        cells = [f"{ablate.mean(ca[T]) - ablate.mean(cb[T]):+.3f}, p {permutation_p(ca[T], cb[T]):.3f}"
                 if T in ca and T in cb else "–" for T in lengths]
        pairs.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    out = f"{metric[0]}, mean ± std (seeds):\n\n" + head + "\n".join(rows)
    if pairs:
        out += "\n\ndifference of the means, permutation p:\n\n" + head.replace("series", "pair") + "\n".join(pairs)
    return out


def plot(values, metric, path, step=None):
    fig, ax = accuracy_axes()
    for i, (series, cells) in enumerate(values.items()):
        lengths = sorted(cells)
        colour = f"C{i}"
        ax.plot(lengths, [ablate.mean(list(cells[T].values())) for T in lengths], "o-", color=colour, lw=2.2,
                label=series)
        for seed in sorted({seed for by_seed in cells.values() for seed in by_seed}):
            seen = [T for T in lengths if seed in cells[T]]
            # a dot on each value, so a seed run at one length only shows too
            ax.plot(seen, [cells[T][seed] for T in seen], ".-", color=colour, lw=0.6, ms=3, alpha=0.45)
    ax.set_title(f"{metric[0]} " + (f"at step {step}" if step is not None else "at the end of training"), fontsize=9)
    return save_accuracy_plot(fig, ax, path, "training length T", metric[0], sorted({T for c in values.values() for T in c}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", metavar="sweep", help="sweep file(s) whose variants differ in train.seq_len")
    p.add_argument("--only", default=None, help="comma-separated variants (default: all with finished runs)")
    p.add_argument("--at_step", type=int, default=None, help="the selection metric at this training step, not the end")
    p.add_argument("--out", default=None, help="PNG path of the plot (default: no plot)")
    args = p.parse_args(argv)
    try:
        sweeps = [ablate.load_sweep(path) for path in args.sweeps]
        values, metric = by_length(sweeps, chosen_variants(sweeps, args.only), args.at_step)
        if not metric[1]:
            raise ValueError(f"the sweeps select by {metric[0]}, lower is better: this study plots accuracies")
    except (ablate.SweepError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tables(values, metric))
    if args.out:
        print(f"plot: {plot(values, metric, args.out, args.at_step)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
