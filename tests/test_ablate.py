"""ablate.py: sweep-file errors, a tiny sweep end to end, resume after an interruption."""
import json
import os
import re
import subprocess
import sys

import pytest

import ablate
from config import ROOT

BASE = """
model:
  vocab_size: 24
  d_model: 32
  n_layer: 2
  pattern: [attn]
  layers:
    attn: {kind: attn, n_heads: 2}
    kda: {kind: kda, n_heads: 2}
  mlp: {hidden: 64}
data: {kind: mqar, n_pairs: 3}
train: {max_steps: 12, batch_size: 4, seq_len: 24, lr: 1.0e-3, warmup_steps: 2, log_interval: 4,
        eval_interval: 6, eval_batches: 1, ckpt_interval: 6, device: cpu}
"""


def write_sweep(tmp_path, body):
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "sweep.yaml"
    path.write_text(body.replace("OUT", str(tmp_path / "out")))
    return str(path)


SWEEP = """
base: base.yaml
out_dir: OUT
seeds: [0]
variants:
  attn: {}
  hybrid: {model.pattern: [kda, attn]}
evals:
  mqar: {n_batches: 1, batch_size: 4}
  needle: {factors: [2], depths: [0.5], n_trials: 2}
  length: {factor: 2, n_seqs: 2}
  streaming: {factor: 1, budget: 8, n_seqs: 1}
"""


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "ablate.py"), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("body,message", [
    (SWEEP + "colour: red\n", "colour: unknown key"),
    (SWEEP.replace("base: base.yaml", "base: missing.yaml"), "base: config file 'missing.yaml' not found"),
    (SWEEP.replace("base: base.yaml\n", ""), "base: required key is missing"),
    (SWEEP.replace("hybrid: {model.pattern: [kda, attn]}", "bad: {model.layers.attn.windw: 3}"),
     "variants.bad: model.layers.attn.windw: unknown key"),
    (SWEEP.replace("hybrid: {model.pattern: [kda, attn]}", "bad: [model.n_layer]"), "variants.bad: bad override"),
    (SWEEP.replace("hybrid: {model.pattern: [kda, attn]}", "bad: {model.pattern: [nope]}"),
     "variants.bad: model.pattern[0]"),
    (SWEEP.replace("length:", "lenght:"), "evals.lenght: unknown eval"),
    (SWEEP.replace("n_trials: 2", "n_trails: 2"), "evals.needle.n_trails: unknown option"),
    (SWEEP.replace("seeds: [0]", "seeds: zero"), "seeds: must be a non-empty list"),
])
def test_bad_sweep_files_are_one_line_errors(tmp_path, capsys, body, message):
    assert ablate.main([write_sweep(tmp_path, body), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_dry_run_lists_only_the_chosen_variants(tmp_path, capsys):
    path = write_sweep(tmp_path, SWEEP)
    assert ablate.main([path, "--dry_run", "--only", "hybrid"]) == 0
    listed = [os.path.basename(line.split()[0]) for line in capsys.readouterr().out.splitlines()]
    assert listed == ["hybrid-s0"]
    assert ablate.main([path, "--dry_run", "--only", "hybird"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: 'hybird' is not a variant") and len(err.strip().splitlines()) == 1


def test_cli_exit_code_and_help(tmp_path):
    r = run_cli(write_sweep(tmp_path, SWEEP + "colour: red\n"), "--dry_run")
    assert r.returncode == 2 and "colour: unknown key" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--help")
    assert r.returncode == 0 and "sweep file" in r.stdout
    r = subprocess.run(f"{sys.executable} {os.path.join(ROOT, 'ablate.py')} {write_sweep(tmp_path, GRID.replace('seeds: [0, 1]', f'seeds: {list(range(1500))}'))} --dry_run | head -1",
                       shell=True, capture_output=True, text=True, timeout=120)      # 6000 lines; the reader stops at 1
    assert r.stdout.count("\n") == 1 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_sweep_runs_resumes_and_reports(tmp_path):
    sweep = ablate.load_sweep(write_sweep(tmp_path, SWEEP))
    logs = []
    # an interrupted sweep: the first run stops after 6 of 12 steps (its checkpoint is written)
    assert ablate.run_one(sweep, "attn", 0, stop_at=6, log=logs.append) is None
    folder = tmp_path / "out" / "attn-s0"
    assert (folder / "ckpt_6.pt").exists() and not (folder / "result.json").exists()
    ablate.run_sweep(sweep, log=logs.append)
    assert any("[attn-s0] resuming from ckpt_6.pt" in m for m in logs)
    assert any("[hybrid-s0] training" in m for m in logs)
    result = json.loads((folder / "result.json").read_text())
    assert result["final"]["step"] == 12 and result["params"] > 0 and result["decode_ms_per_token"] > 0
    assert {"mqar", "needle", "length", "streaming"} <= set(result["evals"])
    steps = [r["step"] for r in ablate.read_metrics(str(folder)) if "loss" in r]
    assert steps == [4, 8, 12]                       # resumed lines replace the re-logged ones
    # a run claimed by a live process is left alone; a stale claim is taken over
    hyb = tmp_path / "out" / "hybrid-s0"
    (hyb / "result.json").rename(hyb / "r.json")
    (hyb / ".running").write_text("1")                       # pid 1 is alive
    assert ablate.run_one(sweep, "hybrid", 0, log=logs.append) is None and "another process" in logs[-1]
    (hyb / ".running").write_text("999999999")               # no such process
    (hyb / "r.json").rename(hyb / "result.json")
    assert ablate._lock(str(hyb)) and not (hyb / ".running").read_text() == "999999999"
    os.remove(hyb / ".running")
    # a finished sweep is skipped entirely
    logs.clear()
    ablate.run_sweep(sweep, log=logs.append)
    assert logs == ["2 of 2 runs already finished"]
    path = ablate.write_report(sweep)
    text = open(path).read()
    assert "| attn | 1 |" in text and "| hybrid | 1 |" in text and "mqar acc" in text and "cache @1M" in text
    for png in ("loss_curves.png", "acc_by_distance.png", "cache_bytes.png", "loss_by_position.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000
    assert ablate.main([sweep["path"], "--report"]) == 0


GRID = SWEEP.replace("seeds: [0]", "seeds: [0, 1]\nlrs: [1.0e-3, 3e-3]\nstop_at: {val_loss: 100}").replace(
    "  hybrid: {model.pattern: [kda, attn]}\n", "").split("evals:")[0] + "evals:\n  mqar: {n_batches: 1, batch_size: 4}\n"


@pytest.mark.parametrize("body,message", [
    (GRID.replace("lrs: [1.0e-3, 3e-3]", "lrs: [0.001, -1]"), "lrs: must be a non-empty list of distinct positive"),
    (GRID.replace("lrs: [1.0e-3, 3e-3]", "lrs: 1e-3"), "lrs: must be a non-empty list"),
    (GRID.replace("lrs: [1.0e-3, 3e-3]", "lrs: [1e-3, 0.001]"), "lrs: must be a non-empty list of distinct"),
    (GRID.replace("stop_at: {val_loss: 100}", "stop_at: {val_accuracy: 0.99}"), "train.stop_at.val_accuracy: must be one of"),
    (GRID.replace("stop_at: {val_loss: 100}", "stop_at: 0.99"), "stop_at: must be a mapping"),
    (GRID + "select: acc\n", "select: must be one of val_acc"),
])
def test_bad_grid_sweeps_are_one_line_errors(tmp_path, capsys, body, message):
    assert ablate.main([write_sweep(tmp_path, body), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_lr_grid_seeds_early_stop_and_parallel_jobs(tmp_path, capsys):
    path = write_sweep(tmp_path, GRID)
    assert ablate.main([path, "--dry_run"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert [os.path.basename(p) for p in listed] == ["attn-lr0.001-s0", "attn-lr0.001-s1", "attn-lr0.003-s0",
                                                     "attn-lr0.003-s1"]
    sweep = ablate.load_sweep(path)
    assert ablate.config_for(sweep, "attn", 1, 3e-3).train.lr == 3e-3
    logs = []
    ablate.run_sweep(sweep, log=logs.append, jobs=2)        # 4 runs, 2 processes at a time
    progress = [m for m in logs if m.startswith("[") and "/4]" in m]
    assert len(progress) == 4 and all("at step 6" in m for m in progress)   # stopped at the first eval
    for name in listed:
        r = json.loads(open(os.path.join(name, "result.json")).read())
        assert r["final"]["step"] == 6 and r["lr"] in (1e-3, 3e-3) and os.path.isfile(os.path.join(name, "ckpt_6.pt"))
    text = open(ablate.write_report(sweep)).read()
    assert "lr grid [0.001, 0.003]" in text and "early stop at {'val_loss': 100}" in text
    assert "| variant | lr 0.001 | lr 0.003 |" in text and "(n=2)" in text and " ± " in text
    logs.clear()
    ablate.run_sweep(sweep, log=logs.append, jobs=2)
    assert logs == ["4 of 4 runs already finished"]


def test_best_lr_is_the_best_mean_over_seeds():
    def res(lr, acc, step=100, seed=0, diverged=False):
        return {"variant": "v", "seed": seed, "lr": lr, "final": {} if diverged else {"val_acc": acc, "step": step},
                **({"diverged": "nan"} if diverged else {})}
    metric = ("val_acc", True)
    rs = [res(1e-3, 0.9), res(1e-3, 0.5, seed=1), res(1e-2, 0.7), res(1e-2, 0.71, seed=1), res(1e-1, 0, diverged=True),
          res(1e-1, 0, seed=1, diverged=True)]
    assert ablate.best_lr({}, rs, metric)[0] == 1e-2            # mean 0.705 beats 0.7
    rs += [res(3e-3, 1.0, step=500), res(3e-3, 1.0, step=500, seed=1), res(1e-4, 1.0, step=250),
           res(1e-4, 1.0, step=250, seed=1)]
    lr, group = ablate.best_lr({}, rs, metric)
    assert lr == 1e-4 and len(group) == 2                       # a tie at 1.0 goes to the faster one
    assert ablate.best_lr({}, [res(1e-3, 0.2), res(1e-2, 0, diverged=True)], ("val_loss", False))[0] == 1e-3
    # a run that finished with a NaN or infinite eval (its training loss stayed finite) loses too: the mean of
    # the rest of its lr's seeds (0.9 here) used to win
    for bad in (float("nan"), float("inf"), -float("inf")):
        rs = [res(1e-3, 0.5), res(1e-3, 0.5, seed=1), res(1e-2, 0.9), res(1e-2, bad, seed=1)]
        assert ablate.best_lr({}, rs, metric)[0] == 1e-3
    assert ablate.mean_pm([1.0, 0.5]) == "0.75 ± 0.35" and ablate.mean_pm([None]) == "–"
    # lrs that finished different seeds compare on the seeds they share: seed 0 picks 1e-3 (0.9 > 0.8),
    # though 1e-2's mean over its seeds 0 and 2 (0.825) beats 1e-3's over 0 and 1 (0.7); the pick keeps all its seeds
    rs = [res(1e-3, 0.9), res(1e-3, 0.5, seed=1), res(1e-2, 0.8), res(1e-2, 0.85, seed=2), res(3e-2, 0.3)]
    lr, group = ablate.best_lr({}, rs, metric)
    assert lr == 1e-3 and [r["seed"] for r in group] == [0, 1]
    # no seed in common: each lr's mean over its own seeds
    assert ablate.best_lr({}, [res(1e-3, 0.9), res(1e-2, 0.95, seed=1), res(1e-2, 0.99, seed=2)], metric)[0] == 1e-2



def test_report_header_names_the_variants_that_differ():
    """The report's header gives the common steps / lr and the variants that override them, not the
    first variant's values (a sweep with swa32: max_steps 400 used to print '400 steps' for all)."""
    from types import SimpleNamespace as NS
    cfgs = {"swa32": NS(max_steps=400, lr=1e-3), "attn": NS(max_steps=1500, lr=1e-3),
            "kda": NS(max_steps=1500, lr=1e-3), "hybrid": NS(max_steps=1500, lr=3e-3)}
    assert ablate._per_variant(cfgs, "max_steps", "{}") == "1500 (swa32: 400)"
    assert ablate._per_variant(cfgs, "lr", "{:g}") == "0.001 (hybrid: 0.003)"
    assert ablate._per_variant({"a": NS(lr=1e-3)}, "lr", "{:g}") == "0.001"


LR_POINTS = GRID.replace("lrs: [1.0e-3, 3e-3]\n", "").replace(
    "  attn: {}\n", "  attn: {}\n  attn_lr3e3: {lr_of: attn, train.lr: 3.0e-3}\n  other: {train.max_steps: 6}\n")


@pytest.mark.parametrize("body,message", [
    (LR_POINTS.replace("lr_of: attn,", "lr_of: other,"), "variants.attn_lr3e3.lr_of: must name a variant listed above it"),
    (LR_POINTS.replace("train.lr: 3.0e-3}", "train.lr: 3.0e-3, train.max_steps: 6}"),
     "variants.attn_lr3e3: an lr point (lr_of) sets train.lr to a positive number and nothing else"),
    (LR_POINTS.replace("train.lr: 3.0e-3}", "train.lr: fast}"), "sets train.lr to a positive number"),
    (LR_POINTS.replace("train.lr: 3.0e-3}", "train.lr: 1.0e-3}"), "train.lr 0.001 is already one of attn's lrs (0.001)"),
    (LR_POINTS.replace("seeds: [0, 1]", "seeds: [0, 1]\nlrs: [1.0e-3, 3e-3]"), "variants.attn_lr3e3.lr_of: an lr point names"),
    (LR_POINTS.replace("evals:", "  again: {lr_of: attn_lr3e3, train.lr: 1.0e-2}\nevals:"), "variants.again.lr_of: an lr point names a plain"),
    (LR_POINTS.replace("  attn: {}\n", "  attn: {}\n  long: {after: attn, train.seq_len: 48}\n").replace(
        "lr_of: attn,", "lr_of: long,"), "variants.attn_lr3e3.lr_of: an lr point names a plain variant"),
])
def test_bad_lr_points_are_one_line_errors(tmp_path, capsys, body, message):
    assert ablate.main([write_sweep(tmp_path, body), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_lr_points_run_as_variants_and_report_in_their_variants_row(tmp_path, capsys):
    path = write_sweep(tmp_path, LR_POINTS)
    assert ablate.main([path, "--dry_run", "--seeds", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [os.path.basename(line.split()[0]) for line in lines] == ["attn-s0", "attn_lr3e3-s0", "other-s0"]
    sweep = ablate.load_sweep(path)
    assert ablate.config_for(sweep, "attn_lr3e3", 0).train.lr == 3e-3 and ablate.config_for(sweep, "attn", 0).train.lr == 1e-3
    ablate.run_sweep(sweep, log=lambda m: None, only=["attn", "attn_lr3e3"])   # 4 runs of 6 steps (stop_at)
    ablate.run_sweep(sweep, log=lambda m: None, only=["other"], seeds=[0])
    rows = {v: [r["lr"] for r in rs] for v, rs in ablate.collect(sweep).items()}
    assert rows == {"attn": [1e-3, 1e-3], "attn_lr3e3": [3e-3, 3e-3], "other": [1e-3]}
    best, metric = ablate.best_runs(sweep)
    assert set(best) == {"attn", "other"} and metric == ("val_acc", True)
    accs = {lr: ablate.mean([r["final"]["val_acc"] for r in rs]) for lr, rs in ablate.by_lr(
        ablate.collect(sweep)["attn"] + ablate.collect(sweep)["attn_lr3e3"]).items()}
    assert best["attn"][0] == max(sorted(accs), key=accs.get) and len(best["attn"][1]) == 2   # ties: smaller lr
    assert ablate.best_runs(sweep, only=["attn"])[0]["attn"][0] == 1e-3     # without its lr point: one lr
    text = open(ablate.write_report(sweep)).read()
    assert "lr points: attn at 0.001, 0.003 (attn, attn_lr3e3)" in text and "| attn_lr3e3 |" not in text
    assert "| variant | lr 0.001 | lr 0.003 |" in text and "| other | 0.001 | 1 (n=1)" not in text
    assert re.search(r"\| attn \| 2 \| 0\.00[13] \|", text) and "| other | 1 | 0.001 |" in text
    assert "- `attn_lr3e3`: `--train.lr=0.003`; an lr point of `attn` (in its row)" in text


def test_dry_run_lists_only_the_chosen_seeds(tmp_path, capsys):
    path = write_sweep(tmp_path, GRID)
    assert ablate.main([path, "--dry_run", "--seeds", "1"]) == 0
    listed = [os.path.basename(line.split()[0]) for line in capsys.readouterr().out.splitlines()]
    assert listed and all(name.endswith("-s1") for name in listed) and len(listed) == len(ablate.run_list(ablate.load_sweep(path))) // 2
    for bad, message in (("2", "--seeds: 2 is not a seed of"), ("0,x", "--seeds: must be comma-separated integers")):
        assert ablate.main([path, "--dry_run", "--seeds", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1


CURRICULUM = SWEEP.replace("seeds: [0]", "seeds: [0, 1]").replace(
    "  hybrid: {model.pattern: [kda, attn]}\n",
    "  long: {after: attn, train.seq_len: 48, data.n_pairs: 6, train.max_steps: 6}\n"
    "  other: {train.max_steps: 6}\n").split("evals:")[0] + \
    "evals:\n  mqar: {n_batches: 1, batch_size: 4}\n"


@pytest.mark.parametrize("after", ["long", "nope", "[attn]"])
def test_a_stage_must_come_after_a_listed_variant(tmp_path, capsys, after):
    body = CURRICULUM.replace("after: attn", f"after: {after}")
    assert ablate.main([write_sweep(tmp_path, body), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "variants.long.after: must name a variant listed above it (attn;" in err
    assert len(err.strip().splitlines()) == 1


def test_curriculum_stage_starts_from_its_earlier_run(tmp_path, capsys):
    import torch
    path = write_sweep(tmp_path, CURRICULUM)
    assert ablate.main([path, "--dry_run", "--only", "long", "--seeds", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"(starts from {tmp_path / 'out' / 'attn-s1'})")
    sweep = ablate.load_sweep(path)
    assert ablate.config_for(sweep, "long", 1).train.init_from == str(tmp_path / "out" / "attn-s1")
    assert ablate.config_for(sweep, "attn", 1).train.init_from is None
    # the stage alone: its earlier runs have not run, so nothing starts, and each run says why
    logs = []
    ablate.run_sweep(sweep, log=logs.append, only=["long"], jobs=2)
    assert len(logs) == 2 and all("not started: it starts from attn-s" in m and "(--only attn)" in m for m in logs)
    assert not (tmp_path / "out" / "long-s0").exists()
    with pytest.raises(ablate.SweepError, match=r"\[long-s0\] not started"):
        ablate.run_one(sweep, "long", 0)
    # the whole sweep with 2 processes: each stage's run waits for its earlier run, then starts from its
    # weights, ahead of the runs listed after it (nothing is queued beyond the 2 running: `other` starts
    # only when a slot frees after both `attn` runs, and a ready `long` takes that slot first)
    logs.clear()
    ablate.run_sweep(sweep, log=logs.append, jobs=2)
    order = [m.split("] ")[1].split(":")[0] for m in logs]
    assert sorted(order) == ["attn-s0", "attn-s1", "long-s0", "long-s1", "other-s0", "other-s1"]
    assert all(order.index(f"attn-s{s}") < order.index(f"long-s{s}") for s in (0, 1))
    assert min(order.index("long-s0"), order.index("long-s1")) < min(order.index("other-s0"), order.index("other-s1"))
    for s in (0, 1):
        stage = json.loads((tmp_path / "out" / f"long-s{s}" / "result.json").read_text())
        assert stage["final"]["step"] == 6                                 # a fresh run: its own 6 steps
    report = open(ablate.write_report(sweep)).read()
    assert re.search(r"\n- `long`: `--train.seq_len=48`[^\n]*; starts from `attn`'s weights \(same seed\)\n", report)
    # the stage's step 0 is the earlier run's end: one more run of the stage from the same weights, one step
    # at lr 1e-12 (AdamW moves each weight by about the lr), holds the weights of attn-s0's last checkpoint
    from train import latest_checkpoint, load_checkpoint, train
    cfg = ablate.config_for(sweep, "long", 0)
    cfg.train.out_dir, cfg.train.max_steps, cfg.train.ckpt_interval = str(tmp_path / "check"), 1, 1
    cfg.train.lr, cfg.train.warmup_steps = 1e-12, 0
    train(cfg, quiet=True)
    start = load_checkpoint(latest_checkpoint(str(tmp_path / "check")))["model"]
    end = load_checkpoint(latest_checkpoint(str(tmp_path / "out" / "attn-s0")))["model"]
    assert start.keys() == end.keys() and all(torch.allclose(start[k], end[k], rtol=0, atol=1e-9) for k in start)


def test_every_shipped_sweep_file_checks(capsys):
    """Each sweep in sweeps/ (a file with variants; the others are their base configs) loads, and every
    run's config builds (--dry_run), so a README command never starts with an error."""
    import yaml
    folder = os.path.join(ROOT, "sweeps")
    sweeps = sorted(f for f in os.listdir(folder) if f.endswith(".yaml")
                    and "variants" in (yaml.safe_load(open(os.path.join(folder, f))) or {}))
    assert len(sweeps) >= 10
    for name in sweeps:
        assert ablate.main([os.path.join(folder, name), "--dry_run"]) == 0, (name, capsys.readouterr().err)
        assert capsys.readouterr().out.count(" --") > 0
