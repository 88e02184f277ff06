"""sample.py --prompts_file: JSON lines in, completions out (engine.py), bad requests named one per line
while the others complete; greedy completions equal the single-prompt mode's."""
import json

import pytest
import torch

import sample
from config import from_raw
from model import GPT
from train import save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    cfg = from_raw({"model": {"d_model": 32, "n_layer": 2, "pattern": ["kda", "g"], "mlp": {"hidden": 64},
                              "layers": {"kda": {"kind": "kda", "n_heads": 2},
                                         "g": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}}}})
    torch.manual_seed(0)
    save_checkpoint(str(d / "ckpt_1.pt"), {"model": GPT(cfg.model).state_dict(), "config": cfg.raw, "step": 1})
    return str(d)


def run(ckpt, tmp_path, lines, *extra):
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = sample.main(["--ckpt", ckpt, "--prompts_file", str(src), "--output", str(out), "--temperature", "0",
                      "--max_new_tokens", "6", "--max_batch", "2", "--prefill_chunk", "4", "--block_size", "4", *extra])
    return rc, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else None


def test_prompts_file_equals_single_prompt_mode(ckpt, tmp_path, capsys):
    prompts = ["def f(x):", "import os\n", "a", "class A:\n    pass\n" * 3]
    rc, got = run(ckpt, tmp_path, [json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)])
    assert rc == 0 and [g["id"] for g in got] == [0, 1, 2, 3]
    assert capsys.readouterr().err.strip().endswith(f"wrote 4 completions to {tmp_path / 'o.jsonl'}")
    for p, g in zip(prompts, got):
        assert sample.main(["--ckpt", ckpt, "--prompt", p, "--temperature", "0", "--max_new_tokens", "6"]) == 0
        assert capsys.readouterr().out == p + g["completion"] + "\n"


def test_bad_requests_are_named_and_the_others_complete(ckpt, tmp_path, capsys):
    lines = ['{"prompt": "ok one"}', "{not json", '["prompt"]', '{"prompt": ""}', '{"prompt": "long", "max_new_tokens": 40}',
             '{"prompt": "ok two", "max_new_tokens": 3}']
    rc, got = run(ckpt, tmp_path, lines, "--cache_len", "30")
    err = capsys.readouterr().err
    assert rc == 2
    assert [g["prompt"] for g in got] == ["ok one", "ok two"] and len(got[1]["completion"]) == 3
    for n, why in [(2, "not valid JSON"), (3, 'not a JSON object with a string "prompt"'), (4, "empty prompt"),
                   (5, "prompt 4 + max_new_tokens 40 = 44 tokens exceeds the cache (30 tokens) under kv_policy full")]:
        assert f"line {n}: {why}" in err
    assert "4 of 6 requests failed (named above); the others completed" in err and "Traceback" not in err
    rc, got = run(ckpt, tmp_path, lines[1:3])   # none completes: no "the others completed"
    assert rc == 2 and got == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: 2 of 2 requests failed (named above)"


def test_policies_from_the_cli(ckpt, tmp_path, capsys):
    lines = [json.dumps({"prompt": "x = 1\n" * 8}), json.dumps({"prompt": "y"})]
    rc, got = run(ckpt, tmp_path, lines, "--kv_policy", "streaming", "--kv_budget", "16", "--cache_len", "20")
    assert rc == 0 and len(got) == 2  # a bounded cache serves a 54-token context under --cache_len 20
    assert sample.main(["--ckpt", ckpt, "--prompts_file", str(tmp_path / "p.jsonl"), "--kv_policy", "h2o"]) == 2
    assert "--kv_budget: an integer >= 1 is needed with --kv_policy h2o" in capsys.readouterr().err
