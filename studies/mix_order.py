"""Which setting of an MQAR mixture leaves the plateau first (issue 16). A run trained on data.mqar_mix logs
val_acc at its target setting and val_acc_<length>x<pairs> at each other one; for every run folder this prints
the first eval step at which each setting's accuracy reaches each threshold, as a markdown table. A threshold
is an accuracy (0.5) or a multiple of the setting's plateau, 1 / pairs (1.5x: half again the accuracy of
answering with any value of the context; the plateau is where the recall circuit has not formed yet).

    python studies/mix_order.py runs/mqar_ladder512/attn_h1_v66_mix_e20-s{0,1,2,3,4} --at 1.5x 0.5 0.9
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import mixture_setting, mixture_settings  # noqa: E402
from plot import read_metrics  # noqa: E402


def settings_of(rows, target):
    """[(length, pairs, metric name)] of the run's eval rows, shortest first; the target is val_acc."""
    found = mixture_settings({k for r in rows for k in r})
    return [(*setting, k) for setting, k in found] + [(*target, "val_acc")]


def first_steps(rows, metric, pairs, thresholds):
    """For each threshold (parse_threshold's (text, value, per_pair)), the first eval step with
    rows[metric] >= value (/ pairs when per_pair), else None."""
    evals = [(r["step"], r[metric]) for r in rows if metric in r]
    levels = [value / pairs if per_pair else value for _, value, per_pair in thresholds]
    return [next((step for step, acc in evals if acc >= level), None) for level in levels]


def parse_threshold(text):
    """'0.5' -> ('0.5', 0.5, False); '1.5x' -> ('1.5x', 1.5, True): 1.5 / pairs."""
    per_pair = text.endswith("x")
    try:
        value = float(text[:-1] if per_pair else text)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive accuracy (0.5) or a multiple of 1 / pairs (1.5x), "
                                         f"got {text!r}")
    return text, value, per_pair


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders of MQAR mixture runs (metrics.jsonl)")
    p.add_argument("--at", nargs="+", type=parse_threshold,
                   default=[parse_threshold(t) for t in ("1.5x", "0.5", "0.9")],
                   help="thresholds: accuracies, or Nx for N / pairs (default: 1.5x 0.5 0.9)")
    p.add_argument("--target", default="512x32",
                   help="the run's own val setting, <length>x<pairs> (default 512x32)")
    a = p.parse_args(argv)
    target = mixture_setting(f"val_acc_{a.target}")
    if target is None:
        print(f"error: --target: <length>x<pairs>, e.g. 512x32 (got {a.target})", file=sys.stderr)
        return 2
    table = {}
    for folder in a.runs:
        rows = [r for r in read_metrics(folder) if "val_acc" in r]
        if not rows:
            print(f"error: {folder}: no eval rows in metrics.jsonl (a run folder of train.py)", file=sys.stderr)
            return 2
        table[folder] = {(L, P): first_steps(rows, k, P, a.at) for L, P, k in settings_of(rows, target)}
    columns = sorted({s for cells in table.values() for s in cells}, key=lambda s: (s == target, s))
    print(f"first eval step at which each setting's val accuracy reaches {' / '.join(t for t, _, _ in a.at)} "
          "(x: times 1 / pairs)")
    print("| run | " + " | ".join(f"{L} / {P}" for L, P in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for folder, cells in table.items():
        shown = [" / ".join("-" if s is None else str(s) for s in cells[c]) if c in cells else "" for c in columns]
        print(f"| {os.path.basename(os.path.normpath(folder))} | " + " | ".join(shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
