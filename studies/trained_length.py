"""Accuracy against the length the models were trained at (issue 16; Kimi Linear fig. 4 plots its synthetic
tasks this way): the variants of sweeps that differ in train.seq_len, one series per layer pattern (kda, gdn,
kda+attn, ...) with x = train.seq_len. Each variant at its best lr (ablate.py's selection), the selection metric
of its seeds at the end or at training step --at_step (studies/seed_stats.py's values). Prints a markdown table
(mean ± std and seeds per length), each pair of series' difference of means at each length with its permutation
p, each cell's variant and lr, and plots the mean (thick) and every seed (thin). A variant in several sweep
files pools its seeds; a sweep given as `path@label` keeps its variants apart (seed_stats.py's form), and
--best_lr then puts each pattern at each length at the better of its lrs, each from its own sweep file.

    python studies/trained_length.py sweeps/palindrome_length.yaml --at_step 1000 \
        --out docs/palindrome_acc_vs_length.png
    python studies/trained_length.py sweeps/palindrome_length.yaml sweeps/palindrome_length256_lr.yaml@1e-3 \
        --only kda_256,gdn_256,gdn_256@1e-3 --best_lr      # gdn at T = 256 at the better of lr 3e-3 and 1e-3
    python studies/trained_length.py sweeps/stack_long.yaml sweeps/stack_length.yaml \
        sweeps/stack_length_confirm.yaml --ymin 0.75 --out docs/stack_acc_vs_length.png   # the axis from 0.75
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
from data.tokens import DataError  # noqa: E402
from studies import accuracy_axes, save_accuracy_plot  # noqa: E402
from studies.seed_stats import (chosen_variants, format_p, named_variants, permutation_p, pooled_values,  # noqa: E402
                                sweep_arg)


def series_name(cfg):
    """A run's layer pattern as a series label: its layer names in order, each once ("kda", "kda+attn")."""
    return "+".join(dict.fromkeys(cfg.model.pattern))


def by_length(sweeps, only=None, step=None, labels=None, best_lr=False):
    """({series: {train.seq_len: {seed: its metric}}}, {series: {train.seq_len: the cell's source}},
    (metric name, higher is better)) over the finished runs of the sweeps' variants (those in `only`, if
    given), each variant at its best lr in each sweep, its seeds pooled over the sweeps (seed_stats.pooled_values;
    labels[i]: sweep i given as path@label). A source is (variant, lr, [the variants it beat]). Two variants of
    one pattern at one length (the same model at another lr, say) share a cell only with best_lr: the one with
    the better mean over the seeds both have (over all of each one's when none is common; a tie keeps the first
    named), as ablate.py picks a variant's lr; without it that is a ValueError."""
    labels = labels or [""] * len(sweeps)
    pooled, metric = pooled_values(sweeps, only, step=step, labels=labels)
    owner = {}
    for sweep, label in zip(sweeps, labels):
        for name, variant in named_variants(sweep, label).items():
            owner.setdefault(name, (sweep, variant))
    values, sources = {}, {}
    for name, (lrs, by_seed) in pooled.items():
        sweep, variant = owner[name]
        cfg = ablate.config_for(sweep, variant, seed=0)
        series, T = series_name(cfg), cfg.train.seq_len
        lr = " / ".join(dict.fromkeys(f"{cfg.train.lr if lr is None else lr:g}" for lr in lrs))
        if T not in values.setdefault(series, {}):
            values[series][T], sources.setdefault(series, {})[T] = by_seed, (name, lr, [])
            continue
        if not best_lr:
            raise ValueError(f"two variants train {series} at T = {T} ({name} in {sweep['path']} is the "
                             "second): pick one with --only, or the better of them with --best_lr")
        held, (held_name, _, beaten) = values[series][T], sources[series][T]
        if beats(by_seed, held, metric[1]):
            values[series][T], sources[series][T] = by_seed, (name, lr, beaten + [held_name])
        else:
            beaten.append(name)
    return values, sources, metric


def beats(challenger, held, higher):
    """Whether one cell's seeds ({seed: value}) have a strictly better mean than another's over the seeds
    both have (all of each one's when none is common)."""
    common = challenger.keys() & held.keys()
    a, b = ([xs[s] for s in common] if common else list(xs.values()) for xs in (challenger, held))
    return ablate.mean(a) > ablate.mean(b) if higher else ablate.mean(a) < ablate.mean(b)


def source_table(sources):
    """Each cell's variant and lr (and the variants --best_lr left out for it) as a markdown table."""
    lengths = sorted({T for cells in sources.values() for T in cells})
    lines = ["| series | " + " | ".join(f"T = {T}" for T in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for series, cells in sources.items():
        shown = [f"{cells[T][0]} (lr {cells[T][1]})" + (f", over {', '.join(cells[T][2])}" if cells[T][2] else "")
                 if T in cells else "–" for T in lengths]
        lines.append(f"| {series} | " + " | ".join(shown) + " |")
    return "each cell's variant and lr:\n\n" + "\n".join(lines)


def tables(values, metric):
    """by_length()'s values as two markdown tables: each series per length, each pair's difference and p."""
    lengths = sorted({T for cells in values.values() for T in cells})
    head = "| series | " + " | ".join(f"T = {T}" for T in lengths) + " |\n|" + "---|" * (len(lengths) + 1) + "\n"
    seeds = {s: {T: list(by_seed.values()) for T, by_seed in cells.items()} for s, cells in values.items()}
    rows = [f"| {s} | " + " | ".join(f"{ablate.mean(c[T]):.3f} ± {ablate.std(c[T]):.3f} ({len(c[T])})" if T in c
                                     else "–" for T in lengths) + " |" for s, c in seeds.items()]
    pairs = []
    for (a, ca), (b, cb) in itertools.combinations(seeds.items(), 2):
        cells = [f"{ablate.mean(ca[T]) - ablate.mean(cb[T]):+.3f}, p {format_p(permutation_p(ca[T], cb[T]))}"
                 if T in ca and T in cb else "–" for T in lengths]
        pairs.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    out = f"{metric[0]}, mean ± std (seeds):\n\n" + head + "\n".join(rows)
    if pairs:
        out += "\n\ndifference of the means, permutation p:\n\n" + head.replace("series", "pair") + "\n".join(pairs)
    return out


def plot(values, metric, path, step=None, sources=None, ymin=0.0):
    """The mean (thick) and each seed (thin) of every series against T; with by_length()'s sources, each
    series' lr in its legend label (one per length, in order, where they differ). The accuracy axis starts at
    ymin: a ValueError unless it is in [0, 1) and at most the lowest seed's value (a higher start would hide it)."""
    lowest = min(x for cells in values.values() for by_seed in cells.values() for x in by_seed.values())
    if not 0 <= ymin <= lowest or ymin >= 1:
        raise ValueError(f"--ymin {ymin:g}: the axis must start between 0 and the lowest value plotted, "
                         f"{lowest:.3f} (and below 1)")
    fig, ax = accuracy_axes()
    for i, (series, cells) in enumerate(values.items()):
        lengths = sorted(cells)
        colour = f"C{i}"
        label = series
        if sources:
            lrs = [sources[series][T][1] for T in lengths]
            label += f" (lr {lrs[0] if len(set(lrs)) == 1 else ' / '.join(lrs)})"
        ax.plot(lengths, [ablate.mean(list(cells[T].values())) for T in lengths], "o-", color=colour, lw=2.2,
                label=label)
        for seed in sorted({seed for by_seed in cells.values() for seed in by_seed}):
            seen = [T for T in lengths if seed in cells[T]]
            # a dot on each value, so a seed run at one length only shows too
            ax.plot(seen, [cells[T][seed] for T in seen], ".-", color=colour, lw=0.6, ms=3, alpha=0.45)
    ax.set_title(f"{metric[0]} " + (f"at step {step}" if step is not None else "at the end of training"), fontsize=9)
    every_length = sorted({T for cells in values.values() for T in cells})
    return save_accuracy_plot(fig, ax, path, "training length T", metric[0], every_length, ymin)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", metavar="sweep",
                   help="sweep file(s) whose variants differ in train.seq_len; path@label: its variants named "
                        "variant@label, pooled only with sweeps of the same label (seed_stats.py's form)")
    p.add_argument("--only", default=None, help="comma-separated variants (default: all with finished runs)")
    p.add_argument("--at_step", type=int, default=None, help="the selection metric at this training step, not the end")
    p.add_argument("--best_lr", action="store_true",
                   help="where variants of one pattern share a length (the same model at other lrs), keep the one "
                        "with the better mean (over the seeds they share) instead of refusing")
    p.add_argument("--out", default=None, help="PNG path of the plot (default: no plot)")
    p.add_argument("--ymin", type=float, default=0.0,
                   help="where the plot's accuracy axis starts (default 0; at most the lowest value plotted)")
    args = p.parse_args(argv)
    try:
        paths, labels = zip(*(sweep_arg(arg) for arg in args.sweeps))
        sweeps = [ablate.load_sweep(path) for path in paths]
        values, sources, metric = by_length(sweeps, chosen_variants(sweeps, args.only, labels), args.at_step,
                                            labels, args.best_lr)
        if not metric[1]:
            raise ValueError(f"the sweeps select by {metric[0]}, lower is better: this study plots accuracies")
        plotted = plot(values, metric, args.out, args.at_step, sources, args.ymin) if args.out else None
    except (ablate.SweepError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tables(values, metric) + "\n\n" + source_table(sources))
    if plotted:
        print(f"plot: {plotted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
