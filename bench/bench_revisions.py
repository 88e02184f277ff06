"""Training speed of the same models at two revisions of this repository, side by side.

    python bench/bench_revisions.py --against 42bdd08 --kinds kda gdn attn --threads 1
    python bench/bench_revisions.py --against HEAD~3 --config configs/default.yaml --threads 1

Each revision runs in its own worker process: --against REV from a `git archive` of REV in a temporary
folder, "now" from this working tree (uncommitted changes included). Both build the same model (the
one-kind models of bench_nanogpt.py at its shape, or the model of --config at that config's
train.batch_size and train.seq_len) and take a warm-up step; then the parent interleaves their timed
steps: each round runs --steps steps in each worker, REV first in even rounds and last in odd ones, so
a noisy machine slows both alike. Both train with plain AdamW (lr 1e-3), so only the model code
differs. Printed per model: ms/step (median of --repeat rounds), tokens/s and REV/now (above 1: the
working tree is faster; the median of the per-round ratios, with bench_nanogpt.median_interval's interval
for it: an interval that holds 1.00 has not shown a difference). Unchanged code (the attention model,
42bdd08 vs later) read 0.98x and 1.04x in two runs on a 2-core box, and 1.08x before the rounds
alternated their order; the same code on both sides (--against HEAD, 15 rounds) 1.00x [0.97, 1.02].
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_nanogpt import add_shape_args, check_args, hybrid_layers, ratio_note, ratio_text  # noqa: E402
from config import load_config, read_yaml  # noqa: E402
from model import ConfigError  # noqa: E402

# Runs inside each worker, with its revision's root first on sys.path. Reads one JSON command per line:
# {"build": model config dict, "B", "T", "vocab", "threads"} -> "ok"; {"steps": n} -> seconds for n steps.
WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from model import GPT, ModelConfig
model = opt = x = y = None
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if "build" in cmd:
            torch.set_num_threads(cmd["threads"])
            torch.manual_seed(0)
            model = GPT(ModelConfig.from_dict(cmd["build"]))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            x = torch.randint(0, cmd["vocab"], (cmd["B"], cmd["T"]))
            y = torch.roll(x, -1, dims=1)
            n = 1
        else:
            n = cmd["steps"]
        t0 = time.perf_counter()
        for _ in range(n):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    except Exception as e:  # reported by the parent as one line
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
"""


class Worker:
    """One revision's worker process; ask() sends a command and returns its reply."""

    def __init__(self, name, root, threads):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, root], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=root)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited (its stderr is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply["seconds"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def export(rev, folder):
    """The tree of git revision `rev` under folder; a clear error if git does not know it."""
    r = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
    if r.returncode:
        raise SystemExit(f"error: --against: git does not know revision {rev!r} ({r.stderr.decode().strip()})")
    tar = os.path.join(folder, "tree.tar")
    with open(tar, "wb") as f:
        f.write(r.stdout)
    with tarfile.open(tar) as t:
        t.extractall(folder, filter="data")
    return folder


def model_configs(args):
    """name -> (model config dict, batch, length, vocab) for every model to compare."""
    if args.config:
        cfg = load_config(args.config)                           # validated here, with a clear error
        return {os.path.basename(args.config): (read_yaml(args.config).get("model") or {}, cfg.train.batch_size,
                                                cfg.train.seq_len, cfg.model.vocab_size)}
    return {kind: (hybrid_layers(kind, args), args.B, args.T, args.vocab) for kind in args.kinds}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="git revision to compare the working tree with")
    p.add_argument("--kinds", nargs="+", default=["kda"], help="one-kind models of bench_nanogpt.py")
    p.add_argument("--config", default=None, help="a model config file instead of --kinds")
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--repeat", type=int, default=7, help="interleaved rounds (median reported)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    try:
        check_args(args, ("steps", "repeat", "threads"))
        configs = model_configs(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        old_root = export(args.against, tmp)
        print(f"training ms/step, {args.against} vs the working tree, fp32, AdamW, threads={args.threads}, "
              f"median of {args.repeat} interleaved rounds of {args.steps} steps", flush=True)
        for name, (raw, B, T, vocab) in configs.items():
            workers = [Worker(args.against, old_root, args.threads), Worker("now", ROOT, args.threads)]
            try:
                for w in workers:
                    w.ask(build=raw, B=B, T=T, vocab=vocab, threads=args.threads)
                times = {w.name: [] for w in workers}
                for r in range(args.repeat):                         # ABBA: neither tree always goes first
                    for w in (workers if r % 2 == 0 else workers[::-1]):
                        times[w.name].append(w.ask(steps=args.steps) / args.steps)
            except RuntimeError as e:                                # a worker failed: one line, not a traceback
                raise SystemExit(f"error: {name}: {e}") from None
            finally:
                for w in workers:
                    w.close()
            old, new = statistics.median(times[args.against]), statistics.median(times["now"])
            results[name] = statistics.median(a / b for a, b in zip(times[args.against], times["now"]))
            print(f"{name} (B={B} T={T}): {args.against} {old * 1e3:8.1f} ms/step ({B * T / old:7,.0f} tok/s)   now "
                  f"{new * 1e3:8.1f} ms/step ({B * T / new:7,.0f} tok/s)   "
                  f"{ratio_text(times[args.against], times['now'], f'({args.against}/now)')}", flush=True)
    print(ratio_note(args.repeat))
    return results


if __name__ == "__main__":
    main()
