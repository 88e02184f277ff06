"""Which setting of an MQAR mixture leaves the plateau first (issue 16). A run trained on data.mqar_mix logs
val_acc at its target setting and val_acc_<length>x<pairs> at each other one; for every run folder this prints
the first eval step at which each setting's accuracy reaches each threshold, as a markdown table. A threshold
is an accuracy (0.5) or a multiple of the setting's plateau, 1 / pairs (1.5x: half again the accuracy of
answering with any value of the context; the plateau is where the recall circuit has not formed yet).

    python studies/mix_order.py runs/mqar_ladder512/attn_h1_v66_mix_e20-s{0,1,2,3,4} --at 1.5x 0.5 0.9
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plot import read_metrics  # noqa: E402


def settings_of(rows, target):
    """[(length, pairs, metric name)] of the run's eval rows, shortest first; the target is val_acc."""
    found = {(int(m[1]), int(m[2]), k) for r in rows for k in r if (m := re.fullmatch(r"val_acc_(\d+)x(\d+)", k))}
    return sorted(found) + [(*target, "val_acc")]


def first_steps(rows, metric, pairs, thresholds):
    """For each threshold (a float, or 'Nx': N / pairs), the first eval step with rows[metric] >= it, else None."""
    evals = [(r["step"], r[metric]) for r in rows if metric in r]
    out = []
    for t in thresholds:
        level = float(t[:-1]) / pairs if t.endswith("x") else float(t)
        out.append(next((step for step, acc in evals if acc >= level), None))
    return out


def parse_threshold(text):
    try:
        value = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive accuracy (0.5) or a multiple of 1 / pairs (1.5x), "
                                         f"got {text!r}")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders of MQAR mixture runs (metrics.jsonl)")
    p.add_argument("--at", nargs="+", type=parse_threshold, default=["1.5x", "0.5", "0.9"],
                   help="thresholds: accuracies, or Nx for N / pairs (default: 1.5x 0.5 0.9)")
    p.add_argument("--target", default="512x32",
                   help="the run's own val setting, <length>x<pairs> (default 512x32)")
    a = p.parse_args(argv)
    if not re.fullmatch(r"\d+x\d+", a.target):
        print(f"error: --target: <length>x<pairs>, e.g. 512x32 (got {a.target})", file=sys.stderr)
        return 2
    target = tuple(int(v) for v in a.target.split("x"))
    table = {}
    for folder in a.runs:
        rows = [r for r in read_metrics(folder) if "val_acc" in r]
        if not rows:
            print(f"error: {folder}: no eval rows in metrics.jsonl (a run folder of train.py)", file=sys.stderr)
            return 2
        table[folder] = {(L, P): first_steps(rows, k, P, a.at) for L, P, k in settings_of(rows, target)}
    columns = sorted({s for cells in table.values() for s in cells}, key=lambda s: (s == target, s))
    print(f"first eval step at which each setting's val accuracy reaches {' / '.join(a.at)} (x: times 1 / pairs)")
    print("| run | " + " | ".join(f"{L} / {P}" for L, P in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for folder, cells in table.items():
        shown = [" / ".join("-" if s is None else str(s) for s in cells[c]) if c in cells else "" for c in columns]
        print(f"| {os.path.basename(os.path.normpath(folder))} | " + " | ".join(shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
