"""The CLIs and options added after tests/test_ux.py (convert, sample --prompts_file, evals kv_policies,
ablate's sweep keys, bench scripts, train.init_from): bad input is one `error: ...` line and exit code 2,
before any work, with nothing written or lost."""
import json
import math
import os
import random
import re
import sys

import pytest

import sample
from test_ux import GLOBAL_RAW, MQAR_RAW, one_error_line, save_ckpt, snapshot

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


@pytest.fixture
def text_ckpt(tmp_path):
    return save_ckpt(tmp_path / "text", GLOBAL_RAW)


# ----------------------------------------------------------------------------------------------
# sample.py --prompts_file


def test_sample_serve_options_are_checked_before_any_work(tmp_path, text_ckpt, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ab"}\n')
    (tmp_path / "afile").write_text("keep")
    before = snapshot(tmp_path)
    serve = ["--ckpt", text_ckpt, "--prompts_file", str(prompts), "--max_new_tokens", "3"]
    for argv, match in [
        (serve + ["--output", str(tmp_path / "no" / "o.jsonl")], r"--output: the folder .*/no does not exist"),
        (serve + ["--output", str(tmp_path)], r"--output: .* is a folder, not a file"),
        (serve + ["--output", str(tmp_path / "afile" / "o.jsonl")], r"--output: .*afile is a file, not a folder"),
        (serve + ["--kv_budget", "8"], r"--kv_budget: not with --kv_policy full"),
        (serve + ["--num_samples", "2"], r"--num_samples: not with --prompts_file"),
        (serve + ["--prompt", "x"], r"--prompt: not with --prompts_file"),
        # serving options without --prompts_file were ignored: an --output never written
        (["--ckpt", text_ckpt, "--prompt", "ab", "--output", str(tmp_path / "o.jsonl")],
         r"--output: only with --prompts_file"),
        (["--ckpt", text_ckpt, "--prompt", "ab", "--kv_policy", "h2o"], r"--kv_policy: only with --prompts_file"),
    ]:
        one_error_line(capsys, sample.main(argv), match)
    assert snapshot(tmp_path) == before
    assert sample.main(serve + ["--output", str(tmp_path / "o.jsonl")]) == 0
    assert json.loads((tmp_path / "o.jsonl").read_text())["prompt"] == "ab"


# ----------------------------------------------------------------------------------------------
# convert.py


def test_convert_out_that_cannot_be_written(tmp_path, text_ckpt, capsys, monkeypatch):
    import errno
    import safetensors.torch
    import convert
    (tmp_path / "afile").write_text("keep")
    before = snapshot(tmp_path)
    for argv, match in [
        (["to-hf", "--ckpt", text_ckpt, "--out", str(tmp_path / "afile" / "hf")], r"--out: .*afile is a file, not a folder"),
        (["to-hf", "--ckpt", text_ckpt, "--out", str(tmp_path / "afile")], r"--out: .*afile is a file; --out names a new"),
        (["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "afile" / "x")], r"--out: .*afile is a file, not a"),
    ]:
        one_error_line(capsys, convert.main(argv), match)
    assert snapshot(tmp_path) == before

    def full_disk(tensors, path, metadata=None):
        open(path, "wb").write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    one_error_line(capsys, convert.main(["to-hf", "--ckpt", text_ckpt, "--out", str(tmp_path / "hf")]),
                   r"--out .*hf: could not be written \(No space left on device\); nothing was left behind")
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["afile", "text"]


# ----------------------------------------------------------------------------------------------
# ablate.py: sweep keys checked up front, log lines that name the run


def sweep_file(tmp_path, name, base_raw, **keys):
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps(base_raw))
    sweep = {"base": str(base), "out_dir": str(tmp_path / "runs"), "variants": {"a": {}}, **keys}
    (tmp_path / name).write_text(json.dumps(sweep))
    return str(tmp_path / name)


@pytest.mark.parametrize("keys,match", [
    ({"threads": -1}, r"threads: must be an integer >= 1 \(got -1\)"),
    ({"threads": "abc"}, r"threads: must be an integer >= 1 \(got 'abc'\)"),
    ({"decode_ctx": -5}, r"decode_ctx: must be an integer >= 1 or null \(got -5\)"),
    ({"evals": {"palindrome": {}}}, r"variants.a: evals.palindrome: the model was trained on data.kind=stdlib, "
                                    r"not palindrome"),
    ({"evals": {"mqar": {}}}, r"variants.a: evals.mqar: the checkpoint was trained on data.kind stdlib, not mqar"),
    ({"evals": {"kv_policies": {"budgets": [2, 8]}}}, r"evals.kv_policies.budgets: must be larger than 4 \(the sink "
                                                     r"tokens of policy streaming; got 2\)"),
    ({"out_dir": "afile/runs"}, r"out_dir: .*afile is a file, not a folder"),
    ({"seeds": [0, 1, 0]}, r"seeds: must be a non-empty list of distinct integers \(got \[0, 1, 0\]\)"),
    # settings the sweep sets for each run after the overrides: the override was ignored without a word
    ({"variants": {"a": {"train.out_dir": "elsewhere"}}}, r"variants.a: '--train.out_dir=\"elsewhere\"': each "
                                                          r"run's folder is <out_dir>/<variant>-s<seed>"),
    ({"overrides": {"train.seed": 3}}, r"overrides: '--train.seed=3': the sweep's seeds set each run's seed"),
    ({"lrs": [1e-3, 3e-3], "variants": {"a": {"train.lr": 0.01}}}, r"variants.a: '--train.lr=0.01': the sweep's lrs "
                                                                   r"grid sets each run's lr"),
    ({"variants": {"a": {}, "b": {"after": "a", "train.init_from": "x"}}}, r"variants.b: '--train.init_from=\"x\"': "
                                                                           r"a stage \(after: ...\) starts from"),
])
def test_sweep_is_refused_before_any_run(tmp_path, capsys, monkeypatch, keys, match):
    """Each of these trained every run first, then failed (a traceback, or an eval that never ran)."""
    import ablate
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("keep")
    path = sweep_file(tmp_path, "s.yaml", GLOBAL_RAW, **keys)
    before = snapshot(tmp_path)
    one_error_line(capsys, ablate.main([path]), match)
    assert snapshot(tmp_path) == before


def test_sweep_log_names_the_run_and_a_skipped_eval(tmp_path, capsys):
    import ablate
    raw = json.loads(json.dumps(MQAR_RAW))
    raw["model"]["layers"]["g"]["window"] = 8  # no global layer: streaming is skipped
    raw["train"].update(max_steps=2, batch_size=2, eval_interval=2, eval_batches=1, warmup_steps=1)
    path = sweep_file(tmp_path, "s.yaml", raw, evals={"mqar": {"n_batches": 1, "batch_size": 2},
                                                       "streaming": {"n_seqs": 1}})
    assert ablate.main([path]) == 0
    out = capsys.readouterr().out
    assert "[a-s0] eval mqar: acc " in out
    assert "[a-s0] eval streaming: skipped: evals.streaming: evicts only from global" in out
    assert "[a-s0] done in " in out and "[streaming] done" not in out


# ----------------------------------------------------------------------------------------------
# bench/


def test_gpu_check_out_is_checked_before_the_work(tmp_path, capsys, monkeypatch):
    """--out was opened after the checks, benchmarks and training (minutes of GPU time)."""
    import gpu_check
    monkeypatch.setattr(gpu_check, "run_checks", lambda *a: pytest.fail("ran before --out was checked"))
    (tmp_path / "afile").write_text("keep")
    one_error_line(capsys, gpu_check.main(["--dry-run", "--out", str(tmp_path / "afile" / "c.json")]),
                   r"--out: .*afile is a file, not a folder")
    one_error_line(capsys, gpu_check.main(["--dry-run", "--out", str(tmp_path / "no" / "c.json")]),
                   r"--out: the folder .*no does not exist")
    assert os.listdir(tmp_path) == ["afile"]


def test_bench_serve_bad_input_and_a_model_without_paged_layers(tmp_path, capsys):
    import bench_serve
    one_error_line(capsys, bench_serve.main(["--n_requests", "0"]), r"--n_requests: must be an integer >= 1 \(got 0\)")
    one_error_line(capsys, bench_serve.main(["--ckpt", str(tmp_path / "none")]), r"none: checkpoint not found")
    raw = json.loads(json.dumps(GLOBAL_RAW))
    raw["model"]["layers"] = {"g": {"kind": "kda", "n_heads": 2}}  # was a ZeroDivisionError after the timing
    small = ["--n_requests", "2", "--max_prompt", "8", "--max_new", "8", "--prefix", "8"]
    assert bench_serve.main(["--ckpt", save_ckpt(tmp_path / "kda", raw)] + small) == 0
    assert "no paged layers" in capsys.readouterr().out
    assert bench_serve.main(["--ckpt", save_ckpt(tmp_path / "global", GLOBAL_RAW), "--max_batch", "2"] + small) == 0
    out = capsys.readouterr().out
    assert "greedy outputs equal: 2/2" in out and "peak cache of the paged layers" in out
    assert re.search(r"prefix sharing, 16 requests with a common 8-token prefix: \d+ blocks allocated", out)


# ----------------------------------------------------------------------------------------------
# train.py: train.init_from, train.stop_at


def test_init_from_errors_say_init_from(tmp_path, capsys):
    """A mismatching init_from checkpoint said 'resume with the model it was trained with'; an
    accuracy target above 1 was accepted and never reached."""
    import train as train_mod
    from test_ux import tiny_raw, write_yaml
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(tmp_path / "run"))
    other = save_ckpt(tmp_path / "other", GLOBAL_RAW)
    before = snapshot(tmp_path)
    one_error_line(capsys, train_mod.main([cfg, f"--train.init_from={other}"]),
                   r"ckpt_1.pt: the checkpoint's model does not match this config \(model.vocab_size 257 in the "
                   r"checkpoint, 32 here\); train.init_from needs a checkpoint of a model with the same weights")
    one_error_line(capsys, train_mod.main([cfg, f"--train.init_from={tmp_path / 'none'}"]), r"none: checkpoint not found")
    one_error_line(capsys, train_mod.main([cfg, "--train.stop_at={val_acc: 2}"]),
                   r"train.stop_at.val_acc: must be in \(0, 1\] \(an accuracy\) \(got 2\)")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# cost.py / train.py arguments


def test_cost_override_with_spaces_is_an_override(capsys):
    """argparse took `--model.mlp={kind: moe, ...}` (a space inside) for the config path: 'config file
    not found'."""
    import cost
    import train as train_mod
    one_error_line(capsys, cost.main(["--model.mlp={kind: moe, hidden: -32, n_experts: 4, top_k: 2}"]),
                   r"model.mlp.hidden: must be an integer >= 1 \(got -32\)")
    from config import ROOT
    default = os.path.join(ROOT, "configs", "default.yaml")
    assert cost.main([default, "--model.mlp={kind: moe, hidden: 32, n_experts: 4, top_k: 2}", "--ctx", "64"]) == 0
    assert capsys.readouterr().out.startswith(f"{default}: ")
    one_error_line(capsys, cost.main(["myconfig"]), r"myconfig: not a config \(\*.yaml, \*.yml\) nor an override")
    one_error_line(capsys, train_mod.main(["c.json"]), r"unknown argument 'c.json' \(a config file ends in .yaml or "
                                                      r".yml\); see python train.py --help")


# ----------------------------------------------------------------------------------------------
# data/prepare.py


@pytest.mark.parametrize("extra,match", [
    (["--out", "afile/p"], r"--out: .*afile is a file, not a folder"),  # was a traceback
    (["--val_tokens", "0"], r"--val_tokens: must be >= 1 \(training evaluates on val_000.bin\) \(got 0\)"),
    (["--shard_tokens", "0"], r"--shard_tokens: must be >= 1 \(got 0\)"),
    (["--max_tokens", "-1"], r"--max_tokens: must be >= 1 \(got -1\)"),  # was ignored
    (["--workers", "0"], r"--workers: must be >= 1 \(got 0\)"),
    (["--tokenizer", "bogus"], r"--tokenizer bogus: not a tiktoken encoding; one of gpt2, .*, or bytes"),
])
def test_prepare_options(tmp_path, capsys, monkeypatch, extra, match):
    from data import prepare as prepare_mod
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "afile").write_text("keep")
    before = snapshot(tmp_path)
    opts = {"--files": "a.txt", "--tokenizer": "bytes", "--out": "corpus"}
    opts.update(zip(extra[::2], extra[1::2]))
    one_error_line(capsys, prepare_mod.main([x for kv in opts.items() for x in kv]), match)
    assert snapshot(tmp_path) == before and not (tmp_path / "corpus").exists()


def prepare_errors(err):
    """prepare.py's stderr lines without tqdm's bar (its lines start with "tokenise")."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("tokenise")]


def test_prepare_a_corpus_without_train_shard_is_an_error(tmp_path, capsys, monkeypatch):
    """One file is one document: with the default --val_tokens it all went to val, exit 0, and training
    then said 'prepare the corpus first'."""
    import re
    from data import prepare as prepare_mod
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    rc = prepare_mod.main(["--files", "a.txt", "--tokenizer", "bytes", "--out", "c", "--workers", "1"])
    out, err = capsys.readouterr()
    errors = prepare_errors(err)
    assert rc == 2 and re.fullmatch(r"c: 601 tokens \(601 val\) .*\n", out), out
    assert len(errors) == 1 and re.match(r"error: c: no train shard, every document went to val \(the first "
                                         r"documents, whole, up to --val_tokens 1,000,000; one file is one document\)",
                                         errors[0]), err
    (tmp_path / "b.txt").write_text("bye\n" * 50)
    assert prepare_mod.main(["--files", "*.txt", "--tokenizer", "bytes", "--out", "d", "--workers", "1",
                             "--val_tokens", "1"]) == 0  # two documents: one for val, one for train


# ----------------------------------------------------------------------------------------------
# plot.py


def test_plot_runs_with_the_same_folder_name_are_all_drawn(tmp_path, monkeypatch):
    """x/run and y/run were one dict key: the first run's curve was silently dropped."""
    import plot
    drawn = {}
    monkeypatch.setattr(plot, "loss_curves", lambda runs, out: drawn.update(runs))
    for parent in ("x", "y"):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    assert plot.main([str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run"), "--out", str(tmp_path / "p.png")]) == 0
    assert sorted(drawn) == [str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")]


def test_sample_prompts_file_unreadable_names_the_file(tmp_path, text_ckpt, capsys):
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    for path, match in [(tmp_path / "bad.jsonl", r"bad.jsonl: not UTF-8 text \(byte 15: b'\\xe9'\)"),
                        (tmp_path, r"--prompts_file .*: cannot be read \(Is a directory\)"),
                        (tmp_path / "none", r"none: cannot be read \(No such file or directory\)")]:
        one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--prompts_file", str(path)]), match)


def test_sweep_interrupted_by_ctrl_c_keeps_no_result(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a sweep's run: train() saved and returned, and the half-trained run was evaluated
    and written as finished (result.json), so a rerun skipped it. Now: the sweep stops, the run resumes."""
    import ablate
    from test_ux import interrupt_during_step
    raw = json.loads(json.dumps(MQAR_RAW))
    raw["train"].update(max_steps=6, batch_size=2, eval_interval=1000, eval_batches=1, warmup_steps=1,
                        ckpt_interval=1000, log_interval=1)
    path = sweep_file(tmp_path, "s.yaml", raw, variants={"a": {}, "b": {}}, evals={"mqar": {"n_batches": 1, "batch_size": 2}})
    interrupt_during_step(monkeypatch, {3})
    assert ablate.main([path]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("[a-s0] stopped by a signal at step 3 of 6 (checkpoint saved, no result.json); "
                                 "rerun the same command to resume the sweep"), out
    assert sorted(os.listdir(tmp_path / "runs")) == ["a-s0"]
    assert sorted(os.listdir(tmp_path / "runs" / "a-s0")) == ["ckpt_3.pt", "metrics.jsonl"]
    monkeypatch.undo()
    assert ablate.main([path]) == 0
    assert "[a-s0] resuming from ckpt_3.pt" in capsys.readouterr().out
    result = json.loads((tmp_path / "runs" / "a-s0" / "result.json").read_text())
    assert result["final"]["step"] == 6


def test_bench_model_options(capsys):
    import bench_model
    for argv, match in [(["decode", "--contexts", "0,x"], r"--contexts: comma-separated integers >= 1 \(got '0,x'\)"),
                        (["decode", "--contexts", "-4"], r"--contexts: comma-separated integers >= 1"),
                        (["train", "--steps", "0"], r"--steps: must be >= 1 \(got 0\)"),
                        (["decode", "--tokens", "-1"], r"--tokens: must be >= 1 \(got -1\)")]:
        one_error_line(capsys, bench_model.main(argv), match)


def test_bench_nanogpt_options(capsys):
    """An unknown kind exited 1 without 'error:'; a bad shape was a ConfigError traceback."""
    import bench_nanogpt
    for argv, match in [(["--kinds", "bogus"], r"--kinds: unknown kind 'bogus'; allowed: attn, attn_nope, kda"),
                        (["--d", "0"], r"--d: must be an integer >= 1 \(got 0\)"),
                        (["--heads", "3"], r"--heads: must divide --d=256 \(got 3\)"),
                        (["--kinds", "mla", "--d", "8", "--heads", "8"], r"model.layers.mla")]:
        one_error_line(capsys, bench_nanogpt.main(argv), match)


def test_bench_sparse_and_delta_rule_sizes(capsys, monkeypatch):
    """--T 0 / --cpu-T 0 were tracebacks (torch.cat of nothing, max of an empty tensor)."""
    import bench_delta_rule
    import bench_sparse
    for module, call, argv, match in [(bench_sparse, bench_sparse.parse_args, ["--cpu-T", "0"], r"--cpu-T: must be integers >= 1"),
                                      (bench_delta_rule, bench_delta_rule.main, ["--T", "512", "0"], r"--T: must be integers >= 1 \(got \[512, 0\]\)"),
                                      (bench_delta_rule, bench_delta_rule.main, ["--repeat", "-1"], r"--repeat: must be")]:
        monkeypatch.setattr(sys, "argv", [module.__file__] + argv)
        with pytest.raises(SystemExit) as e:
            call()
        one_error_line(capsys, e.value.code, match)


def test_resume_from_a_weights_only_checkpoint(tmp_path, capsys):
    """convert.py from-hf writes weights only; --resume from it said 'the optimizer state does not fit
    (train.optimizer=adamw?)' after a screenful of 'changed model settings'."""
    import torch
    import train as train_mod
    from test_ux import tiny_raw, write_yaml
    raw = tiny_raw(tmp_path / "run")
    path = os.path.join(save_ckpt(tmp_path / "conv", raw, step=0), "ckpt_0.pt")
    ckpt = torch.load(path, weights_only=True)
    torch.save({**ckpt, "converted_from": "llama:hf/x"}, path)
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    one_error_line(capsys, train_mod.main([cfg, f"--resume={path}"]),
                   rf"ckpt_0.pt: holds weights only \(no optimizer state or data position, converted from llama:hf/x\): "
                   rf"it cannot be resumed; start a run from it with --train.init_from={path}$")
    assert not (tmp_path / "run").exists()
    assert train_mod.main([cfg, f"--train.init_from={path}"]) == 0


def test_plot_write_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    """savefig wrote straight to the PNG: a failure (disk full) left a torn file."""
    import errno
    import matplotlib.figure
    import plot
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    before = snapshot(tmp_path)

    def full_disk(self, f, **kw):
        f.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    one_error_line(capsys, plot.main([str(run)]), r"--out .*loss_curves.png: could not be written \(No space left on "
                                                  r"device\); the temporary file was removed")
    assert snapshot(tmp_path) == before


def test_sweep_jobs_ctrl_c_is_one_line_and_starts_nothing_new(tmp_path, capsys, monkeypatch):
    """--jobs: Ctrl-C raised KeyboardInterrupt in the parent (a traceback) and the pool went on to start
    the queued runs while shutting down."""
    import concurrent.futures
    import ablate
    raw = json.loads(json.dumps(MQAR_RAW))
    raw["train"].update(max_steps=2, batch_size=2, eval_interval=1000, eval_batches=1, warmup_steps=1)
    path = sweep_file(tmp_path, "s.yaml", raw, variants={v: {} for v in "abcdef"})

    def ctrl_c(futures, return_when=None):  # Ctrl-C while the parent waits for a run to end
        raise KeyboardInterrupt
    monkeypatch.setattr(concurrent.futures, "wait", ctrl_c)
    assert ablate.main([path, "--jobs", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == ("stopped by a signal: runs without result.json resume from their checkpoint; rerun the same "
                       "command to continue the sweep")
    assert len(os.listdir(tmp_path / "runs")) <= 3  # 2 running + 1 in the pool's call queue; the rest cancelled


def test_sweep_jobs_sigterm_to_the_parent_alone_stops_every_run(tmp_path):
    """`kill PID` (SIGTERM to the sweep's process only, as a scheduler or a user sends it) under --jobs: the
    parent died at once and its workers trained their runs to the end, wrote result.json, then hung forever.
    Now the parent passes the signal on: each run finishes its step and saves, none is recorded, exit 0."""
    import signal
    import subprocess
    import time
    from config import ROOT
    from test_ux import wait_for_steps
    raw = json.loads(json.dumps(MQAR_RAW))
    raw["train"].update(max_steps=100_000, batch_size=2, eval_interval=100_000, eval_batches=1, warmup_steps=1,
                        ckpt_interval=100_000, log_interval=1)
    path = sweep_file(tmp_path, "s.yaml", raw, variants={v: {} for v in "abc"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "ablate.py"), path, "--jobs", "2"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = [tmp_path / "runs" / f"{v}-s0" for v in "ab"]
    for run in runs:
        wait_for_steps(p, run)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.strip().splitlines()[-1] == ("stopped by a signal: runs without result.json resume from their "
                                            "checkpoint; rerun the same command to continue the sweep"), out + err
    assert "Traceback" not in err
    sizes = [(run / "metrics.jsonl").stat().st_size for run in runs]
    time.sleep(2)                                           # nothing trains on after the sweep has exited
    assert [(run / "metrics.jsonl").stat().st_size for run in runs] == sizes
    for run in runs:
        files = os.listdir(run)
        assert "result.json" not in files and any(f.startswith("ckpt_") for f in files), files
    assert not (tmp_path / "runs" / "c-s0").exists()        # the third run never started


# ----------------------------------------------------------------------------------------------
# evals.py


def test_eval_seed_and_list_options(tmp_path, capsys):
    """--seed -1 was torch's 'expected non-negative integer' (no option named); a bad list value was
    'invalid <lambda> value'."""
    import evals
    ckpt = save_ckpt(tmp_path / "m", MQAR_RAW)
    for argv, match in [(["mqar", "--seed", "-1"], r"evals.mqar.seed: must be >= 0 \(got -1\)"),
                        (["needle", "--seed", "-3"], r"evals.needle.seed: must be >= 0 \(got -3\)"),
                        (["kv_policies", "--budgets", "2,8"], r"evals.kv_policies.budgets: must be larger than 4")]:
        one_error_line(capsys, evals.main(argv + ["--ckpt", ckpt]), match)
    with pytest.raises(SystemExit):
        evals.main(["needle", "--ckpt", ckpt, "--factors", "1,x"])
    assert "invalid comma-separated int list value: '1,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):                   # a bool option: true/false/yes/no/1/0, not 'maybe' -> False
        evals.main(["streaming", "--ckpt", ckpt, "--full", "maybe"])
    assert "argument --full: invalid true or false value: 'maybe'" in capsys.readouterr().err


def test_converted_checkpoint_has_no_tokenizer_nor_corpus(tmp_path, text_ckpt, capsys):
    """A from-hf checkpoint's data.kind is the default (stdlib): sample.py encoded prompts as bytes for
    a BPE model and evals.py val scored it on the stdlib corpus, both silently."""
    import convert
    import evals
    assert convert.main(["to-hf", "--ckpt", text_ckpt, "--out", str(tmp_path / "hf")]) == 0
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "conv")]) == 0
    capsys.readouterr()
    conv = str(tmp_path / "conv")
    one_error_line(capsys, sample.main(["--ckpt", conv, "--prompt", "ab", "--max_new_tokens", "2"]),
                   r"converted from llama:.*hf and tokenizers are not converted: pass --tokenizer NAME")
    one_error_line(capsys, evals.main(["val", "--ckpt", conv]),
                   r"evals.val: the checkpoint was converted from llama:.*hf and has no corpus to evaluate on")
    assert sample.main(["--ckpt", conv, "--prompt", "ab", "--max_new_tokens", "2", "--tokenizer", "bytes"]) == 0


@pytest.mark.parametrize("overrides, match", [
    (["--train.seq_len=16", "--data.n_pairs=8"], r"mqar: seq_len=16 is too short for 8 pairs \(need >= 24\)$"),
    (["--data.n_pairs=20"], r"mqar: n_pairs=20 needs a vocab of at least 42 \(got 32\)$"),
    (["--data.mqar_mix=[[64, 4]]"], r"mqar: a mixture length 64 exceeds seq_len=32$"),
    (["--data.kind=palindrome", "--data.n_pairs=8", "--train.seq_len=1"], r"palindrome: seq_len must be >= 2 \(got 1\)$"),
    (["--data.kind=backcopy", "--data.n_pairs=8", "--model.vocab_size=8"],
     r"backcopy: needs a vocab of at least 9 tokens \(got 8\)$")])
def test_impossible_synthetic_task_settings_are_one_line(tmp_path, capsys, overrides, match):
    """A setting the task generator cannot make was a traceback (a plain ValueError from data/); now the
    generators raise DataError, which train.py reports as one line before any work."""
    import train as train_mod
    from test_ux import tiny_raw, write_yaml
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(tmp_path / "run"))
    one_error_line(capsys, train_mod.main([cfg, *overrides]), match)
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


OVERRIDE_DRAWS = [  # good and bad values of train.py's settings
    ("train.max_steps", ["2", "0", "-1", "x", "1.5"]), ("train.batch_size", ["1", "3", "0"]),
    ("train.seq_len", ["1", "7", "33", "0"]), ("train.grad_accum", ["1", "2", "0"]),
    ("train.lr", ["1e-3", "0", "-1", "nan", "inf"]), ("train.warmup_steps", ["0", "5", "-1"]),
    ("train.eval_interval", ["1", "0"]), ("train.optimizer", ["adamw", "muon", "sgd"]),
    ("train.precision", ["fp32", "bf16", "fp8"]), ("train.grad_clip", ["0", "1", "-1"]),
    ("train.min_lr_ratio", ["0", "0.5", "2"]), ("train.stop_at", ["{val_loss: 9}", "{val_acc: 2}", "{foo: 1}", "3"]),
    ("train.context_parallel", ["1", "2", "0"]), ("model.n_layer", ["1", "0", "2"]),
    ("model.d_model", ["32", "0", "48"]),
    ("model.vocab_size", ["10", "0", "64"]), ("model.init_std", ["0", "0.1", "inf"]),
    ("data.kind", ["mqar", "palindrome", "stack", "backcopy", "nope"]), ("data.n_pairs", ["1", "0", "20"]),
    ("data.mqar_mix", ["[[16, 2]]", "[[64, 4]]", "[[8]]"])]


@pytest.mark.parametrize("seed", [*range(20), *(pytest.param(s, marks=pytest.mark.slow) for s in range(20, 200))])
def test_random_overrides_train_or_are_one_line(seed, tmp_path, capsys):
    """Random combinations of good and bad settings: train.py trains to a finite loss (exit 0) or refuses
    in one `error:` line (exit 2), never a traceback. Such draws found an odd seq_len refused, an infinite lr
    accepted (it trained on NaNs) and impossible MQAR settings as tracebacks."""
    import train as train_mod
    from test_ux import tiny_raw, write_yaml
    r = random.Random(seed)
    overrides = [f"--{key}={r.choice(values)}" for key, values in r.sample(OVERRIDE_DRAWS, r.randint(1, 3))]
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(tmp_path / "run", max_steps=2, sample_tokens=0))
    rc = train_mod.main([cfg, *overrides])
    if rc == 2:
        one_error_line(capsys, rc, "", stdout=".*")
        return
    assert rc == 0, overrides
    losses = [row["loss"] for row in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses), (overrides, losses)


def test_triton_backend_off_cuda(tmp_path, capsys, monkeypatch):
    """`model.backend: triton` off CUDA without Triton's interpreter was a traceback from inside Triton ("0
    active drivers"): train.py refuses it in one line before any work; a checkpoint trained that way (on a GPU)
    is read on the CPU by sample.py and evals.py with the torch kernels, with a note."""
    import evals
    import train as train_mod
    from test_ux import tiny_raw, write_yaml
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(tmp_path / "run"))
    one_error_line(capsys, train_mod.main([cfg, "--model.backend=triton"]),
                   r"model.backend: triton runs on a CUDA device \(or under TRITON_INTERPRET=1.*this run is on cpu")
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")
    raw = {**GLOBAL_RAW, "model": {**GLOBAL_RAW["model"], "backend": "triton"}}
    ckpt = save_ckpt(tmp_path / "gpu_run", raw)
    model, cfg = sample.load_model(ckpt)
    assert cfg.model.backend is None and all(getattr(b.mixer, "backend", None) is None for b in model.blocks)
    note = f"note: {ckpt}/ckpt_1.pt was trained with model.backend triton, which needs CUDA; running on cpu"
    assert capsys.readouterr().err.startswith(note)
    assert sample.main(["--ckpt", ckpt, "--prompt", "ab", "--max_new_tokens", "2"]) == 0
    assert evals.main(["val", "--ckpt", ckpt, "--n_batches", "1"]) == 0
    out, err = capsys.readouterr()
    assert err.count(note) == 2 and "Traceback" not in err and "val_loss" in out


def test_prepare_hub_failures_are_one_line_and_keep_the_shards_written(tmp_path, capsys, monkeypatch):
    """`--dataset` without network (or a name the hub does not have) was a traceback from datasets; a
    stream cut mid-way too, and Ctrl-C. Now one line, exit 2 (130 for Ctrl-C), and the shards finished
    before the cut stay: the same command continues after them."""
    import datasets
    from data import prepare as prepare_mod

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'x/y' on the Hub (LocalEntryNotFoundError)")
    def one_line(rc, match):
        err = capsys.readouterr().err
        errors = prepare_errors(err)
        assert rc == 2 and len(errors) == 1 and re.search(match, errors[0]), err
    monkeypatch.setattr(datasets, "load_dataset", offline)
    argv = ["--dataset", "x/y", "--tokenizer", "bytes", "--out", str(tmp_path / "c"), "--workers", "1",
            "--val_tokens", "100", "--shard_tokens", "300", "--batch_docs", "1"]
    one_line(prepare_mod.main(argv), r"^error: --dataset x/y --split train: reading it failed "
                   r"\(ConnectionError: Couldn't reach 'x/y' on the Hub \(LocalEntryNotFoundError\)\); check")

    def cut_after(n):
        def stream(*a, **k):
            for i in range(n):
                yield {"text": f"document {i} " * 10}
            raise OSError("Connection reset by peer\nmore lines")
        return stream
    monkeypatch.setattr(datasets, "load_dataset", cut_after(30))
    one_line(prepare_mod.main(argv), r"reading it failed \(OSError: Connection reset by peer\); check")
    with open(tmp_path / "c" / "manifest.json") as f:
        done = json.load(f)
    assert not done["complete"] and len(done["shards"]) >= 3 and 0 < done["docs_done"] < 30
    def ctrl_c_after(n):
        def stream(*a, **k):
            yield from ({"text": f"document {i} " * 10} for i in range(n))
            raise KeyboardInterrupt
        return stream
    monkeypatch.setattr(datasets, "load_dataset", ctrl_c_after(20))   # Ctrl-C: one line too, exit 130
    assert prepare_mod.main(argv) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (f"interrupted: the shards finished in {tmp_path / 'c'} are "
                                                        f"kept; the same command continues after them")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: iter({"text": f"document {i} " * 10}
                                                                      for i in range(30)))
    assert prepare_mod.main(argv) == 0
    with open(tmp_path / "c" / "manifest.json") as f:
        assert json.load(f)["complete"]


def test_ctrl_c_in_sample_and_evals_keeps_what_was_done(tmp_path, text_ckpt, capsys, monkeypatch):
    """Ctrl-C was a KeyboardInterrupt traceback, and under --prompts_file every completion was lost (they are
    written at the end). Now: exit 130 and one line; the requests that had finished are written."""
    import engine
    import evals
    from model import GPT
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["ab", "cd", "ef", "gh"]))
    run = engine.Engine.run

    def cut_after_two(self, requests, on_done=None):         # serves two requests, then Ctrl-C
        run(self, requests[:2], on_done)
        raise KeyboardInterrupt
    monkeypatch.setattr(engine.Engine, "run", cut_after_two)
    rc = sample.main(["--ckpt", text_ckpt, "--prompts_file", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                      "--max_new_tokens", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("requests")]
    assert rc == 130 and err == ["wrote 2 completions to " + str(tmp_path / "o.jsonl"),
                                 "interrupted: 2 of 4 requests had finished and were written; the others were not "
                                 "served"], err
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["ab", "cd"] and all(len(r["completion"]) for r in rows)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(GPT, "step", interrupted)
    assert sample.main(["--ckpt", text_ckpt, "--prompt", "ab", "--max_new_tokens", "3"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    monkeypatch.setattr(evals, "run_eval", interrupted)
    assert evals.main(["val", "--ckpt", text_ckpt]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_sweep_with_more_threads_than_cores_says_so(tmp_path, capsys, monkeypatch):
    """Threads that wait for a core spin: two 2-thread runs on 2 cores each go far slower than half speed.
    ablate.py now says so when --jobs x threads exceeds the cores (and runs as asked)."""
    import ablate
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(ablate, "run_sweep", lambda *a, **k: None)
    path = sweep_file(tmp_path, "s.yaml", GLOBAL_RAW, threads=2)
    assert ablate.main([path, "--jobs", "2"]) == 0
    assert ("note: --jobs 2 x threads 2 = 4 torch threads on 2 cores: the runs will slow each other down; use at "
            "most that many") in capsys.readouterr().out
    assert ablate.main([path, "--jobs", "1"]) == 0
    assert "note:" not in capsys.readouterr().out
