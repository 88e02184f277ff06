"""Training: the loss falls, checkpoints resume the step count and the optimizer state."""
import json
import os
import subprocess
import sys

import torch

from config import ROOT, from_raw
from train import latest_checkpoint, load_checkpoint, lr_at, train


def mqar_config(out_dir, **train_kw):
    return from_raw({
        "model": {"vocab_size": 32, "d_model": 64, "n_layer": 2, "pattern": ["g"],
                  "layers": {"g": {"kind": "attn", "n_heads": 4}}, "mlp": {"hidden": 128}},
        "data": {"kind": "mqar", "n_pairs": 4},
        "train": {"max_steps": 60, "batch_size": 16, "seq_len": 32, "lr": 3e-3, "warmup_steps": 5,
                  "log_interval": 10, "eval_interval": 30, "eval_batches": 2, "ckpt_interval": 30,
                  "out_dir": str(out_dir), **train_kw}})


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_loss_falls_on_mqar(tmp_path):
    train(mqar_config(tmp_path), quiet=True)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, rows
    assert all(k in rows[0] for k in ("step", "loss", "lr", "tokens_per_s"))
    assert any("val_loss" in r and "val_acc" in r for r in read_metrics(tmp_path))


def test_eval_line_lists_a_mixtures_settings_by_length(tmp_path, capsys):
    """The step line and metrics.jsonl give the eval's own metrics first, then each mixture setting shortest
    first (8x2 before 16x3: by number, not by name)."""
    cfg = mqar_config(tmp_path, max_steps=2, eval_interval=2, ckpt_interval=2)
    cfg.data.mqar_mix = [[32, 4], [16, 3], [8, 2]]
    train(cfg)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step 2: "))
    names = [part.split()[0] for part in line[len("step 2: "):].split(", ")]
    order = ["val_loss", "val_acc", "val_loss_8x2", "val_acc_8x2", "val_loss_16x3", "val_acc_16x3"]
    assert names == order and list(read_metrics(tmp_path)[-1])[1:] == order


def test_compile_says_the_first_step_compiles(tmp_path, capsys, monkeypatch):
    """With train.compile the bar sat at its first step for minutes on a CPU with nothing said; now a line
    says why before it starts (torch.compile stubbed out here: what is tested is the line)."""
    monkeypatch.setattr(torch, "compile", lambda module: module)
    train(mqar_config(tmp_path, max_steps=1, compile=True))
    out = capsys.readouterr().out
    assert "compile: torch.compile on cpu; the first step (and the first eval) compile the model first" in out
    train(mqar_config(tmp_path / "eager", max_steps=1))
    assert "compile:" not in capsys.readouterr().out


def test_resume_continues_step_count_and_optimizer(tmp_path):
    full = tmp_path / "full"
    train(mqar_config(full, max_steps=60), quiet=True)
    part = tmp_path / "part"
    train(mqar_config(part, max_steps=60), quiet=True, stop_at=30)
    ckpt = load_checkpoint(latest_checkpoint(str(part)))
    assert ckpt["step"] == 30 and ckpt["optimizer"]["state"]
    train(mqar_config(part, max_steps=60), resume=True, quiet=True)
    assert latest_checkpoint(str(part)).endswith("ckpt_60.pt")
    a = [r["loss"] for r in read_metrics(full) if "loss" in r]
    b = [r["loss"] for r in read_metrics(part) if "loss" in r]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)  # the same run, interrupted or not
    wa = load_checkpoint(os.path.join(full, "ckpt_60.pt"))["model"]
    wb = load_checkpoint(os.path.join(part, "ckpt_60.pt"))["model"]
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_lr_schedule():
    tc = mqar_config("x", max_steps=100, warmup_steps=10, min_lr_ratio=0.1).train
    assert abs(lr_at(0, tc) - 3e-4) < 1e-12 and abs(lr_at(9, tc) - 3e-3) < 1e-12
    assert abs(lr_at(100, tc) - 3e-4) < 1e-9 and lr_at(50, tc) < lr_at(20, tc)


def test_bad_resume_is_a_clear_error(tmp_path):
    (tmp_path / "ckpt_5.pt").write_bytes(b"not a checkpoint")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--train.out_dir={tmp_path}",
                        "--resume"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a readable checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_default_run_and_sample_end_to_end(tmp_path):
    """`python train.py` on the embedded corpus (shortened), then sample.py from its checkpoint."""
    env = {**os.environ, "HYBRID_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--train.max_steps=3",
                        "--train.eval_batches=1", "--train.sample_tokens=20", f"--train.out_dir={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "sample:" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--ckpt", str(tmp_path / "o"),
                        "--prompt", "import ", "--max_new_tokens", "10", "--num_samples", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("import ") == 2
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--ckpt", str(tmp_path / "o"),
                        "--prompt", "import os", "--cache_len", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "raise --cache_len or lower --max_new_tokens" in r.stderr


def test_init_from_starts_a_fresh_run_from_the_weights(tmp_path, capsys):
    """train.init_from: step 0 with the checkpoint's weights; settings that change no weight may differ
    (listed, a pattern and its cycled form are not a difference); other weights or no checkpoint: one line."""
    import pytest
    from data.tokens import DataError
    from model import GPT
    from train import init_weights_from
    train(mqar_config(tmp_path / "a", max_steps=2, eval_interval=1000, ckpt_interval=1000), quiet=True)
    saved = load_checkpoint(latest_checkpoint(str(tmp_path / "a")))["model"]
    cfg = mqar_config(tmp_path / "b", max_steps=1, init_from=str(tmp_path / "a"))
    cfg.model.pattern = ["g", "g"]
    model = GPT(cfg.model)
    capsys.readouterr()
    init_weights_from(model, str(tmp_path / "a"), cfg, verbose=True)
    assert capsys.readouterr().out == "" and all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    cfg.model.layers["g"].rope_theta = 500.0
    init_weights_from(model, str(tmp_path / "a"), cfg, verbose=True)
    assert capsys.readouterr().out == "note: init_from with changed model settings (same weights): " \
        "model.layers.g.rope_theta 10000.0 in the checkpoint, 500.0 here\n"
    train(cfg, quiet=True)
    assert load_checkpoint(latest_checkpoint(str(tmp_path / "b")))["step"] == 1
    wider = mqar_config(tmp_path / "c", init_from=str(tmp_path / "a"))
    wider.model.mlp.hidden = 64
    with pytest.raises(DataError, match="the checkpoint's model does not match this config .*mlp.hidden 128 in "
                                        "the checkpoint, 64 here"):
        init_weights_from(GPT(wider.model), str(tmp_path / "a"), wider)
    os.makedirs(tmp_path / "c")
    with pytest.raises(DataError, match=r"c: no checkpoint \(ckpt_\*.pt\) to initialise from"):
        init_weights_from(GPT(wider.model), str(tmp_path / "c"), wider)


def test_compile_refused_where_torch_would_get_the_delta_rule_gradients_wrong(monkeypatch):
    """Torch before 2.13 computes the torch delta rule's gradients wrongly under torch.compile (seen on 2.11):
    train.compile with kda/gdn layers on that path is one ConfigError; on CUDA's triton path, or with no
    delta-rule layer, or on torch 2.13, it is allowed."""
    import pytest
    import kernels.torch_delta_rule as tdr
    from config import ConfigError
    from model import ModelConfig
    from train import refuse_compile_on_old_torch
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kda = ModelConfig.from_dict({"pattern": ["kda"], "n_layer": 1, "layers": {"kda": {"kind": "kda", "n_heads": 2}}})
    attn = ModelConfig.from_dict({"pattern": ["a"], "n_layer": 1, "layers": {"a": {"kind": "attn", "n_heads": 2}}})
    monkeypatch.setattr(tdr, "_OLD_TORCH", False)
    refuse_compile_on_old_torch(kda, cpu)                         # torch 2.13: allowed
    monkeypatch.setattr(tdr, "_OLD_TORCH", True)
    with pytest.raises(ConfigError, match=r"train.compile: the delta-rule layers' torch path needs torch >= 2.13"):
        refuse_compile_on_old_torch(kda, cpu)
    refuse_compile_on_old_torch(kda, cuda)                        # the triton path
    refuse_compile_on_old_torch(attn, cpu)


def test_metrics_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    """A full disk while appending to metrics.jsonl was an OSError traceback from the training loop; now one
    line naming the file and the checkpoint to resume from (exit 2)."""
    import train as train_mod
    real_open = train_mod.open_metrics

    class Full:
        def __init__(self, f, rows):
            self.f, self.rows, self.name = f, rows, f.name

        def write(self, text):
            self.rows -= 1
            if self.rows < 0:
                raise OSError(28, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)
    monkeypatch.setattr(train_mod, "open_metrics", lambda *a: Full(real_open(*a), 4))
    cfg = tmp_path / "c.yaml"
    import yaml
    raw = mqar_config(tmp_path / "run", max_steps=20, log_interval=1, ckpt_interval=2).raw
    cfg.write_text(yaml.safe_dump(raw))
    assert train_mod.main([str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("train:")]
    assert err == [f"error: {tmp_path / 'run' / 'metrics.jsonl'}: could not be written (No space left on device) at "
                   f"step 5; the last checkpoint, ckpt_4.pt, is intact (free space, then --resume)"], err
