"""Config-driven ablation sweeps: train every variant x seed, evaluate, tabulate, plot.

    python ablate.py sweeps/mqar.yaml              # run (or resume) the sweep, then write the report
    python ablate.py sweeps/mqar.yaml --report     # only collect finished runs into results.md + plots
    python ablate.py sweeps/mqar.yaml --dry_run    # check the sweep file and print the runs
    python ablate.py sweeps/mqar.yaml --only attn,kda   # a subset (e.g. two processes), then --report
    python ablate.py sweeps/mqar.yaml --only kda --seeds 0   # one variant at one of the sweep's seeds
    python ablate.py sweeps/mqar_lr.yaml --jobs 4  # 4 runs at once, one process each, a line per run

A sweep file (YAML):

    base: sweeps/mqar_base.yaml          # the base config (path relative to the sweep file or repo root)
    out_dir: runs/mqar                   # the sweep folder
    seeds: [0, 1]                        # every variant runs once per seed (sets train.seed)
    lrs: [1.0e-4, 4.6e-4, 2.2e-3, 1.0e-2]  # optional: every variant x seed once per peak lr (train.lr);
                                         #   the report shows each variant at its best lr
    stop_at: {val_acc: 0.99}             # optional: a run stops at the first eval reaching it
    select: val_acc                      # optional: the final eval metric that picks the best lr
                                         #   (default val_acc if the runs report it, else val_loss)
    overrides: [--train.max_steps=1500]  # applied to every variant (optional)
    variants:                            # name -> dotted overrides ({} = the base as is), as a
      attn: {}                           #   mapping of dotted keys to values, or a list of strings
      swa32: {model.layers.attn.window: 32}
      kda: ["--model.pattern=[kda]", --model.layers.kda.n_heads=2]
      kda_long: {after: kda, train.seq_len: 512}   # a curriculum stage: starts from kda's weights
      kda_lr3e3: {lr_of: kda, train.lr: 3.0e-3}   # an lr point of kda: kda's overrides at another lr
    evals:                               # eval name -> options (see evals.py); {} = defaults
      mqar: {n_batches: 8}
      needle: {factors: [1, 2, 4]}
    threads: 1                           # torch threads (1 is fastest on a shared machine)
    decode_ctx: 256                      # context at which decode ms/token is measured (CPU)

Each run trains into <out_dir>/<variant>-s<seed>/ (with lrs: <variant>-lr<lr>-s<seed>/) and ends
with result.json, written atomically. The sweep sets train.out_dir and train.seed (and train.lr under lrs,
train.init_from in a stage) itself: an override of one of them is refused, not ignored. A variant with
`after: <an earlier variant>` is a curriculum stage: each of its runs starts from the weights of that
variant's run with the same seed (and lr), as a fresh run (train.init_from: step 0, new optimizer and
schedule), and waits for that run to finish;
a stage whose earlier run has no result (not run, stopped, diverged) is reported and not started.
A variant with `lr_of: <an earlier variant>` (and only train.lr) is that variant at another lr, for an lr
grid over some variants only: it runs as a variant of its own (its own folder and --only name), and the
report shows it in its variant's row, at the best of their lrs.
A run whose loss diverges (train.max_bad_steps) is recorded as diverged and loses the lr selection.
`--jobs N` trains N runs at once in separate processes (each with `threads` torch threads) and prints
a progress line as each run ends. SIGTERM / SIGUSR1 /
Ctrl-C: the running runs finish their step and save, no result is recorded for them, no further run
starts, exit 0. A rerun skips runs with a result.json and resumes half-finished runs from their last
checkpoint (train.py's resume), so an interrupted sweep continues where it stopped. A run being
trained by another process (`--only` subsets that overlap, or parallel jobs) is skipped. The report
is <out_dir>/results.md (one row per variant at its best lr: seeds averaged, the selection metric as
mean ± sample std; with lrs or lr_of, a second table gives every lr) and PNG plots of the best-lr runs: loss
curves, MQAR accuracy by recall distance, cache bytes vs context (log-log), loss by position. The best lr is
the one with the best mean over the seeds that every lr of the variant finished (over all its seeds when no
seed is common to them), so a second seed at one lr does not decide against a single seed at another.
"""
import argparse
import concurrent.futures
import json
import math
import os
import signal
import sys
import time
from concurrent.futures.process import BrokenProcessPool

import cost
import evals
from config import ROOT, STOP_METRICS, apply_override, from_raw, higher_is_better, read_yaml, refuse_unused
from data.tokens import DataError, atomic_write, check_writable, write_json
from model import ConfigError
from plot import loss_curves, read_metrics  # noqa: F401  (read_metrics: ablate.read_metrics)

SWEEP_KEYS = {"base": "path of the base config", "out_dir": "sweep folder", "seeds": "list of ints",
              "overrides": "list of dotted overrides for every variant", "variants": "name -> list of overrides",
              "evals": "eval name -> options", "threads": "torch threads", "decode_ctx": "int",
              "description": "text", "lrs": "list of peak learning rates (train.lr), one run each",
              "stop_at": "early-stop targets, e.g. {val_acc: 0.99}", "select": "metric picking the best lr"}
CONTEXTS = cost.CONTEXTS


class SweepError(ValueError):
    """A bad sweep file; the message is one line."""


class SweepStopped(Exception):
    """A run was stopped by a signal (Ctrl-C, SIGTERM): its checkpoint is saved, it has no result."""


# ----------------------------------------------------------------------------------------------
# the sweep file


# settings the sweep sets for each run itself (after every override)
SWEEP_OWNED = {"train.out_dir": "each run's folder is <out_dir>/<variant>-s<seed> (the sweep's out_dir, or --out_dir)",
               "train.seed": "the sweep's seeds set each run's seed (seeds: [...])"}


def _norm_override(o, where):
    if not isinstance(o, str):
        raise SweepError(f"{where}: overrides are strings like --model.n_layer=4 (got {o!r})")
    o = o if o.startswith("--") else "--" + o
    if "=" not in o or "." not in o.split("=", 1)[0]:
        raise SweepError(f"{where}: bad override {o!r}; overrides look like --section.key=value")
    owner = SWEEP_OWNED.get(o[2:].split("=", 1)[0])
    if owner:  # applied after the overrides, so the override would be ignored without a word
        raise SweepError(f"{where}: {o!r}: {owner}; drop this override")
    return o


def load_sweep(path):
    """Read and check a sweep file: every variant's config is built and validated before any run."""
    raw = _sweep_mapping(path)
    seeds = raw.get("seeds", [0])
    ints = isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not ints or not seeds or len(set(seeds)) != len(seeds):  # a repeated seed: one run counted twice
        raise SweepError(f"{path}: seeds: must be a non-empty list of distinct integers (got {seeds!r})")
    lrs = raw.get("lrs")
    if lrs is not None:
        lrs = [_float(x) for x in lrs] if isinstance(lrs, list) else None
        if not lrs or not all(x is not None and x > 0 for x in lrs) or len(set(map(_lr_tag, lrs))) != len(lrs):
            raise SweepError(f"{path}: lrs: must be a non-empty list of distinct positive numbers (got {raw['lrs']!r})")
    select = raw.get("select")
    if select is not None and select not in STOP_METRICS:
        raise SweepError(f"{path}: select: must be one of {', '.join(STOP_METRICS)} (got {select!r})")
    for key, default, allowed in (("threads", 1, "an integer >= 1"), ("decode_ctx", None, "an integer >= 1 or null")):
        value = raw.get(key, default)
        if not (value is None and default is None) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SweepError(f"{path}: {key}: must be {allowed} (got {value!r})")
    out_dir = raw.get("out_dir") or os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(out_dir, str):
        raise SweepError(f"{path}: out_dir: must be a folder path (got {out_dir!r})")
    evs = _sweep_evals(path, raw.get("evals") or {})
    sweep = {"path": path, "base": _base_config(path, raw["base"]), "out_dir": out_dir, "seeds": seeds,
             "evals": evs, "threads": raw.get("threads", 1), "decode_ctx": raw.get("decode_ctx"),
             "description": raw.get("description", ""), "common": _common_overrides(path, raw),
             "variants": {}, "lrs": lrs or [None], "select": select}
    variants = raw["variants"]
    if not isinstance(variants, dict) or not variants:
        raise SweepError(f"{path}: variants: must be a non-empty mapping of name -> list of overrides")
    sweep["after"], sweep["lr_of"] = {}, {}
    for name, ovs in variants.items():
        name = str(name)
        if isinstance(ovs, dict) and "after" in ovs:
            ovs = dict(ovs)
            sweep["after"][name] = _earlier_variant(path, name, ovs.pop("after"), sweep["variants"])
        if isinstance(ovs, dict) and "lr_of" in ovs:
            ovs = _lr_point(path, name, ovs, sweep)
        sweep["variants"][name] = _variant_overrides(path, name, ovs)
        owned_here = {"train.lr": lrs and "the sweep's lrs grid sets each run's lr; drop this override or the grid",
                      "train.init_from": name in sweep["after"] and "a stage (after: ...) starts from its earlier "
                                                                    "stage's weights; drop this override"}
        for o in sweep["common"] + sweep["variants"][name]:  # (set after the overrides: they would be ignored)
            why = owned_here.get(o[2:].split("=", 1)[0])
            if why:
                raise SweepError(f"{path}: variants.{name}: {o!r}: {why}")
        try:
            cfg = config_for(sweep, name, seeds[0], sweep["lrs"][0])
            for ev, opts in evs.items():  # an eval the variant's data can never run (mqar on text, ...)
                evals.check_options(ev, {**evals.eval_options(ev), **opts}, cfg)
        except ValueError as e:
            raise SweepError(f"{path}: variants.{name}: {e}") from None
    return sweep


def _sweep_mapping(path):
    """The sweep file's mapping, with only known keys and the required ones present."""
    try:
        raw = read_yaml(path)
    except ConfigError as e:
        raise SweepError(str(e)) from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: a sweep file is a mapping with keys {', '.join(SWEEP_KEYS)}")
    for key in raw:
        if key not in SWEEP_KEYS:
            raise SweepError(f"{path}: {key}: unknown key; allowed keys: {', '.join(SWEEP_KEYS)}")
    for key in ("base", "variants"):
        if key not in raw:
            raise SweepError(f"{path}: {key}: required key is missing ({SWEEP_KEYS[key]})")
    return raw


def _base_config(path, base):
    """The base config file: relative to the sweep file, the repo root or the working directory."""
    if not isinstance(base, str):
        raise SweepError(f"{path}: base: must be a path to a config file (got {base!r})")
    here = os.path.dirname(os.path.abspath(path))
    cands = [base if os.path.isabs(base) else os.path.join(d, base) for d in (here, ROOT, os.getcwd())]
    base_path = next((c for c in cands if os.path.isfile(c)), None)
    if base_path is None:
        raise SweepError(f"{path}: base: config file {base!r} not found (relative to the sweep file or repo root)")
    return base_path


def _common_overrides(path, raw):
    """The overrides every run gets: the sweep's `overrides`, then its `stop_at` as train.stop_at."""
    common = raw.get("overrides") or []
    if isinstance(common, dict):
        common = [f"--{k}={json.dumps(v)}" for k, v in common.items()]
    if not isinstance(common, list):
        raise SweepError(f"{path}: overrides: must be a list of dotted overrides (got {common!r})")
    common = [_norm_override(o, f"{path}: overrides") for o in common]
    stop_at = raw.get("stop_at")
    if stop_at is not None:
        if not isinstance(stop_at, dict) or not stop_at:
            raise SweepError(f"{path}: stop_at: must be a mapping of eval metric -> target, e.g. {{val_acc: 0.99}}")
        common = common + [f"--train.stop_at={json.dumps(stop_at)}"]
    return common


def _sweep_evals(path, evs):
    """eval name -> options, every name and option (and value, with the defaults) checked."""
    if isinstance(evs, list):
        evs = {name: {} for name in evs}
    if not isinstance(evs, dict):
        raise SweepError(f"{path}: evals: must be a mapping of eval name -> options (got {evs!r})")
    for name, opts in evs.items():
        if name not in evals.EVALS:
            raise SweepError(f"{path}: evals.{name}: unknown eval; allowed: {', '.join(evals.EVALS)}")
        opts = evs[name] = opts or {}
        if not isinstance(opts, dict):
            raise SweepError(f"{path}: evals.{name}: options must be a mapping (got {opts!r})")
        for k in opts:
            if k not in evals.eval_options(name):
                raise SweepError(f"{path}: evals.{name}.{k}: unknown option; allowed: "
                                 f"{', '.join(evals.eval_options(name))}")
        try:  # values too, with the defaults they run with
            evals.check_options(name, {**evals.eval_options(name), **opts})
        except ValueError as e:
            raise SweepError(f"{path}: {e}") from None
    return evs


def _variant_overrides(path, name, ovs):
    """A variant's overrides as --section.key=value strings (from a list, a mapping, or null)."""
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SweepError(f"{path}: variants.{name}: names may hold letters, digits, '-', '_', '.' only")
    if ovs is None:
        ovs = []
    if isinstance(ovs, dict):  # {model.pattern: [kda, attn]} -> --model.pattern=["kda", "attn"]
        ovs = [f"--{k}={json.dumps(v)}" for k, v in ovs.items()]
    if not isinstance(ovs, list):
        raise SweepError(f"{path}: variants.{name}: must be a list of dotted overrides or a mapping "
                         f"of dotted keys to values (got {ovs!r})")
    return [_norm_override(o, f"{path}: variants.{name}") for o in ovs]


def _earlier_variant(path, name, after, earlier, key="after"):
    """A curriculum stage's `after` (or an lr point's `lr_of`): the name of a variant listed before it."""
    if not isinstance(after, str) or after not in earlier:
        raise SweepError(f"{path}: variants.{name}.{key}: must name a variant listed above it "
                         f"({', '.join(earlier) or 'none'}; got {after!r})")
    return after


def _lr_point(path, name, ovs, sweep):
    """An lr point (`lr_of: kda, train.lr: 3e-3`): the overrides of the variant it names, at its own lr."""
    where = f"{path}: variants.{name}"
    of = _earlier_variant(path, name, ovs["lr_of"], sweep["variants"], "lr_of")
    rest = {k: v for k, v in ovs.items() if k != "lr_of"}
    if set(rest) != {"train.lr"} or not (_float(rest["train.lr"]) or 0) > 0:
        raise SweepError(f"{where}: an lr point (lr_of) sets train.lr to a positive number and nothing else "
                         f"(got {rest!r})")
    if sweep["lrs"] != [None] or of in sweep["lr_of"] or of in sweep["after"] or name in sweep["after"]:
        raise SweepError(f"{where}.lr_of: an lr point names a plain variant (not a stage or another lr point) "
                         f"in a sweep without lrs: (got {of!r})")
    lr = _float(rest["train.lr"])
    points = [of] + [p for p, o in sweep["lr_of"].items() if o == of]
    taken = [config_for(sweep, v, sweep["seeds"][0]).train.lr for v in points]
    if _lr_tag(lr) in map(_lr_tag, taken):
        raise SweepError(f"{where}: train.lr {lr:g} is already one of {of}'s lrs "
                         f"({', '.join(f'{x:g}' for x in taken)})")
    sweep["lr_of"][name] = of
    return [o for o in sweep["variants"][of] if not o.startswith("--train.lr=")] + [f"--train.lr={lr!r}"]


def _float(x):
    """A YAML number (1e-3 without a dot reads as a string) -> float, or None."""
    try:
        return None if isinstance(x, bool) else float(x)
    except (TypeError, ValueError):
        return None


def _lr_tag(lr):
    return f"{lr:.3g}"


def config_for(sweep, variant, seed, lr=None):
    """The validated Config of one run: base + common overrides + the variant's + lr, seed, out_dir."""
    raw = read_yaml(sweep["base"])
    for o in sweep.get("common", []) + sweep["variants"][variant]:
        apply_override(raw, o)
    if lr is not None:
        apply_override(raw, f"--train.lr={lr!r}")
    if variant in sweep["after"]:  # a curriculum stage starts from its earlier stage's weights
        apply_override(raw, f"--train.init_from={run_dir(sweep, sweep['after'][variant], seed, lr)}")
    apply_override(raw, f"--train.seed={seed}")
    apply_override(raw, f"--train.out_dir={run_dir(sweep, variant, seed, lr)}")
    return refuse_unused(from_raw(raw))


def run_dir(sweep, variant, seed, lr=None):
    return os.path.join(sweep["out_dir"], f"{variant}" + (f"-lr{_lr_tag(lr)}" if lr is not None else "") + f"-s{seed}")


def run_list(sweep, only=None, seeds=None):
    """(variant, lr, seed) of every run in order (only / seeds: subsets of the variant names / seeds);
    lr is None in a sweep without an lrs grid."""
    return [(v, lr, s) for v in sweep["variants"] if not only or v in only for lr in sweep["lrs"]
            for s in sweep["seeds"] if seeds is None or s in seeds]


# ----------------------------------------------------------------------------------------------
# one run


def decode_ms_per_token(model, ctx, n=32):
    """CPU wall time of one-token decode steps after a prefill of ctx tokens (batch 1)."""
    import torch
    cache = model.new_cache(1, ctx + n + 1)
    g = torch.Generator().manual_seed(0)
    model.step(torch.randint(0, model.config.vocab_size, (1, ctx), generator=g), cache)
    tok = torch.zeros(1, 1, dtype=torch.long)
    model.step(tok, cache)  # warm up
    t = time.perf_counter()
    for _ in range(n):
        model.step(tok, cache)
    return (time.perf_counter() - t) / n * 1e3


def run_one(sweep, variant, seed, stop_at=None, log=print, lr=None):
    """Train (or resume) one run, evaluate it and write result.json; returns the result, or None if
    stopped early (stop_at: simulate an interruption after that many steps) or running elsewhere (a
    `.running` file in the run folder holds the pid of the process running it)."""
    folder = run_dir(sweep, variant, seed, lr)
    done = os.path.join(folder, "result.json")
    if os.path.isfile(done):
        with open(done) as f:
            return json.load(f)
    why = stage_blocked(sweep, variant, seed, lr)
    if why:
        raise SweepError(f"[{os.path.basename(folder)}] {why}")
    cfg = config_for(sweep, variant, seed, lr)
    os.makedirs(folder, exist_ok=True)
    if not _lock(folder):
        log(f"[{os.path.basename(folder)}] skipped: another process is running it")
        return None
    try:
        return _run_locked(sweep, variant, seed, cfg, folder, done, stop_at, log)
    finally:
        os.remove(os.path.join(folder, ".running"))


def _lock(folder):
    """Claim a run folder for this process (a file holding our pid); a dead holder's claim is taken."""
    path = os.path.join(folder, ".running")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
        except FileExistsError:
            try:
                with open(path) as f:
                    pid = int(f.read() or 0)
                os.kill(pid, 0)
                if pid != os.getpid():
                    return False
            except PermissionError:  # alive, another user's
                return False
            except (ValueError, ProcessLookupError, FileNotFoundError):
                pass
            try:
                os.remove(path)  # stale: its process is gone
            except FileNotFoundError:
                pass
    return False


def _run_locked(sweep, variant, seed, cfg, folder, done, stop_at, log):
    import torch
    from sample import load_model
    from train import latest_checkpoint, load_checkpoint, target_reached, train
    ckpt, name = latest_checkpoint(folder), os.path.basename(folder)
    log(f"[{name}] " + (f"resuming from {os.path.basename(ckpt)}" if ckpt else "training") +
        f" ({' '.join(sweep['variants'][variant]) or 'base config'})")
    t0 = time.time()
    try:
        train(cfg, resume=True if ckpt else None, quiet=True, stop_at=stop_at)
    except FloatingPointError as e:  # the lr is too high: a result that loses the lr selection
        result = {"variant": variant, "seed": seed, "lr": cfg.train.lr, "overrides": sweep["variants"][variant],
                  "diverged": str(e), "final": {}, "evals": {}, "train_time_s": time.time() - t0}
        write_json(done, result)
        log(f"[{name}] diverged: {e}")
        return result
    if stop_at is not None and stop_at < cfg.train.max_steps:
        return None
    model, _ = load_model(latest_checkpoint(folder))
    metrics = read_metrics(folder)
    train_rows = [r for r in metrics if "loss" in r]
    eval_rows = [r for r in metrics if "loss" not in r]
    step = load_checkpoint(latest_checkpoint(folder))["step"]
    last = eval_rows[-1] if eval_rows else {}
    if step < cfg.train.max_steps and not (last.get("step") == step and target_reached(last, cfg.train.stop_at)):
        raise SweepStopped(f"[{name}] stopped by a signal at step {step} of {cfg.train.max_steps} (checkpoint "
                           f"saved, no result.json); rerun the same command to resume the sweep")
    tps = sorted(r["tokens_per_s"] for r in train_rows)
    result = {"variant": variant, "seed": seed, "lr": cfg.train.lr, "overrides": sweep["variants"][variant],
              "params": model.num_params(), "train_tokens_per_s": tps[len(tps) // 2] if tps else None,
              "final": eval_rows[-1] if eval_rows else {}, "train_time_s": time.time() - t0, "evals": {}}
    for ev_name, opts in sweep["evals"].items():
        t = time.time()
        try:
            result["evals"][ev_name] = evals.run_eval(ev_name, model, cfg, opts)
        except ValueError as e:  # e.g. streaming on a model without global attention
            result["evals"][ev_name] = {"skipped": str(e)}
        log(f"[{os.path.basename(folder)}] eval {ev_name}: " + (", ".join(
            f"{k} {v:.4g}" for k, v in evals.scalars(result["evals"][ev_name]).items()) or
            f"skipped: {result['evals'][ev_name].get('skipped')}") + f" ({time.time() - t:.0f}s)")
    with torch.no_grad():
        result["decode_ms_per_token"] = decode_ms_per_token(model, sweep["decode_ctx"] or cfg.train.seq_len)
    write_json(done, result)
    log(f"[{name}] done in {time.time() - t0:.0f}s: " +
        ", ".join(f"{k} {v:.4g}" for k, v in result["final"].items() if k != "step"))
    return result


def describe(result):
    """One line for a finished run: its final eval, where it stopped, or why it has no result."""
    if result is None:
        return "skipped (running in another process)"
    if result.get("diverged"):
        return "diverged"
    final = result.get("final", {})
    text = ", ".join(f"{k} {v:.4g}" for k, v in final.items() if k != "step")
    return text + (f" at step {final['step']}" if "step" in final else "")


def _job(sweep, variant, lr, seed):
    """One run in a worker process (--jobs): its own torch threads; errors come back as text."""
    import torch
    torch.set_num_threads(int(sweep["threads"]))
    try:
        return run_one(sweep, variant, seed, log=lambda m: print(m, flush=True), lr=lr), None
    except (SweepError, ConfigError, DataError, ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"


def run_sweep(sweep, stop_at=None, log=print, only=None, jobs=1, seeds=None):
    """Run every variant x lr x seed (only / seeds: a subset of the variant names / seeds). jobs > 1:
    that many runs at once, each in its own process; a curriculum stage starts once its earlier run has
    finished. A progress line per finished (or unstartable) run either way."""
    import torch
    runs = run_list(sweep, only, seeds)
    todo = [r for r in runs if not os.path.isfile(os.path.join(run_dir(sweep, r[0], r[2], r[1]), "result.json"))]
    n, t0 = len(runs), time.time()
    ended = [n - len(todo)]  # runs finished so far (a list: progress() counts up)
    if len(todo) < n:
        log(f"{n - len(todo)} of {n} runs already finished")

    def progress(run, result, error=None):
        ended[0] += 1
        name = os.path.basename(run_dir(sweep, run[0], run[2], run[1]))
        log(f"[{ended[0]}/{n}] {name}: {error or describe(result)} ({time.time() - t0:.0f}s into the sweep)")

    if jobs <= 1 or stop_at is not None:
        torch.set_num_threads(int(sweep["threads"]))
        for variant, lr, seed in todo:
            why = stage_blocked(sweep, variant, seed, lr)
            progress((variant, lr, seed), None if why else run_one(sweep, variant, seed, stop_at, log, lr=lr), why)
        return
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    pending, futures = list(todo), {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        def submit_ready():  # up to `jobs` runs at once, in list order, each once its earlier stage ended
            for run in list(pending):
                if len(futures) >= jobs:  # queue nothing: a stage that becomes ready goes before later runs
                    return
                variant, lr, seed = run
                if (sweep["after"].get(variant), lr, seed) in pending + list(futures.values()):
                    continue
                pending.remove(run)
                why = stage_blocked(sweep, variant, seed, lr)
                if why:
                    progress(run, None, why)
                else:
                    futures[pool.submit(_job, sweep, variant, lr, seed)] = run
        relay = _SignalRelay(pool)
        try:
            submit_ready()
            while futures:
                finished, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in finished:
                    run = futures.pop(fut)
                    progress(run, *fut.result())
                if relay.received:
                    raise SweepStopped
                submit_ready()
        except (KeyboardInterrupt, SweepStopped, BrokenProcessPool) as e:
            if isinstance(e, BrokenProcessPool) and not relay.received:
                raise                             # a worker died of something else than a signal we passed on
            # each worker got the signal too and saves and stops (one still starting up dies of it, and the
            # broken pool then sends the others SIGTERM, which they take as a stop as well)
            log("stopping: the running runs finish their step and save a checkpoint; no new run starts")
            pool.shutdown(wait=True, cancel_futures=True)
            raise SweepStopped("stopped by a signal: runs without result.json resume from their checkpoint; "
                               "rerun the same command to continue the sweep") from None
        finally:
            relay.restore()


class _SignalRelay:
    """SIGTERM / SIGUSR1 sent to the sweep's process alone (`kill PID`, a job scheduler), while `pool` runs:
    passed on to its worker processes, whose runs then finish their step, save and stop (train.StopSignal),
    and `received` lists it, so that no new run starts. Ctrl-C reaches the workers itself (one process group).
    Without this the parent died at once and its workers trained on to the end, then hung."""

    def __init__(self, pool):
        self.pool, self.received, self.old = pool, [], {}
        for s in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self.old[s] = signal.signal(s, self.pass_on)
            except ValueError:  # not the main thread: no handlers
                pass

    def pass_on(self, signum, frame):
        self.received.append(signum)
        for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:  # it has just exited
                pass

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)


def stage_blocked(sweep, variant, seed, lr=None):
    """Why a curriculum stage's run cannot start (its earlier stage's run has no usable result), or None:
    not a stage, a usable earlier run, or a run already started (it resumes from its own checkpoint)."""
    from train import latest_checkpoint
    after = sweep["after"].get(variant)
    if after is None or latest_checkpoint(run_dir(sweep, variant, seed, lr)):
        return None
    earlier = run_dir(sweep, after, seed, lr)
    done = os.path.join(earlier, "result.json")
    if not os.path.isfile(done):
        return (f"not started: it starts from {os.path.basename(earlier)}, which has not finished (no "
                f"result.json); run that first (--only {after})")
    with open(done) as f:
        if json.load(f).get("diverged"):
            return f"not started: it starts from {os.path.basename(earlier)}, which diverged"
    return None


# ----------------------------------------------------------------------------------------------
# the report


def mean(xs):
    """Mean of the non-missing values (None and NaN skipped); None when there are none."""
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _fmt(x, digits=3):
    if x is None:
        return "–"
    if isinstance(x, int) or (isinstance(x, float) and abs(x) >= 1000):
        return cost.human(x)
    return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{digits + 1}g}"


def collect(sweep):
    """{variant: [result of every finished run, all lrs and seeds]}."""
    out = {}
    for variant, lr, seed in run_list(sweep):
        path = os.path.join(run_dir(sweep, variant, seed, lr), "result.json")
        if os.path.isfile(path):
            with open(path) as f:
                out.setdefault(variant, []).append(json.load(f))
    return out


def result_dir(sweep, result):
    return run_dir(sweep, result["variant"], result["seed"], result["lr"] if sweep["lrs"] != [None] else None)


def std(xs):
    """Sample standard deviation (0 for a single value)."""
    xs = [x for x in xs if x is not None]
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0 if xs else None


def select_metric(sweep, results):
    """(name, higher_is_better) of the metric that picks the best lr: the sweep's `select`, else
    val_acc when runs report it, else val_loss."""
    name = sweep.get("select") or ("val_acc" if any("val_acc" in r["final"] for rs in results.values()
                                                    for r in rs) else "val_loss")
    return name, higher_is_better(name)


def by_lr(results):
    """{lr: [results]} in lr order."""
    out = {}
    for r in sorted(results, key=lambda r: r.get("lr") or 0):
        out.setdefault(r.get("lr"), []).append(r)
    return out


def best_lr(sweep, rs, metric):
    """The lr whose runs have the best mean `metric` over the seeds that every lr finished (over all
    of each lr's seeds when none is common; diverged runs count as the worst); ties go to the lr whose
    runs ended first (early stopping), then the smaller lr. -> (lr, all its results)."""
    name, higher = metric
    groups = by_lr(rs)
    common = set.intersection(*({r["seed"] for r in g} for g in groups.values()))

    def score(group):
        group = [r for r in group if r["seed"] in common] or group
        vals = [r["final"].get(name) for r in group]
        if any(v is None or not math.isfinite(v) for v in vals):  # diverged, never evaluated, or a NaN / inf eval
            return (-math.inf, 0)
        m = mean(vals)
        return (m if higher else -m, -mean([r["final"].get("step", 0) for r in group]))
    lr = max(groups, key=lambda k: (score(groups[k]), -(k or 0)))
    return lr, groups[lr]


def with_lr_points(sweep, results):
    """collect()'s {variant: results} with each lr point's runs moved into its variant's (lr_of)."""
    out = {}
    for v, rs in results.items():
        out.setdefault(sweep["lr_of"].get(v, v), []).extend(rs)
    return out


def best_runs(sweep, only=None, results=None):
    """({variant: (best lr, the runs at that lr)}, selection metric) over the finished runs of the variants
    in `only` (all if None; an lr point counts in its variant's row when it is in `only` too; `results`:
    collect()'s, possibly rescored, instead of reading them again); a one-line DataError when there are none."""
    results = {v: rs for v, rs in (collect(sweep) if results is None else results).items() if not only or v in only}
    results = with_lr_points(sweep, results)
    if not results:
        raise DataError(f"{sweep['out_dir']}: no finished run (result.json) yet")
    metric = select_metric(sweep, results)
    return {v: best_lr(sweep, rs, metric) for v, rs in results.items()}, metric


def mean_pm(xs):
    """'mean ± sample std' of the non-missing values."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return _fmt(mean(xs)) + (f" ± {_fmt(std(xs), 2)}" if len(xs) > 1 else "")


def lr_table(sweep, results, metric):
    """Every variant x lr: the selection metric, mean ± std over seeds (diverged runs marked)."""
    lrs = sorted({r.get("lr") for rs in results.values() for r in rs})
    lines = ["| variant | " + " | ".join(f"lr {_lr_tag(lr)}" for lr in lrs) + " |", "|" + "---|" * (len(lrs) + 1)]
    for variant, rs in results.items():
        groups, cells = by_lr(rs), []
        for lr in lrs:
            g = groups.get(lr, [])
            n_div = sum(1 for r in g if r.get("diverged"))
            cell = mean_pm([r["final"].get(metric[0]) for r in g if not r.get("diverged")]) if g else "–"
            cells.append(cell + (f" ({n_div} diverged)" if n_div else "") + (f" (n={len(g)})" if g else ""))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_table(sweep, results, metric=None):
    """The markdown table: one row per variant (mean over its finished seeds; results at one lr)."""
    results = {v: [r for r in rs if not r.get("diverged")] for v, rs in results.items()}
    results = {v: rs for v, rs in results.items() if rs}
    eval_cols = []
    for rs in results.values():
        for r in rs:
            for name, res in r["evals"].items():
                for k in evals.scalars(res):
                    if (name, k) not in eval_cols:
                        eval_cols.append((name, k))
    final_cols = []
    for rs in results.values():
        for k in rs[0]["final"]:
            if k != "step" and k not in final_cols:
                final_cols.append(k)
    lr_cols = ["lr", f"{metric[0]} (mean ± std)", "steps"] if metric else []
    head = ["variant", "seeds"] + lr_cols + ["params", "train tok/s"] + [f"final {k}" for k in final_cols] + \
        [f"{n} {k}" for n, k in eval_cols] + [f"cache @{cost.ctx_label(L)}" for L in CONTEXTS] + ["decode ms/tok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, rs in results.items():
        cfg = config_for(sweep, variant, rs[0]["seed"])
        cells = [variant, str(len(rs))]
        if metric:
            cells += [f"{rs[0]['lr']:.3g}", mean_pm([r["final"].get(metric[0]) for r in rs]),
                      _fmt(mean([r["final"].get("step") for r in rs]))]
        cells += [cost.human(rs[0]["params"]),
                 cost.human(mean([r["train_tokens_per_s"] for r in rs]) or 0)]
        cells += [_fmt(mean([r["final"].get(k) for r in rs])) for k in final_cols]
        cells += [_fmt(mean([r["evals"].get(n, {}).get(k) for r in rs])) for n, k in eval_cols]
        cells += [cost.human(cost.cache_bytes(cfg.model, L), "B") for L in CONTEXTS]
        cells += [_fmt(mean([r["decode_ms_per_token"] for r in rs]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def make_plots(sweep, results):
    """PNG plots in the sweep folder; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out, made = sweep["out_dir"], []
    # training loss and the eval metric over steps (plot.py, also for single runs)
    loss_curves({variant: read_metrics(result_dir(sweep, rs[0])) for variant, rs in results.items()},
                os.path.join(out, "loss_curves.png"))
    made.append("loss_curves.png")
    for name, draw in [("acc_by_distance.png", _plot_acc_by_distance), ("cache_bytes.png", _plot_cache_bytes),
                       ("loss_by_position.png", _plot_loss_by_position)]:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        try:
            if not draw(ax, sweep, results):                      # nothing to plot for this sweep
                continue
            ax.legend(fontsize=8)
            fig.tight_layout()
            # atomically: an interrupted report never leaves a torn file
            atomic_write(os.path.join(out, name), lambda f: fig.savefig(f, dpi=80, format="png"))
            made.append(name)
        finally:
            plt.close(fig)
    return made


def _plot_acc_by_distance(ax, sweep, results):
    """MQAR accuracy by recall distance, one line per variant (its first seed); False without MQAR evals."""
    markers, drawn = "osD^vP*Xh<>", False
    for i, (variant, rs) in enumerate(results.items()):
        rows = rs[0]["evals"].get("mqar", {}).get("by_distance")
        if rows:  # shrinking markers keep overlapping lines (all at 1.0, say) visible
            ax.plot([math.sqrt(r["lo"] * r["hi"]) for r in rows], [r["acc"] for r in rows],
                    marker=markers[i % len(markers)], markersize=max(3, 10 - i), label=variant)
            drawn = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance key -> query (tokens, power-of-two buckets)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    return drawn


def _plot_cache_bytes(ax, sweep, results):
    """Decode cache bytes against context, log-log, from the cost model."""
    Ls = [2 ** i for i in range(8, 21)]
    for variant, rs in results.items():
        cfg = config_for(sweep, variant, rs[0]["seed"])
        ax.plot(Ls, [cost.cache_bytes(cfg.model, L) for L in Ls], marker=".", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode cache bytes (bf16, batch 1)")
    ax.grid(alpha=0.3, which="both")
    return True


def _plot_loss_by_position(ax, sweep, results):
    """Loss by position (length extrapolation), dashed at the training length; False without length evals."""
    T = None
    for variant, rs in results.items():
        rows = rs[0]["evals"].get("length", {}).get("by_position")
        if rows:
            ax.plot([(r["lo"] + r["hi"]) / 2 for r in rows], [r["loss"] for r in rows], marker=".", label=variant)
            T = config_for(sweep, variant, rs[0]["seed"]).train.seq_len
    if T:
        ax.axvline(T, color="gray", ls="--", lw=1)
    ax.set_xlabel("position (dashed: training length)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    return T is not None


def _per_variant(cfgs, field, fmt):
    """A train field across the variants' configs: the most common value, then the exceptions,
    e.g. "1500 (swa32: 400)"."""
    values = {v: getattr(c, field) for v, c in cfgs.items()}
    common = max(set(values.values()), key=list(values.values()).count)
    others = ", ".join(f"{v}: {fmt.format(x)}" for v, x in values.items() if x != common)
    return fmt.format(common) + (f" ({others})" if others else "")


def _lr_points(sweep):
    """The lr_of variants' lrs, e.g. "kda at 0.0003, 0.001, 0.003 (kda_lr3e4, kda, kda_lr3e3)"."""
    out = []
    for v in dict.fromkeys(sweep["lr_of"].values()):
        points = [v] + [p for p, of in sweep["lr_of"].items() if of == v]
        lr = {n: config_for(sweep, n, sweep["seeds"][0]).train.lr for n in points}
        names = sorted(lr, key=lr.get)
        out.append(f"{v} at {', '.join(_lr_tag(lr[n]) for n in names)} ({', '.join(names)})")
    return "; ".join(out)


def write_report(sweep):
    every = with_lr_points(sweep, collect(sweep))
    if not every:
        return None
    metric = select_metric(sweep, every)
    grid = sweep["lrs"] != [None] or bool(sweep["lr_of"])
    results = {v: best_lr(sweep, rs, metric)[1] for v, rs in every.items()} if grid else every
    plots = make_plots(sweep, {v: rs for v, rs in results.items() if not rs[0].get("diverged")})
    cfgs = {v: config_for(sweep, v, rs[0]["seed"]).train for v, rs in results.items()}
    tc = next(iter(cfgs.values()))
    best = f", each variant at its best lr by mean final {metric[0]} over the seeds all its lrs finished"
    lrs = (f"lr grid {[float(_lr_tag(x)) for x in sweep['lrs']]}{best}" if sweep["lrs"] != [None] else
           f"lr {_per_variant(cfgs, 'lr', '{:g}')}" + (f"; lr points: {_lr_points(sweep)}{best}" if grid else ""))
    stop = f"; early stop at {tc.stop_at}" if tc.stop_at else ""
    lines = [f"# Sweep {os.path.basename(sweep['path'])}", "", sweep["description"].strip(), "",
             f"Base `{os.path.relpath(sweep['base'], ROOT)}`; seeds {sweep['seeds']}; "
             f"{_per_variant(cfgs, 'max_steps', '{}')} steps x {tc.batch_size} x {tc.seq_len} tokens, {lrs}{stop}. "
             "Cache bytes: analytic (cost.py), bf16, batch 1. decode ms/tok: CPU, batch 1, at context "
             f"{sweep['decode_ctx'] or tc.seq_len}. Seeds averaged.", "",
             results_table(sweep, results, metric if grid else None), ""]
    if grid:
        lines += [f"Final {metric[0]} at every lr (mean ± sample std over seeds; n = finished runs):", "",
                  lr_table(sweep, every, metric), ""]
    lines += ["Variants:", ""]
    for v, ovs in sweep["variants"].items():
        after = sweep["after"].get(v)
        lines.append(f"- `{v}`: {' '.join(f'`{o}`' for o in ovs) or 'the base config'}" +
                     (f"; starts from `{after}`'s weights (same seed)" if after else "") +
                     (f"; an lr point of `{sweep['lr_of'][v]}` (in its row)" if v in sweep["lr_of"] else ""))
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    path = os.path.join(sweep["out_dir"], "results.md")
    atomic_write(path, lambda f: f.write("\n".join(lines)), mode="w")
    return path


def _chosen(text, allowed, what, flag, path, cast=str):
    """--only "a,b" / --seeds "0,2" -> the listed items, each one of `allowed` (the sweep's variants or
    seeds; `what` names them); None (all) when the flag is not given."""
    if text is None:
        return None
    try:
        items = [cast(x) for x in text.split(",")]
    except ValueError:
        raise SweepError(f"{flag}: must be comma-separated integers (got {text!r})") from None
    for x in items:
        if x not in allowed:
            raise SweepError(f"{flag}: {x!r} is not a {what} of {path} ({', '.join(map(str, allowed))})")
    return items


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (YAML)")
    p.add_argument("--report", action="store_true", help="only collect finished runs into the report")
    p.add_argument("--dry_run", action="store_true", help="check the sweep file and list the runs")
    p.add_argument("--out_dir", default=None, help="override the sweep folder")
    p.add_argument("--only", default=None, help="comma-separated variants to run (e.g. to split a sweep over "
                   "two processes; finish with --report)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds of the sweep to run (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process each (default 1; "
                   f"this machine has {os.cpu_count()} cores)")
    args = p.parse_args(argv)
    try:
        sweep = load_sweep(args.sweep)
        if args.out_dir:
            sweep["out_dir"] = args.out_dir
        only = _chosen(args.only or None, list(sweep["variants"]), "variant", "--only", args.sweep)
        seeds = _chosen(args.seeds, sweep["seeds"], "seed", "--seeds", args.sweep, cast=int)
        if args.dry_run:
            try:
                for v, lr, s in run_list(sweep, only, seeds):
                    after = sweep["after"].get(v)
                    print(run_dir(sweep, v, s, lr), " ".join(sweep["variants"][v]) +
                          (f" (starts from {run_dir(sweep, after, s, lr)})" if after else ""), flush=True)
            except BrokenPipeError:  # `--dry_run | head`: the reader has what it wanted
                sys.stdout = open(os.devnull, "w")
            return 0
        if args.jobs < 1:
            raise SweepError(f"--jobs: must be an integer >= 1 (got {args.jobs})")
        if not args.report:
            check_writable(sweep["out_dir"], "--out_dir" if args.out_dir else f"{args.sweep}: out_dir", "folder")
            os.makedirs(sweep["out_dir"], exist_ok=True)
            busy = args.jobs * sweep["threads"]
            if busy > (os.cpu_count() or 1):  # threads that spin for cores slow every run far more than their share
                print(f"note: --jobs {args.jobs} x threads {sweep['threads']} = {busy} torch threads on "
                      f"{os.cpu_count()} cores: the runs will slow each other down; use at most that many", flush=True)
            run_sweep(sweep, log=lambda m: print(m, flush=True), only=only, jobs=args.jobs, seeds=seeds)
        path = write_report(sweep)
    except (SweepError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SweepStopped as e:  # like train.py: the step finished, a checkpoint was saved, exit 0
        print(e)
        return 0
    print(f"report: {path}" if path else "no finished runs yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
