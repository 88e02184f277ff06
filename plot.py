"""Plots of training runs: the training loss and the eval metric over steps, from metrics.jsonl.
One implementation for a single run (`python plot.py out/x`) and for sweeps (ablate.py's report).

    python plot.py out/x                          # -> out/x/loss_curves.png
    python plot.py out/a out/b --out compare.png  # several runs in one figure
"""
import argparse
import json
import os
import sys


def read_metrics(folder):
    """metrics.jsonl rows, deduplicated: a resumed run re-logs steps after its last checkpoint, the
    later line wins; a line cut by a kill is skipped. [] when there is no file."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "step" in r:
                rows[(r["step"], "loss" in r)] = r
    return [rows[k] for k in sorted(rows)]


def loss_curves(runs, path):
    """runs: {label: metrics rows}. Left: training loss; right: val_acc (MQAR) or val_loss, per step (an
    MQAR mixture's other settings dashed, labelled <length>/<pairs>).
    Writes the PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from data import mixture_settings
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    mixed = False
    for label, rows in runs.items():
        tr = [r for r in rows if r.get("loss") is not None]
        ev = [r for r in rows if "loss" not in r]
        line, = axes[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label=label)
        key = "val_acc" if ev and "val_acc" in ev[0] else "val_loss"
        axes[1].plot([r["step"] for r in ev], [r.get(key) for r in ev], marker="o", color=line.get_color(),
                     label=label)
        axes[1].set_ylabel(key)
        # an MQAR mixture's other settings (val_acc_<length>x<pairs>): the run's colour, one dash per setting
        settings = mixture_settings(ev[0] if ev else {})
        for ((length, pairs), k), dash in zip(settings, [(1, 1), (4, 2), (6, 2, 1, 2), (8, 3)] * 4):
            axes[1].plot([r["step"] for r in ev], [r.get(k) for r in ev], color=line.get_color(), dashes=dash,
                         label=f"{label} {length}/{pairs}")
            mixed = True
    axes[0].set_ylabel("train loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if mixed:
        axes[1].legend(fontsize=6)
    return save_png(fig, path)


def save_png(fig, path):
    """Write a matplotlib figure as a PNG atomically (an interrupted or failed write never leaves a torn
    file) and close it; returns path."""
    import matplotlib.pyplot as plt
    from data.tokens import atomic_write
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=80, format="png"))
    finally:
        plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (train.out_dir) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: <run>/loss_curves.png for one run)")
    a = p.parse_args(argv)
    from data.tokens import DataError
    runs = {}
    for folder in a.runs:
        rows = read_metrics(folder)
        if not rows:
            print(f"error: {folder}: no metrics.jsonl rows (train.out_dir of a run that logged a step)",
                  file=sys.stderr)
            return 2
        name = os.path.basename(os.path.normpath(folder))
        runs[os.path.normpath(folder) if name in runs or any(
            os.path.basename(os.path.normpath(f)) == name for f in a.runs if f != folder) else name] = rows
    if a.out is None and len(a.runs) > 1:
        print("error: --out: needed to plot several runs in one figure", file=sys.stderr)
        return 2
    out = a.out or os.path.join(a.runs[0], "loss_curves.png")
    if not out.endswith(".png"):
        print(f"error: --out: a .png path (got {out})", file=sys.stderr)
        return 2
    try:
        loss_curves(runs, out)
    except OSError as e:
        print(f"error: --out {out}: cannot write ({e.strerror or e})", file=sys.stderr)
        return 2
    except DataError as e:  # the atomic write failed: nothing was left behind
        print(f"error: --out {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
