"""Curricula in sweeps (issue 16): for every chain of stages (a variant without `after`, then the
variant whose `after` names it, and so on; ablate.py's curriculum stages), each stage's final val
accuracy and stop step per seed, how many seeds reached --solved, as a markdown table with one column
per stage setting (T / pairs); with --zero_shot, also what each stage's starting weights (the stage
below's last checkpoint) score on the stage's own setting before any training there; and a plot of val
accuracy against the stage's sequence length per chain (mean thick, each seed thin; with --zero_shot,
the mean before training dashed).

    python studies/curriculum.py sweeps/mqar_curriculum512.yaml sweeps/mqar_curriculum_mixers.yaml \
        --chains f66_t128 kda_t128 gdn_t128 linear_t128 --labels attn kda gdn linear --zero_shot 8 \
        --out docs/mqar_curriculum_mixers.png
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
import evals  # noqa: E402
from data.tokens import DataError  # noqa: E402
from sample import load_model  # noqa: E402
from studies import accuracy_axes, save_accuracy_plot  # noqa: E402


def chains(sweep):
    """[[root, its stage, the stage's stage, ...]] in the sweep's variant order."""
    after = sweep["after"]
    out = []
    for root in (v for v in sweep["variants"] if v not in after):
        chain = [root]
        while nxt := next((v for v in sweep["variants"] if after.get(v) == chain[-1]), None):
            chain.append(nxt)
        out.append(chain)
    return out


def chain_name(chain):
    return re.sub(r"_t\d+$", "", chain[0])


def stage(sweep, variant, results, zero_shot=0, log=print):
    """{setting: (T, pairs), runs: [{seed, acc, step, before}]} of one stage's finished runs
    (results: ablate.collect(sweep))."""
    cfg = ablate.config_for(sweep, variant, sweep["seeds"][0], sweep["lrs"][0])
    setting = (cfg.train.seq_len, cfg.data.n_pairs)
    if zero_shot and cfg.data.kind != "mqar":
        raise ValueError(f"--zero_shot: scores MQAR, and {variant} trains on data.kind {cfg.data.kind!r}")
    runs = []
    for r in sorted(results.get(variant, []), key=lambda r: r["seed"]):
        run = {"seed": r["seed"], "acc": r["final"].get("val_acc"), "step": r["final"].get("step"), "before": None}
        start = ablate.config_for(sweep, variant, r["seed"], r["lr"] if sweep["lrs"] != [None] else None).train.init_from
        if zero_shot and start:
            model, _ = load_model(start)
            opts = {"seq_len": setting[0], "n_pairs": setting[1], "n_batches": zero_shot}
            run["before"] = evals.run_eval("mqar", model, cfg, opts)["acc"]
        runs.append(run)
    log(f"{variant} (T={setting[0]}, {setting[1]} pairs): " + ", ".join(
        f"s{r['seed']} {_acc(r['acc'])} ({r['step']})" for r in runs))
    return {"setting": setting, "runs": runs}


def _acc(x):
    return "–" if x is None else f"{x:.3f}"


def table(rows, solved):
    """rows: [(chain name, [stage])] -> markdown, one column per setting."""
    settings = sorted({s["setting"] for _, stages in rows for s in stages})
    lines = ["| chain | " + " | ".join(f"T={T} / {P} pairs" for T, P in settings) + " |", "|" + "---|" * (len(settings) + 1)]
    for name, stages in rows:
        cells = {s["setting"]: s for s in stages}
        out = []
        for st in settings:
            s = cells.get(st)
            if not s or not s["runs"]:
                out.append("–")
                continue
            runs = s["runs"]
            n_ok = sum(r["acc"] is not None and r["acc"] >= solved for r in runs)
            cell = f"{n_ok} / {len(runs)}: " + ", ".join(f"{_acc(r['acc'])} ({r['step']})" for r in runs)
            if any(r["before"] is not None for r in runs):
                cell += "; before: " + ", ".join(_acc(r["before"]) for r in runs)
            out.append(cell)
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot(rows, path):
    fig, ax = accuracy_axes()
    for name, stages in rows:
        stages = [s for s in stages if s["runs"]]
        Ls = [s["setting"][0] for s in stages]
        means = [ablate.mean([r["acc"] for r in s["runs"]]) for s in stages]
        line, = ax.plot(Ls, means, marker="o", lw=2, label=f"{name}: end of stage")
        for seed in sorted({r["seed"] for s in stages for r in s["runs"]}):
            pts = [(s["setting"][0], r["acc"]) for s in stages for r in s["runs"] if r["seed"] == seed and r["acc"] is not None]
            ax.plot(*zip(*pts), color=line.get_color(), lw=0.8, alpha=0.4)
        before = [(s["setting"][0], ablate.mean([r["before"] for r in s["runs"]])) for s in stages
                  if any(r["before"] is not None for r in s["runs"])]
        if before:  # the starting weights on the stage's setting, before training there
            ax.plot(*zip(*before), color=line.get_color(), ls="--", marker="x", lw=1, label=f"{name}: its start")
    lengths = sorted({s["setting"][0] for _, stages in rows for s in stages})
    save_accuracy_plot(fig, ax, path, "sequence length of the stage", "val accuracy", lengths)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="sweep files with curriculum stages (`after:`)")
    p.add_argument("--chains", nargs="+", default=None, help="first stages of the chains to show (default: every chain)")
    p.add_argument("--labels", nargs="+", default=None, help="a name per chain of --chains (default: the first stage's name without _t<T>)")
    p.add_argument("--solved", type=float, default=0.99, help="val accuracy that counts as solved")
    p.add_argument("--zero_shot", type=int, default=0, metavar="N",
                   help="also score each stage's starting weights on its setting (N batches of 32; 0: off)")
    p.add_argument("--out", default=None, help="PNG of accuracy against sequence length")
    args = p.parse_args(argv)
    try:
        if args.zero_shot < 0:
            raise ValueError("--zero_shot: must be an integer >= 0 (batches of 32 sequences)")
        sweeps = [ablate.load_sweep(path) for path in args.sweeps]
        found = [(sw, c) for sw in sweeps for c in chains(sw)]
        if args.chains:
            unknown = sorted(set(args.chains) - {c[0] for _, c in found})
            if unknown:
                raise ValueError(f"--chains {' '.join(unknown)}: not a first stage in these sweeps "
                                 f"(first stages: {', '.join(c[0] for _, c in found)})")
            found = [(sw, c) for name in args.chains for sw, c in found if c[0] == name]
        if args.labels and (not args.chains or len(args.labels) != len(args.chains)):
            raise ValueError(f"--labels: must name each chain of --chains, one label each ({len(args.chains or [])} chains, "
                             f"{len(args.labels)} labels)")
        names = args.labels or [chain_name(c) for _, c in found]
        results = {sw["path"]: ablate.collect(sw) for sw in sweeps}  # every result.json read once
        rows = [(name, [stage(sw, v, results[sw["path"]], args.zero_shot) for v in c]) for name, (sw, c) in zip(names, found)]
        if not any(s["runs"] for _, stages in rows for s in stages):
            raise DataError("no finished run (result.json) in these chains yet")
    except (ablate.SweepError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(rows, args.solved))
    if args.out:
        plot(rows, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
