"""Does one variant beat another across seeds (issue 16)? For the finished runs of a sweep, each variant
at its best lr (ablate.py's selection) and the sweep's selection metric (`select`, else val_acc or
val_loss):
- per variant: seeds, the lr, mean with a 95% bootstrap interval of the mean, sample std, median, min - max,
  and (--solved X) how many seeds reach X (at or above X; at or below it for a metric where lower is better,
  so `--metric step --solved 1000` counts the seeds that stopped by step 1,000);
- --metric NAME compares another number of each run's final record instead, still at the best lr of the
  selection metric: `step` is where the run stopped, so with `stop_at` it is the steps each seed took to
  solve the task, counted as the step cap where it did not (a censored time to solve);
- --at_step N compares the selection metric at training step N instead (the last eval at or before N in
  each run's metrics.jsonl; a run stopped earlier keeps its last value), each variant at its best lr by
  that value: how fast the variants learn where all of them end solved;
- per pair of variants: the difference of the means with its 95% bootstrap interval, and a two-sided
  permutation p-value (how often shuffling the seeds between the two variants gives a difference at
  least as large; exact over every split when there are at most 200,000, else from 20,000 random ones,
  as (hits + 1) / 20,001).
Several sweep files pool their seeds: each variant at its best lr in each sweep, its seeds from all of them
(a held-out batch of seeds next to the one that picked the lr; distinct seeds, one metric). A sweep given as
`path@label` names its variants `variant@label` instead: they pool only with sweeps of the same label, so one
variant trained in two sweeps (at two lrs, say) is compared with itself rather than pooled. An lr point of a
sweep (`kda_lr3e3: {lr_of: kda, ...}`) shows in its variant's row: named alone, at its own lr; named beside its
variant, at the better lr of the two; so one sweep given twice, once with a label, compares its lrs.
Seeded: the same runs give the same numbers.

    python studies/seed_stats.py sweeps/mqar_key_width.yaml --only kda_k8,gdn_k8,linear_k8 --solved 0.9
    python studies/seed_stats.py sweeps/mqar_ladder256.yaml --only kda,gdn,linear --metric step
    python studies/seed_stats.py sweeps/palindrome_long.yaml --at_step 500
    python studies/seed_stats.py sweeps/stack_confirm.yaml sweeps/stack_confirm2.yaml --only kda,gdn
    python studies/seed_stats.py sweeps/palindrome_length.yaml sweeps/palindrome_length256_lr.yaml@1e-3 \
        --only kda_256,kda_256@1e-3          # one variant at lr 3e-3 (its sweep) against itself at 1e-3
    python studies/seed_stats.py sweeps/mqar_ladder256.yaml sweeps/mqar_ladder256.yaml@3e-3 \
        --only kda,kda_lr3e3@3e-3            # kda at its own lr (1e-3) against its lr point at 3e-3
"""
import argparse
import itertools
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
from config import higher_is_better, reaches  # noqa: E402
from data.tokens import DataError  # noqa: E402
from plot import read_metrics  # noqa: E402

EXACT_LIMIT = 200_000


def bootstrap_interval(stat, groups, n=10_000, seed=0):
    """95% percentile interval of stat(*resampled groups), each group resampled with replacement."""
    rng = random.Random(seed)
    draws = sorted(stat(*[rng.choices(g, k=len(g)) for g in groups]) for _ in range(n))
    return draws[int(0.025 * n)], draws[int(0.975 * n) - 1]


def permutation_p(a, b, n=20_000, seed=0):
    """Two-sided p-value of mean(a) - mean(b) under exchangeable seeds."""
    pooled, k = a + b, len(a)
    observed = abs(ablate.mean(a) - ablate.mean(b)) - 1e-12
    total = sum(pooled)

    def diff(first_sum):
        return abs(first_sum / k - (total - first_sum) / len(b))
    if math.comb(len(pooled), k) <= EXACT_LIMIT:
        return sum(diff(sum(c)) >= observed for c in itertools.combinations(pooled, k)) / math.comb(len(pooled), k)
    rng = random.Random(seed)                      # sampled: (hits + 1) / (n + 1), never 0
    return (sum(diff(sum(rng.sample(pooled, k))) >= observed for _ in range(n)) + 1) / (n + 1)


def format_p(p):
    """A p-value for a table: three decimals, or two significant figures below 0.001 (8 seeds against 8, every
    one above: 2 / C(16, 8) = 0.00016, not 0.000)."""
    return f"{p:.3f}" if p >= 0.001 else f"{p:.2g}"


def at_step(sweep, step, only=None):
    """collect()'s results with each run's final record replaced by {selection metric: its value at `step`,
    step: that eval's step} (the last eval at or before it; diverged runs keep no value)."""
    results = ablate.collect(sweep)                 # none finished: best_runs says so
    name = ablate.select_metric(sweep, results)[0]
    for r in (r for v, rs in results.items() if not only or v in only for r in rs if not r.get("diverged")):
        folder = ablate.result_dir(sweep, r)
        evals = [row for row in read_metrics(folder) if row.get(name) is not None and row["step"] <= step]
        if not evals:
            raise DataError(f"--at_step {step}: {folder} logged no {name} at or before step {step}")
        r["final"] = {name: evals[-1][name], "step": evals[-1]["step"]}   # step: best_lr's tie-break
    return results


def seed_values(sweep, only=None, name=None, step=None):
    """{variant: (best lr, {seed: value of each finished seed; diverged ones left out})}, (name, higher is
    better): the value is the selection metric (at training step `step` if given: at_step), or the final
    record's `name` (any number in it, e.g. step)."""
    best, metric = ablate.best_runs(sweep, only, None if step is None else at_step(sweep, step, only))
    if name is not None and name != metric[0]:
        keys = sorted({k for _, runs in best.values() for r in runs for k, x in r["final"].items()
                       if isinstance(x, (int, float))})
        if name not in keys:
            raise DataError(f"--metric {name}: not a number of the runs' final records (they have: {', '.join(keys)})")
        metric = (name, higher_is_better(name))
    out = {v: (lr, {r["seed"]: r["final"][metric[0]] for r in runs if r["final"].get(metric[0]) is not None})
           for v, (lr, runs) in best.items()}
    out = {v: (lr, xs) for v, (lr, xs) in out.items() if xs}
    if not out:
        raise DataError(f"{sweep['out_dir']}: no finished run reports {metric[0]} (all diverged?)")
    return out, metric


def sweep_arg(arg):
    """A sweep argument, 'path' or 'path@label', as (path, label); '' when unlabelled (or the file exists)."""
    if "@" not in arg or os.path.exists(arg):
        return arg, ""
    path, label = arg.rsplit("@", 1)
    if not label or "/" in label or "," in label:
        raise ValueError(f"{arg}: a sweep is 'path' or 'path@label' (a label without '/' or ',')")
    return path, label


def named_variants(sweep, label=""):
    """{the name seed_stats shows (variant@label when labelled): the sweep's variant}."""
    return {f"{v}@{label}" if label else v: v for v in sweep["variants"]}


def pooled_values(sweeps, only=None, name=None, step=None, labels=None):
    """seed_values of several sweeps (each variant at its best lr in each), a variant's seeds pooled:
    {variant: ([its lr in each sweep that has it], {seed: value})}, (name, higher is better). The sweeps must
    compare the same metric and may not train a variant on one seed twice. labels[i] (if given and not '')
    names sweep i's variants variant@label, pooled only with those of sweeps of the same label; only names
    the variants so, and orders the rows (an lr point's runs show in its variant's row, at the place of the
    first of them named; default: the sweeps' order)."""
    pooled, origin, metric, metric_of, rank = {}, {}, None, None, {}
    for sweep, label in zip(sweeps, labels or itertools.repeat("")):
        plain = named_variants(sweep, label)
        shown = {v: name for name, v in plain.items()}
        mine = [plain[v] for v in only or plain if v in plain]
        if not mine:
            continue
        for v in mine:                                            # the row each named variant shows in
            row, place = shown[sweep["lr_of"].get(v, v)], only.index(shown[v]) if only else len(rank)
            rank[row] = min(rank.get(row, place), place)
        values, m = seed_values(sweep, mine, name, step)
        if metric not in (None, m):
            raise ValueError(f"{sweep['path']} compares {m[0]} and {metric_of} {metric[0]}: pool sweeps "
                             "of one metric (their select:, or seed_stats.py's --metric)")
        metric, metric_of = m, metric_of or sweep["path"]
        for variant, (lr, by_seed) in values.items():
            variant = shown[variant]
            lrs, xs = pooled.setdefault(variant, ([], {}))
            for seed, x in by_seed.items():
                if seed in xs:
                    raise ValueError(f"{variant} seed {seed} is in {origin[variant, seed]} and {sweep['path']}: "
                                     "pooled sweeps need distinct seeds")
                origin[variant, seed], xs[seed] = sweep["path"], x
            lrs.append(lr)
    return {v: pooled[v] for v in sorted(pooled, key=rank.get)}, metric


def variant_table(values, metric, solved=None):
    head = ["variant", "seeds", "lr", f"mean {metric[0]} [95% interval]", "std", "median", "min - max"]
    head += [f"seeds {'>=' if metric[1] else '<='} {solved:g}"] if solved is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, (lrs, by_seed) in values.items():
        xs = list(by_seed.values())
        lo, hi = bootstrap_interval(ablate.mean, [xs])
        lr = " / ".join(dict.fromkeys("–" if lr is None else f"{lr:g}" for lr in lrs))
        cells = [variant, str(len(xs)), lr,
                 f"{ablate.mean(xs):.3f} [{lo:.3f}, {hi:.3f}]", f"{ablate.std(xs):.3f}",
                 f"{statistics.median(xs):.3f}", f"{min(xs):.3f} - {max(xs):.3f}"]
        if solved is not None:
            reached = sum(reaches(metric[0], x, solved) for x in xs)
            cells.append(f"{reached} / {len(xs)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pair_table(values, metric):
    lines = [f"| pair | difference of mean {metric[0]} [95% interval] | permutation p |", "|---|---|---|"]
    for (a, (_, xa)), (b, (_, xb)) in itertools.combinations(values.items(), 2):
        xa, xb = list(xa.values()), list(xb.values())
        lo, hi = bootstrap_interval(lambda x, y: ablate.mean(x) - ablate.mean(y), [xa, xb])
        lines.append(f"| {a} - {b} | {ablate.mean(xa) - ablate.mean(xb):+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                     f"{format_p(permutation_p(xa, xb))} |")
    return "\n".join(lines)


def chosen_variants(sweeps, only, labels=None):
    """--only's comma-separated variants (variant@label for a labelled sweep's) as a list (None: all); a name in
    none of the sweeps is a ValueError."""
    only = only and only.split(",")
    variants = list(dict.fromkeys(name for sweep, label in zip(sweeps, labels or itertools.repeat(""))
                                  for name in named_variants(sweep, label)))
    unknown = [v for v in only or () if v not in variants]
    if unknown:
        where = "this sweep" if len(sweeps) == 1 else "these sweeps"
        raise ValueError(f"--only {','.join(unknown)}: not a variant of {where} ({', '.join(variants)})")
    return only


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", metavar="sweep",
                   help="sweep file (its out_dir holds the runs); several: each variant's seeds pooled over them, "
                        "each sweep at its own best lr; path@label: its variants named variant@label, pooled only "
                        "with sweeps of the same label")
    p.add_argument("--only", default=None, help="comma-separated variants, shown in this order (default: all with finished runs)")
    p.add_argument("--solved", type=float, default=None,
                   help="count the seeds whose metric reaches this (>= it; <= it where lower is better: step, losses)")
    p.add_argument("--metric", default=None,
                   help="a number of the runs' final record to compare (default: the selection metric; step: "
                        "steps to the stop)")
    p.add_argument("--at_step", type=int, default=None,
                   help="compare the selection metric at this training step (each variant at its best lr by it)")
    args = p.parse_args(argv)
    try:
        if args.at_step is not None and args.metric is not None:
            raise ValueError("--at_step compares the selection metric at a step; give it or --metric, not both")
        paths, labels = zip(*(sweep_arg(arg) for arg in args.sweeps))
        sweeps = [ablate.load_sweep(path) for path in paths]
        only = chosen_variants(sweeps, args.only, labels)
        values, metric = pooled_values(sweeps, only, args.metric, args.at_step, labels)
    except (ablate.SweepError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(variant_table(values, metric, args.solved))
    if len(values) > 1:
        print()
        print(pair_table(values, metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
