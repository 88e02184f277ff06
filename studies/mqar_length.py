"""MQAR accuracy against sequence length (issue 16) for the runs of sweeps: every variant at its
best lr (ablate.py's selection; without an lrs grid, its one lr), each seed's last checkpoint
evaluated on fresh MQAR sequences of each length with the training number of pairs (or --n_pairs)
(evals.eval_mqar, seq_len); mean ± std over seeds as a markdown table, and a plot of the mean
(thick) and every seed (thin). Lengths above the training length test extrapolation.

    python studies/mqar_length.py sweeps/mqar_seeds.yaml --lengths 64 128 256 512 \
        --out docs/mqar_acc_vs_length.png
    python studies/mqar_length.py sweeps/mqar_curriculum512.yaml sweeps/mqar_curriculum_mixers.yaml \
        --only f66_t512,kda_t512 --lengths 512 1024 2048    # variants of several sweeps in one table
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
import evals  # noqa: E402
from data.tokens import DataError  # noqa: E402
from sample import load_model  # noqa: E402
from studies import accuracy_axes, save_accuracy_plot  # noqa: E402


def accuracy_by_length(sweep, lengths, n_batches, only=None, n_pairs=0, log=print):
    """{variant: (best lr, {length: [accuracy of each seed]})} over the finished runs (of the variants
    in `only`, if given), with n_pairs pairs per sequence (0: each run's training number)."""
    best, _ = ablate.best_runs(sweep, only)
    out = {}
    for variant, (lr, runs) in best.items():
        accs = {L: [] for L in lengths}
        for r in runs:
            model, cfg = load_model(ablate.result_dir(sweep, r))
            for L in lengths:
                accs[L].append(evals.run_eval("mqar", model, cfg, {"seq_len": L, "n_pairs": n_pairs,
                                                                   "n_batches": n_batches})["acc"])
        log(f"{variant} (lr {lr}, {len(runs)} seeds): " + ", ".join(f"T={L} {ablate.mean_pm(a)}" for L, a in accs.items()))
        out[variant] = (lr, accs)
    return out


def table(out, train_len):
    lengths = list(next(iter(out.values()))[1])
    lines = ["| variant | best lr | seeds | " + " | ".join(f"T = {L}" + (" (train)" if L == train_len else "")
                                                         for L in lengths) + " |",
             "|" + "---|" * (len(lengths) + 3)]
    for variant, (lr, accs) in out.items():
        lines.append(f"| {variant} | {lr:g} | {len(accs[lengths[0]])} | " + " | ".join(ablate.mean_pm(accs[L]) for L in lengths) + " |")
    return "\n".join(lines)


def plot(out, train_len, path):
    fig, ax = accuracy_axes()
    for variant, (lr, accs) in out.items():                       # the mean, and each seed thin
        Ls = list(accs)
        line, = ax.plot(Ls, [ablate.mean(accs[L]) for L in Ls], marker="o", lw=2, label=f"{variant} (lr {lr:g})")
        for seed_accs in zip(*(accs[L] for L in Ls)):
            ax.plot(Ls, seed_accs, color=line.get_color(), lw=0.8, alpha=0.4)
    ax.axvline(train_len, color="gray", ls=":", label="training length")
    save_accuracy_plot(fig, ax, path, "sequence length", "MQAR accuracy")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="sweep files (their out_dirs hold the runs)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--n_batches", type=int, default=8, help="batches of 32 sequences per length")
    p.add_argument("--only", default=None, help="comma-separated variants of the sweeps (default: all)")
    p.add_argument("--n_pairs", type=int, default=0, help="pairs per sequence (default: each run's training number)")
    p.add_argument("--out", default=None, help="PNG of accuracy against length")
    args = p.parse_args(argv)
    try:
        sweeps = [ablate.load_sweep(path) for path in args.sweeps]
        if any(L < 1 for L in args.lengths) or args.n_batches < 1 or args.n_pairs < 0:
            raise ValueError("--lengths and --n_batches: must be integers >= 1; --n_pairs >= 1 (or 0: the training number)")
        only = args.only and args.only.split(",")
        unknown = [v for v in only or () if not any(v in sw["variants"] for sw in sweeps)]
        if unknown:
            raise ValueError(f"--only {','.join(unknown)}: not a variant of "
                             f"{'this sweep' if len(sweeps) == 1 else 'these sweeps'} "
                             f"({', '.join(v for sw in sweeps for v in sw['variants'])})")
        out = {}
        for sweep in sweeps:
            if only and not set(only) & set(sweep["variants"]):
                continue
            found = accuracy_by_length(sweep, args.lengths, args.n_batches, only, args.n_pairs)
            twice = sorted(set(found) & set(out))
            if twice:
                raise ValueError(f"variant {twice[0]} is in more than one sweep; pick one with --only")
            out.update(found)
    except (ablate.SweepError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = next(sw for sw in sweeps if next(iter(out)) in sw["variants"])
    train_len = ablate.config_for(first, next(iter(out)), first["seeds"][0], first["lrs"][0]).train.seq_len
    print(table(out, train_len))
    if args.out:
        plot(out, train_len, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
