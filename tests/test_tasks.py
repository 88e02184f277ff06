"""Palindrome, Stack and Bigram-Backcopy (data/tasks.py): labels against a token-by-token reading of the
inputs, the data kinds through make_dataset and train.py (the loss falls), the evals, train.stop_at."""
import json
import math
import os

import pytest
import torch

import evals
from config import from_raw
from data import make_dataset
from data.tasks import BOS, POP, SEP, TRIGGERS, backcopy_batch, backcopy_chain, palindrome_batch, stack_batch
from model import ConfigError, GPT
from sample import load_model
from train import train


def test_palindrome_labels_are_the_tokens_reversed():
    for T in (16, 17):
        x, y = palindrome_batch(3, T, 12, seed=[1, 2])
        n = T // 2
        for b in range(3):
            assert x[b, n] == SEP and ((x[b, :n] >= 2) & (x[b, :n] < 12)).all()
            labelled = (y[b] >= 0).nonzero().flatten().tolist()
            assert labelled == list(range(n, 2 * n))
            for i, t in enumerate(labelled):   # after SEP the sequence runs backwards
                assert y[b, t] == x[b, n - 1 - i]
                if t + 1 < T:
                    assert x[b, t + 1] == y[b, t]
    assert torch.equal(palindrome_batch(3, 16, 12, [1, 2])[0], palindrome_batch(3, 16, 12, [1, 2])[0])
    with pytest.raises(ValueError, match="palindrome: needs a vocab of at least 3"):
        palindrome_batch(1, 8, 2, 0)


def test_stack_labels_follow_a_stack_read_from_the_inputs():
    x, y = stack_batch(4, 200, 9, seed=5)
    n_pops = 0
    for b in range(4):
        stack = []
        for t in range(200):
            if x[b, t] == POP:
                assert stack, "a pop met an empty stack"
                assert y[b, t] == stack.pop()
                n_pops += 1
            else:
                assert 2 <= x[b, t] < 9 and y[b, t] == -1
                stack.append(x[b, t].item())
    assert 300 < n_pops < 400          # about half the operations pop


def test_backcopy_walks_its_chain_and_copies_after_triggers():
    """BOS first; after a trigger the token before it, elsewhere one of the current token's fixed successors;
    the targets are the inputs shifted by one; the chain depends on the vocab only."""
    V, T = 64, 300
    x, y = backcopy_batch(6, T, V, seed=[3, 4])
    succ = backcopy_chain(V)
    assert (x[:, 0] == BOS).all() and (x[:, 1:] != BOS).all() and (x[:, 1] > TRIGGERS).all()
    assert torch.equal(y[:, :-1], x[:, 1:]) and (y >= 1).all()
    copies = 0
    for b in range(6):
        for t in range(1, T):
            if x[b, t] <= TRIGGERS:
                assert y[b, t] == x[b, t - 1]
                copies += 1
            else:
                assert y[b, t].item() in succ[x[b, t]].tolist()
    assert 0.2 < copies / (6 * (T - 1)) < 0.45          # the triggers are frequent (Zipf successors)
    assert torch.equal(backcopy_batch(2, 50, V, [1])[0], backcopy_batch(2, 50, V, [1])[0])
    assert (backcopy_chain(V) == succ).all() and not (backcopy_chain(V + 1)[1:V] == succ[1:]).all()
    with pytest.raises(ValueError, match="backcopy: needs a vocab of at least 9"):
        backcopy_batch(1, 8, 8, 0)


def test_backcopy_trains_and_the_sink_study_reads_it(tmp_path):
    cfg = task_config("backcopy", tmp_path, vocab=16, seq_len=32)
    final = train(cfg, quiet=True)
    losses = [json.loads(line)["loss"] for line in open(os.path.join(tmp_path, "metrics.jsonl")) if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.5, losses
    assert final["val_loss"] < math.log(15) - 0.5
    fresh = GPT(cfg.model).eval()                      # small init: attention about uniform, so no sink
    sinks = evals.run_eval("attention_sinks", fresh, cfg, {"n_seqs": 2})
    assert abs(sinks["key0_L0"] - sinks["uniform"]) < 0.01 and sinks["learned_L0"] == 0
    trained, _ = load_model(os.path.join(tmp_path, "ckpt_60.pt"))
    stream = evals.run_eval("streaming", trained, cfg, {"factor": 2, "budget": 8, "n_sinks": 2, "n_seqs": 2})
    assert all(1 < stream[k] < 15 for k in ("ppl_full", "ppl_window", "ppl_sinks+window")), stream  # below chance
    with pytest.raises(ValueError, match="evals.mqar: the checkpoint was trained on data.kind backcopy, not mqar; "
                                         "use val, length, streaming or attention_sinks"):
        evals.run_eval("mqar", fresh, cfg, {})
    with pytest.raises(ValueError, match="needle: defined for text and MQAR models, not data.kind=backcopy"):
        evals.run_eval("needle", fresh, cfg, {})


def task_config(kind, out_dir, vocab=16, seq_len=16, **train_kw):
    return from_raw({
        "model": {"vocab_size": vocab, "d_model": 32, "n_layer": 2, "pattern": ["g"],
                  "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 64}},
        "data": {"kind": kind},
        "train": {"max_steps": 60, "batch_size": 8, "seq_len": seq_len, "lr": 1e-2, "warmup_steps": 4,
                  "log_interval": 10, "eval_interval": 30, "eval_batches": 2, "ckpt_interval": 30,
                  "device": "cpu", "out_dir": str(out_dir), **train_kw}})


@pytest.mark.parametrize("kind,vocab,seq_len", [("palindrome", 8, 8), ("stack", 16, 16)])
def test_task_kinds_train_and_evaluate(tmp_path, kind, vocab, seq_len):
    cfg = task_config(kind, tmp_path, vocab, seq_len)
    x, y = make_dataset(cfg).next_batch()
    assert x.shape == y.shape == (8, seq_len) and (y >= 0).any()
    final = train(cfg, quiet=True)
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.4, losses
    assert final["val_loss"] < math.log(vocab - 2) - 0.2 and "val_acc" in final   # below chance
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    res = evals.run_eval(kind, model, cfg, {"n_batches": 1, "batch_size": 4, "seq_len": 24})
    assert 0 <= res["seq_acc"] <= res["acc"] <= 1
    assert set(evals.run_eval("length", model, cfg, {"factor": 2, "n_seqs": 2})) >= {"loss@1x", "loss@2x"}


class PalindromeOracle(torch.nn.Module):
    """Reads the reversed half off the inputs; `wrong` spoils the first labelled position of every row."""

    def __init__(self, vocab, wrong=False):
        super().__init__()
        self.wte, self.vocab, self.wrong = torch.nn.Embedding(1, 1), vocab, wrong

    def forward(self, x, y=None):
        n = x.shape[1] // 2
        pred = torch.zeros_like(x)
        pred[:, n:2 * n] = x[:, :n].flip(1)
        if self.wrong:
            pred[:, n] = (pred[:, n] + 1) % self.vocab
        return torch.nn.functional.one_hot(pred, self.vocab).float(), None


def test_task_evals_count_labelled_positions_and_whole_sequences(tmp_path):
    cfg = task_config("palindrome", tmp_path, vocab=12, seq_len=20)
    opts = {"n_batches": 2, "batch_size": 3, "seq_len": 20}
    assert evals.run_eval("palindrome", PalindromeOracle(12), cfg, opts) == {"acc": 1.0, "seq_acc": 1.0}
    assert evals.run_eval("palindrome", PalindromeOracle(12, wrong=True), cfg, opts) == {"acc": 0.9, "seq_acc": 0.0}
    with pytest.raises(ValueError, match="stack: the model was trained on data.kind=palindrome"):
        evals.run_eval("stack", PalindromeOracle(12), cfg, opts)


def test_stop_at_stops_after_the_first_eval_that_reaches_it(tmp_path):
    metrics = train(task_config("palindrome", tmp_path / "a", stop_at={"val_loss": 100.0}), quiet=True)
    assert sorted(os.listdir(tmp_path / "a")) == ["ckpt_30.pt", "metrics.jsonl"] and "val_acc" in metrics
    train(task_config("palindrome", tmp_path / "b", max_steps=30, stop_at={"val_loss": 1e-9}), quiet=True)
    assert os.path.exists(tmp_path / "b" / "ckpt_30.pt")     # never reached: runs to max_steps
    for stop, message in [({"val_bpb": 1.0}, "train.stop_at.val_bpb: must be a metric data.kind=palindrome"),
                          ({"accuracy": 1.0}, "train.stop_at.accuracy: must be one of val_acc"),
                          ({"val_acc": "high"}, "train.stop_at.val_acc: must be a finite number"),
                          ({"val_acc": 99}, r"train.stop_at.val_acc: must be in \(0, 1\] \(an accuracy\)")]:
        with pytest.raises(ConfigError, match=message):
            task_config("palindrome", tmp_path, stop_at=stop)
