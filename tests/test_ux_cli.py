"""The CLIs and options added after tests/test_ux.py (convert, sample --prompts_file, evals kv_policies,
ablate's sweep keys, bench scripts, train.init_from): bad input is one `error: ...` line and exit code 2,
before any work, with nothing written or lost."""
import json
import os

import pytest

import sample
from test_ux import GLOBAL_RAW, MQAR_RAW, one_error_line, save_ckpt, snapshot


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
        (serve + ["--output", str(tmp_path / "afile" / "o.jsonl")], r"--output: the folder .*afile does not exist"),
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
