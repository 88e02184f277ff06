"""StreamingLLM study (issue 16): does a trained model park attention on the first token, and does
window-only eviction then collapse while 4 kept sink tokens (or learned sinks) rescue it?

For every run folder: the share of attention on position 0 per global layer at each checkpoint
(evals.eval_attention_sinks), and at the last checkpoint the perplexity of long streams with a full
cache, a recent window only, and 4 first tokens + the window (evals.eval_streaming); with --sink_heads K
also the first tokens kept for the K most sink-like heads only (the window alone for the rest), which
says how much of the cost of evicting them those heads carry. Prints a markdown table per run and writes
a plot of the position-0 share over training.

    python studies/attention_sinks.py runs/streaming_long/global runs/streaming_long/learned_sinks \
        --budgets 16 32 64 --factor 4 --out docs/attention_sinks.png
"""
import argparse
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import evals  # noqa: E402
from data.tokens import DataError  # noqa: E402
from plot import save_png  # noqa: E402
from sample import load_model  # noqa: E402


def checkpoints(folder):
    """[(step, path)] of a run folder's ckpt_<step>.pt files, by step."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(folder, "ckpt_*.pt"))
             if (m := re.search(r"ckpt_(\d+)\.pt$", p))]
    if not found:
        raise DataError(f"{folder}: no checkpoint (ckpt_<step>.pt) in this folder")
    return sorted(found)


def study(folder, budgets, n_sinks, factor, n_seqs, skip, sink_heads=0, log=print):
    """{"shares": [(step, eval_attention_sinks result)], "streaming": {budget: eval_streaming of the last
    checkpoint}, "val": its eval_val}."""
    shares = []
    for step, path in checkpoints(folder):
        model, cfg = load_model(path)
        shares.append((step, evals.run_eval("attention_sinks", model, cfg, {"n_seqs": n_seqs, "skip": skip})))
        log(f"{folder} step {step}: key 0 share {shares[-1][1]['key0_mean']:.3f} (uniform {shares[-1][1]['uniform']:.3f})")
    stream = {b: evals.run_eval("streaming", model, cfg, {"factor": factor, "budget": b, "n_sinks": n_sinks,
                                                           "n_seqs": n_seqs, "sink_heads": sink_heads,
                                                           "full": b == budgets[0]})  # full cache: once
              for b in budgets}
    return {"shares": shares, "streaming": stream, "val": evals.run_eval("val", model, cfg, {"n_batches": 16})}


def table(folder, result):
    """Markdown rows: the position-0 share per layer at each checkpoint, then the streaming perplexities."""
    shares = result["shares"]
    layers = sorted(int(k[len("key0_L"):]) for k in shares[0][1] if k.startswith("key0_L"))
    learned = any(r[f"learned_L{i}"] > 0 for _, r in shares for i in layers)
    head = (["step"] + [f"key 0, layer {i}" for i in layers] + [f"strongest head, layer {i}" for i in layers]
            + ([f"learned sink, layer {i}" for i in layers] if learned else []) + ["heads > 0.3 (by layer)"])
    lines = [f"{folder}: share of attention on position 0, mean over heads and in the layer's strongest head; "
             f"heads > 0.3: the fraction of all heads that put more than 0.3 there, then within each layer (uniform attention: "
             f"{shares[0][1]['uniform']:.3f})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, r in shares:
        cells = [str(step)] + [f"{r[f'key0_L{i}']:.3f}" for i in layers] + [f"{r[f'key0_maxhead_L{i}']:.3f}" for i in layers]
        cells += [f"{r[f'learned_L{i}']:.3f}" for i in layers] if learned else []
        cells.append(f"{r['sink_heads']:.2f} (" + " / ".join(f"{r[f'sink_heads_L{i}']:.2f}" for i in layers) + ")")
        lines.append("| " + " | ".join(cells) + " |")
    v = result["val"]
    lines += ["", f"last checkpoint (step {shares[-1][0]}): val loss {v['val_loss']:.3f}; perplexity of the streams",
              ""]
    heads = "ppl_sinks_heads" in next(iter(result["streaming"].values()))
    lines += ["| cache budget | full cache | window only | sinks + window | cost of evicting |"
              + (" sinks for the top heads only, window for the rest | share of the cost they win back |" if heads else ""),
              "|---|---|---|---|---|" + ("---|---|" if heads else "")]
    full = next(iter(result["streaming"].values()))["ppl_full"]       # the same at every budget
    for b, s in result["streaming"].items():
        window, sinks = s["ppl_window"], s["ppl_sinks+window"]
        lines.append(f"| {b} | {full:.2f} | {window:.2f} | {sinks:.2f} | {cost(window, sinks)} |"
                     + (f" {s['ppl_sinks_heads']:.2f} | {won_back(window, sinks, s['ppl_sinks_heads'])} |" if heads else ""))
    return "\n".join(lines) + "\n"


def cost(window, sinks):
    """How much worse the window alone is than sinks + window, as a signed percentage ("0%", not "-0%")."""
    change = round(100 * (window / sinks - 1))
    return f"{change:+d}%" if change else "0%"


def won_back(window, sinks, heads):
    """(window - heads) / (window - sinks): the share of the cost of evicting that keeping the first tokens
    for the top heads alone wins back ("-" where evicting costs nothing)."""
    return f"{(window - heads) / (window - sinks):.0%}" if window - sinks > 1e-3 * sinks else "-"


def plot(results, path):
    """Key-0 share of every layer over steps, one panel per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (folder, res) in zip(axes[0], results.items()):
        steps = [s for s, _ in res["shares"]]
        for key in sorted(k for k in res["shares"][0][1] if k.startswith(("key0_L", "learned_L"))):
            ys = [r[key] for _, r in res["shares"]]
            if key.startswith("learned") and not any(ys):
                continue
            ax.plot(steps, ys, marker="o", ls="-" if key.startswith("key0") else "--",
                    label=key.replace("key0_L", "key 0, layer ").replace("learned_L", "learned sink, layer "))
        ax.axhline(res["shares"][0][1]["uniform"], color="gray", ls=":", label="uniform")
        ax.set_title(os.path.basename(folder.rstrip("/")), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("attention share")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders with ckpt_<step>.pt files")
    p.add_argument("--budgets", type=int, nargs="+", default=[64], help="keys kept by the evicting caches")
    p.add_argument("--n_sinks", type=int, default=4, help="first tokens kept by sinks + window")
    p.add_argument("--factor", type=float, default=4, help="stream length in training lengths")
    p.add_argument("--n_seqs", type=int, default=8)
    p.add_argument("--skip", type=int, default=16, help="queries before this position are not counted")
    p.add_argument("--sink_heads", type=int, default=0,
                   help="also keep the first tokens for only this many heads, those with the most attention on position 0")
    p.add_argument("--out", default=None, help="PNG of the position-0 share over steps")
    args = p.parse_args(argv)
    try:
        for b in args.budgets:
            evals.check_options("streaming", {"budget": b, "n_sinks": args.n_sinks, "factor": args.factor,
                                              "sink_heads": args.sink_heads})
        results = {f: study(f, args.budgets, args.n_sinks, args.factor, args.n_seqs, args.skip, args.sink_heads)
                   for f in args.runs}
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for folder, res in results.items():
        print(table(folder, res))
    if args.out:
        plot(results, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
