"""ablate.py: sweep-file errors, a tiny sweep end to end, resume after an interruption."""
import json
import os
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


def test_cli_exit_code_and_help(tmp_path):
    r = run_cli(write_sweep(tmp_path, SWEEP + "colour: red\n"), "--dry_run")
    assert r.returncode == 2 and "colour: unknown key" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--help")
    assert r.returncode == 0 and "sweep file" in r.stdout


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
    assert logs == []
    path = ablate.write_report(sweep)
    text = open(path).read()
    assert "| attn | 1 |" in text and "| hybrid | 1 |" in text and "mqar acc" in text and "cache @1M" in text
    for png in ("loss_curves.png", "acc_by_distance.png", "cache_bytes.png", "loss_by_position.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000
    assert ablate.main([sweep["path"], "--report"]) == 0
