"""evals.py: StreamingLLM decode loop against forward, MQAR distance buckets, needle, length, CLI."""
import json

import numpy as np
import pytest
import torch

import evals
from config import from_raw
from data.mqar import mqar_batch
from model import GPT


def make(pattern, layers, vocab=40, seq_len=32, seed=0):
    cfg = from_raw({"model": {"vocab_size": vocab, "d_model": 32, "n_layer": len(pattern), "pattern": pattern,
                              "layers": layers, "mlp": {"hidden": 64}},
                    "data": {"kind": "mqar", "n_pairs": 4}, "train": {"seq_len": seq_len, "batch_size": 4}})
    torch.manual_seed(seed)
    model = GPT(cfg.model).eval()
    with torch.no_grad():  # larger weights than the init so attention is far from uniform
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1)
            elif p.dim() == 2:
                p.mul_(8)
    return model, cfg


GLOBAL = {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True, "sinks": True}


@pytest.mark.parametrize("pattern,layers", [
    (["g", "g"], {"g": GLOBAL}),
    (["k", "g", "w"], {"k": {"kind": "kda", "n_heads": 2}, "g": {**GLOBAL, "sinks": False},
                       "w": {"kind": "attn", "n_heads": 2, "window": 5}}),
])
def test_streaming_full_cache_equals_forward(pattern, layers):
    model, _ = make(pattern, layers)
    x = torch.randint(0, 40, (2, 12))
    ref = model(x)[0]
    for budget in (None, 12):  # a budget that never evicts keeps absolute positions
        assert (evals.streaming_logits(model, x, budget, 4) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("n_sinks", [0, 2])
def test_streaming_eviction_reassigns_positions(n_sinks):
    """One layer: keys are cached before RoPE and depend on their token only, so decoding with an
    evicting cache equals a forward over exactly the kept tokens at positions 0..n (StreamingLLM)."""
    model, _ = make(["g"], {"g": GLOBAL})
    x = torch.randint(0, 40, (2, 11))
    budget = 6
    got = evals.streaming_logits(model, x, budget, n_sinks)
    for t in (8, 10):
        keep = list(range(n_sinks)) + list(range(t + 1 - (budget - n_sinks), t + 1))
        ref = model(x[:, keep])[0][:, -1]
        assert (got[:, t] - ref).abs().max() < 1e-4
    assert (evals.streaming_logits(model, x, budget, n_sinks)[:, :budget] - model(x[:, :budget])[0]).abs().max() < 1e-4


def test_streaming_zero_sink_values():
    """sink_values=False: once the cache evicts, the kept first tokens draw attention but write nothing.
    It changes only the tokens past the budget, and is not the window alone; where the first tokens'
    values are zero anyway (their embedding zeroed: RMSNorm gives 0, no biases) it changes nothing."""
    model, _ = make(["g"], {"g": GLOBAL})
    x = torch.randint(1, 40, (2, 12))
    budget, n_sinks = 6, 2
    kept, window = (evals.streaming_logits(model, x, budget, s) for s in (n_sinks, 0))
    zero = evals.streaming_logits(model, x, budget, n_sinks, sink_values=False)
    assert (zero[:, :budget] - kept[:, :budget]).abs().max() < 1e-5    # token `budget` is the first to evict
    assert (zero[:, budget:] - kept[:, budget:]).abs().max() > 1e-2
    assert (zero[:, budget:] - window[:, budget:]).abs().max() > 1e-2
    with torch.no_grad():
        model.wte.weight[0] = 0
    x[:, :n_sinks] = 0
    kept = evals.streaming_logits(model, x, budget, n_sinks)
    every = {0: torch.ones(4, dtype=torch.bool)}
    for heads in (None, every):
        assert (evals.streaming_logits(model, x, budget, n_sinks, heads, sink_values=False) - kept).abs().max() < 1e-5


def test_streaming_keep_heads_selects_each_heads_cache():
    """keep_heads: every head = sinks + window, none = window only; with the other heads' output
    columns zeroed, keeping one head's first tokens equals the sinks + window decode, and not keeping
    them equals the window-only decode (GQA: heads 0 and 1 share a kv head)."""
    model, _ = make(["g", "g"], {"g": GLOBAL})
    x = torch.randint(0, 40, (2, 14))
    budget, n_sinks = 6, 2
    sinks, window = (evals.streaming_logits(model, x, budget, s) for s in (n_sinks, 0))
    every = {i: torch.ones(4, dtype=torch.bool) for i in (0, 1)}
    assert (evals.streaming_logits(model, x, budget, n_sinks, every) - sinks).abs().max() < 1e-5
    assert (evals.streaming_logits(model, x, budget, n_sinks, {}) - window).abs().max() < 1e-5
    assert (sinks - window).abs().max() > 1e-2                       # the two policies differ here
    D = model.blocks[0].mixer.cfg.head_dim
    with torch.no_grad():
        for b in model.blocks:
            b.mixer.wo.weight[:, D:] = 0                              # only head 0 reaches the residual
    sinks, window = (evals.streaming_logits(model, x, budget, s) for s in (n_sinks, 0))
    head0 = {i: torch.tensor([True, False, False, False]) for i in (0, 1)}
    assert (evals.streaming_logits(model, x, budget, n_sinks, head0) - sinks).abs().max() < 1e-5
    others = {i: ~head0[i] for i in (0, 1)}
    assert (evals.streaming_logits(model, x, budget, n_sinks, others) - window).abs().max() < 1e-5


def test_eval_streaming_sink_heads_spans_window_to_sinks():
    """sink_heads = every head gives the sinks + window perplexity, and the picked heads are those
    with the largest share on position 0."""
    model, cfg = make(["g", "g"], {"g": GLOBAL}, seq_len=16)
    out = evals.eval_streaming(model, cfg, factor=1, budget=8, n_seqs=2, sink_heads=8)
    assert abs(out["ppl_sinks_heads"] - out["ppl_sinks+window"]) < 1e-4 * out["ppl_sinks+window"]
    keep = evals._top_sink_heads(model, cfg, 3)
    shares = evals.layer_attention_shares(model, cfg, [0, 1], skip=8)
    picked = sorted(shares[i]["key0_heads"][h] for i in (0, 1) for h in range(4) if keep[i][h])
    rest = [shares[i]["key0_heads"][h] for i in (0, 1) for h in range(4) if not keep[i][h]]
    assert sum(k.sum().item() for k in keep.values()) == 3 and picked[0] >= max(rest)


def test_eval_streaming_reports_three_policies():
    model, cfg = make(["g"], {"g": GLOBAL}, seq_len=16)
    out = evals.eval_streaming(model, cfg, factor=1, budget=8, n_seqs=2)
    assert set(out) == {"ppl_full", "ppl_window", "ppl_sinks+window"} and all(v > 0 for v in out.values())
    part = evals.run_eval("streaming", model, cfg, {"factor": 1, "budget": 8, "n_seqs": 2, "full": False})
    assert part == {k: v for k, v in out.items() if k != "ppl_full"}     # the same streams, no full cache
    with pytest.raises(ValueError, match=r"evals.streaming.full: must be true or false \(got 1\)"):
        evals.run_eval("streaming", model, cfg, {"full": 1})
    kda, cfg2 = make(["k"], {"k": {"kind": "kda", "n_heads": 2}})
    with pytest.raises(ValueError, match="evicts only from global softmax attention layers .kind attn without a window.; this model.s layers are kda"):
        evals.eval_streaming(kda, cfg2)


def test_attention_shares_against_a_loop():
    """The share of attention on key 0 / the first keys / the learned sink, recomputed query by query."""
    torch.manual_seed(0)
    B, T, Hq, Hkv, D, skip = 2, 10, 4, 2, 8, 3
    q, k, sinks = torch.randn(B, T, Hq, D), torch.randn(B, T, Hkv, D), torch.randn(Hq)
    for s in (None, sinks):
        got = evals.attention_shares(q, k, 0.5, s, n_first=2, skip=skip)
        key0 = first = learned = 0.0
        heads = [0.0] * Hq
        for b in range(B):
            for h in range(Hq):
                for t in range(skip, T):
                    logits = torch.cat([(k[b, :t + 1, h // 2] @ q[b, t, h]) * 0.5] + ([s[h:h + 1]] if s is not None else []))
                    p = logits.softmax(0)
                    key0, first = key0 + p[0].item(), first + p[:2].sum().item()
                    heads[h] += p[0].item() / (B * (T - skip))
                    learned += p[t + 1].item() if s is not None else 0.0
        n = B * Hq * (T - skip)
        assert abs(got["key0"] - key0 / n) < 1e-6 and abs(got["first"] - first / n) < 1e-6
        assert abs(got["learned"] - learned / n) < 1e-6
        assert len(got["key0_heads"]) == Hq and all(abs(a - b) < 1e-6 for a, b in zip(got["key0_heads"], heads))
    zero = evals.attention_shares(torch.zeros(B, T, Hq, D), k, 0.5, None, skip=skip)   # uniform attention
    assert abs(zero["key0"] - zero["uniform"]) < 1e-6


def test_eval_attention_sinks_reports_every_global_layer():
    model, cfg = make(["k", "g", "w", "g"], {"k": {"kind": "kda", "n_heads": 2}, "g": GLOBAL,
                                             "w": {"kind": "attn", "n_heads": 2, "window": 5}})
    out = evals.run_eval("attention_sinks", model, cfg, {"n_seqs": 2, "skip": 4})
    assert {"key0_L1", "first_L1", "learned_L1", "key0_L3", "key0_mean", "uniform"} <= set(out)
    assert not any(k.endswith(("_L0", "_L2")) for k in out)
    assert all(0 <= v <= 1 for v in out.values()) and out["learned_L1"] > 0
    for i in (1, 3):                                  # the strongest head holds at least the layer's mean
        assert out[f"key0_L{i}"] - 1e-6 <= out[f"key0_maxhead_L{i}"] <= 1
    assert out["sink_heads"] == out["sink_heads_L1"] == out["sink_heads_L3"] == 0.0  # untrained: no head parks 30%
    every = evals.run_eval("attention_sinks", model, cfg, {"n_seqs": 2, "skip": 4, "head_threshold": 0.0})
    assert every["sink_heads"] == every["sink_heads_L1"] == every["sink_heads_L3"] == 1.0  # threshold 0: every head
    shares = evals.layer_attention_shares(model, cfg, [1, 3], n_seqs=2, skip=4)
    threshold = sorted(shares[1]["key0_heads"])[1] - 1e-7    # under layer 1's second smallest head: 3 of 4 count
    some = evals.run_eval("attention_sinks", model, cfg, {"n_seqs": 2, "skip": 4, "head_threshold": threshold})
    in_3 = sum(h > threshold for h in shares[3]["key0_heads"]) / 4
    assert some["sink_heads_L1"] == 3 / 4 and some["sink_heads_L3"] == in_3 and some["sink_heads"] == (3 / 4 + in_3) / 2
    with pytest.raises(ValueError, match="evals.attention_sinks.skip: must be below the training length 32"):
        evals.run_eval("attention_sinks", model, cfg, {"skip": 32})
    kda, cfg2 = make(["k"], {"k": {"kind": "kda", "n_heads": 2}})
    with pytest.raises(ValueError, match="no global softmax attention layer"):
        evals.eval_attention_sinks(kda, cfg2)


def test_mqar_eval_buckets_every_query():
    model, cfg = make(["g"], {"g": GLOBAL})
    out = evals.eval_mqar(model, cfg, n_batches=2, batch_size=8)
    assert sum(r["n"] for r in out["by_distance"]) == 2 * 8 * 4          # every query counted once
    assert all(r["lo"] * 2 == r["hi"] for r in out["by_distance"])
    assert abs(out["acc"] - sum(r["acc"] * r["n"] for r in out["by_distance"]) / 64) < 1e-9
    _, _, dist = mqar_batch(8, 32, 4, 40, [7, 2 * 10 ** 9])
    assert dist.max() < 32 and dist[dist > 0].min() >= 1


def test_needle_and_length_shapes():
    model, cfg = make(["k", "w"], {"k": {"kind": "kda", "n_heads": 2}, "w": {"kind": "attn", "n_heads": 2, "window": 4}})
    out = evals.eval_needle(model, cfg, factors=(1, 2), depths=(0.0, 1.0), n_trials=3)
    assert {"acc@1x", "acc@2x"} <= set(out) and len(out["grid"]) == 4
    assert {g["context"] for g in out["grid"]} == {32, 64}
    out = evals.eval_length(model, cfg, factor=2, n_seqs=3, n_buckets=4)
    assert out["by_position"][0]["lo"] == 0 and out["by_position"][-1]["hi"] <= 64  # empty buckets are left out
    assert np.isfinite(out["loss@1x"]) and np.isfinite(out["loss@2x"])
    with pytest.raises(ValueError, match="unknown option"):
        evals.run_eval("mqar", model, cfg, {"n_batchez": 1})


def test_text_needle_scores_exact_digits(tmp_path, monkeypatch):
    """A byte-level 'model' that copies the digits after the planted fact scores 1; a random one 0."""
    cfg = from_raw({"model": {"vocab_size": 257, "d_model": 16, "n_layer": 1, "pattern": ["g"],
                              "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 32}},
                    "train": {"seq_len": 64}})
    monkeypatch.setattr(evals, "_val_tokens", lambda cfg: (np.frombuffer(b"x = 1\n" * 500, np.uint8), 1.0))

    def oracle(model, prompt, n):
        out = []
        for row in prompt.tolist():
            text = bytes(row).decode()
            i = text.index("secret number is ") + len("secret number is ")
            out.append(list(text[i:i + n].encode()))
        return torch.tensor(out)
    monkeypatch.setattr(evals, "_greedy", oracle)
    out = evals.eval_needle(GPT(cfg.model), cfg, factors=(2,), depths=(0.5,), n_trials=3)
    assert out["acc@2x"] == 1.0 and out["grid"][0]["context"] == 128


def test_text_needle_starts_with_bos_for_bos_models(monkeypatch):
    """data.bos: the needle prompt opens with end-of-text, as the training rows do, and keeps its length."""
    prompts = {}
    for bos in (False, True):
        cfg = from_raw({"model": {"vocab_size": 257, "d_model": 16, "n_layer": 1, "pattern": ["g"],
                                  "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 32}},
                        "train": {"seq_len": 64}, "data": {"bos": bos}})
        monkeypatch.setattr(evals, "_val_tokens", lambda cfg: (np.frombuffer(b"x = 1\n" * 500, np.uint8), 256))

        def record(model, prompt, n, bos=bos):
            prompts[bos] = prompt
            return torch.zeros(prompt.shape[0], n, dtype=torch.long)
        monkeypatch.setattr(evals, "_greedy", record)
        evals.eval_needle(GPT(cfg.model), cfg, factors=(1,), depths=(0.0,), n_trials=2)
    assert prompts[False].shape == prompts[True].shape == (2, 64)
    assert (prompts[True][:, 0] == 256).all() and (prompts[False][:, 0] != 256).all()
    assert (prompts[True][:, -20:] == prompts[False][:, -20:]).all()        # the same query at the end


def test_cli(tmp_path, capsys):
    from train import save_checkpoint
    model, cfg = make(["g"], {"g": GLOBAL})
    save_checkpoint(str(tmp_path / "ckpt_1.pt"), {"model": model.state_dict(), "config": cfg.raw, "step": 1})
    assert evals.main(["mqar", "--ckpt", str(tmp_path), "--n_batches", "1", "--json"]) == 0
    assert "by_distance" in json.loads(capsys.readouterr().out)
    assert evals.main(["needle", "--ckpt", str(tmp_path), "--factors", "1", "--depths", "0.5", "--n_trials", "2"]) == 0
    assert "acc@1x" in capsys.readouterr().out
    assert evals.main(["mqar", "--ckpt", str(tmp_path / "nope")]) == 2


def test_kv_policies_and_task_options_are_checked_up_front():
    """Every eval has option rules (kv_policies takes policy names, the tasks their sizes)."""
    assert set(evals.OPTION_RULES) == set(evals.EVALS)
    evals.check_options("kv_policies", {"policies": ("h2o", "quest"), "budgets": (8, 16)})
    with pytest.raises(ValueError, match=r"evals.kv_policies.policies: must be one of streaming, h2o"):
        evals.check_options("kv_policies", {"policies": ("h3o",)})
    with pytest.raises(ValueError, match=r"evals.palindrome.n_batches: must be >= 1 \(got 0\)"):
        evals.check_options("palindrome", {"n_batches": 0})
