"""DSA study (issue 16): does the dense warm-up teach the indexer the attention distribution, and does
sparse attention then stay close to dense MLA?

For every seed it trains (or, for runs already finished, reads) a small MLA model with DSA into
<root>/s<seed>/:
- `dense`: the `dense_warmup` stage to --steps. Attention is dense and the indexer only learns (its input
  is detached), so this run's LM loss is dense MLA's;
- `k<top_k>` for each --top_ks: a copy of dense's checkpoint at --switch, resumed in the `sparse` stage
  to --steps (same optimizer state and data order).
Then it prints a markdown table (val loss after the switch, mean ± std over seeds; each top_k's
difference to dense per seed; the indexer KL at the end) and plots the indexer KL and the val loss over
steps (mean over seeds).

    python studies/dsa_stages.py --seeds 1337 1338 1339 --out docs/dsa_stages.png
    python studies/dsa_stages.py --seeds 1338 --train_only      # one seed per process, then the table:
    python studies/dsa_stages.py --seeds 1337 1338 1339 --report_only --out docs/dsa_stages.png
"""
import argparse
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ablate  # noqa: E402
from config import load_config  # noqa: E402
from data.tokens import DataError  # noqa: E402
from model import ConfigError  # noqa: E402
from plot import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model.d_model=128", "--model.n_layer=4", "--model.layers.mla.n_heads=4"]


def overrides(seed, steps, switch, top_k, stage, threads, out_dir, extra=()):
    """The train.py overrides of one run (the README's DSA commands), then `extra`."""
    return MODEL + [f"--train.max_steps={steps}", f"--train.ckpt_interval={switch}", "--train.keep_last=5",
                    "--train.sample_tokens=0", f"--train.threads={threads}", f"--train.seed={seed}",
                    f"--model.layers.mla.dsa={{n_heads: 4, head_dim: 32, rope_dim: 16, top_k: {top_k}, stage: {stage}}}",
                    f"--train.out_dir={out_dir}", *extra]


def train_seed(root, seed, steps, switch, top_ks, threads, extra=(), log=print):
    """Train the dense run and one sparse run per top_k of one seed (skipping finished runs); resumes an
    interrupted run from its latest checkpoint."""
    import train
    from train import checkpoint_step, latest_checkpoint
    base = os.path.join(ROOT, "configs", "mla.yaml")
    dense = os.path.join(root, f"s{seed}", "dense")
    runs = [("dense", dense, max(top_ks), "dense_warmup")] + [
        (f"k{k}", os.path.join(root, f"s{seed}", f"k{k}"), k, "sparse") for k in top_ks]
    for name, out_dir, top_k, stage in runs:
        latest = latest_checkpoint(out_dir)
        if latest and checkpoint_step(latest) >= steps:
            log(f"seed {seed} {name}: finished ({out_dir})")
            continue
        resume = latest is not None
        if stage == "sparse" and not resume:  # start from dense's checkpoint at the switch
            start = os.path.join(dense, f"ckpt_{switch}.pt")
            if not os.path.exists(start):
                raise DataError(f"{start}: the dense run has no checkpoint at the switch step {switch}")
            os.makedirs(out_dir, exist_ok=True)
            shutil.copy(start, out_dir)
            shutil.copy(os.path.join(dense, "metrics.jsonl"), out_dir)
            resume = True
        log(f"seed {seed} {name}: {'resuming' if resume else 'training'} into {out_dir}")
        cfg = load_config(base, overrides(seed, steps, switch, top_k, stage, threads, out_dir, extra))
        train.train(cfg, resume=resume or None)


def curves(out_dir):
    """({step: val_loss}, {step: indexer_kl}) of one run."""
    rows = read_metrics(out_dir)
    if not rows:
        raise DataError(f"{out_dir}: no metrics.jsonl rows (train it first: drop --report_only)")
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    kl = {r["step"]: r["indexer_kl"] for r in rows if "indexer_kl" in r}
    return val, kl


def report(root, seeds, steps, switch, top_ks):
    """The markdown table and the per-run curves {name: [(val, kl) per seed]}."""
    names = ["dense"] + [f"k{k}" for k in top_ks]
    runs = {n: [curves(os.path.join(root, f"s{s}", n)) for s in seeds] for n in names}
    evals = sorted(st for st in runs["dense"][0][0] if switch < st <= steps)
    for n in names:
        for s, (val, _) in zip(seeds, runs[n]):
            if steps not in val:
                raise DataError(f"{os.path.join(root, f's{s}', n)}: no val loss at step {steps} (unfinished run)")
    label = {"dense": "dense MLA (`dense_warmup`)", **{f"k{k}": f"DSA top_k {k}" for k in top_ks}}
    head = ["run"] + [f"val loss @{st}" for st in evals] + [f"vs dense @{steps}, per seed", "mean",
                                                              f"indexer KL @{steps}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        cells = [label[n]]
        for st in evals:
            xs = [val[st] for val, _ in runs[n]]
            cells.append(f"{ablate.mean(xs):.4f} ± {ablate.std(xs):.4f}")
        diffs = [val[steps] - dval[steps] for (val, _), (dval, _) in zip(runs[n], runs["dense"])]
        cells += (["-", "-"] if n == "dense" else
                  [", ".join(f"{d:+.4f}" for d in diffs), f"{ablate.mean(diffs):+.4f} ± {ablate.std(diffs):.4f}"])
        kls = [max((st, v) for st, v in kl.items() if st <= steps)[1] for _, kl in runs[n] if kl]
        cells.append(f"{statistics.mean(kls):.3f}" if kls else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), runs


def plot(runs, seeds, switch, path):
    """Indexer KL and val loss over steps, mean over seeds, one line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot import save_png
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, per_seed in runs.items():
        for ax, i in ((a, 1), (b, 0)):
            steps = sorted(set.intersection(*(set(c[i]) for c in per_seed)))
            if name != "dense":
                steps = [st for st in steps if st > switch]
            ax.plot(steps, [statistics.mean(c[i][st] for c in per_seed) for st in steps], label=name,
                    marker="." if i == 0 else None)
    for ax, what in ((a, "indexer KL (dense: all keys; sparse: selected keys)"), (b, "val loss")):
        ax.axvline(switch, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel(what, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"DSA: dense warm-up, sparse from step {switch} (mean of {len(seeds)} seeds)", fontsize=9)
    return save_png(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    p.add_argument("--root", default="runs/dsa", help="runs go to <root>/s<seed>/{dense,k<top_k>}")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--switch", type=int, default=300, help="the step the sparse runs start from")
    p.add_argument("--top_ks", type=int, nargs="+", default=[64, 32, 16])
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--set", action="append", default=[], metavar="--KEY=VALUE",
                   help="one more train.py override for every run, repeatable (--set=--train.batch_size=16)")
    p.add_argument("--train_only", action="store_true", help="train, no table")
    p.add_argument("--report_only", action="store_true", help="read finished runs, train nothing")
    p.add_argument("--out", default=None, help="PNG of the indexer KL and val loss over steps")
    a = p.parse_args(argv)
    if not 0 < a.switch < a.steps or a.steps % a.switch:
        print(f"error: --switch must lie in (0, --steps) and divide it (got {a.switch}, {a.steps})", file=sys.stderr)
        return 2
    try:
        if not a.report_only:
            for seed in a.seeds:
                train_seed(a.root, seed, a.steps, a.switch, a.top_ks, a.threads, a.set)
        if a.train_only:
            return 0
        table, runs = report(a.root, a.seeds, a.steps, a.switch, a.top_ks)
        print(f"\n{len(a.seeds)} seeds ({', '.join(map(str, a.seeds))}); sparse from step {a.switch}\n")
        print(table)
        if a.out:
            print(f"plot: {plot(runs, a.seeds, a.switch, a.out)}")
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
