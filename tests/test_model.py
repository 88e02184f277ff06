"""Model API (SPEC 0.1): step == forward for any split into chunks, caches, generate."""
import pytest
import torch

from model import GPT, ModelConfig


def make_model(layers, pattern=None, n_layer=3, d_model=32, vocab=61, **extra):
    cfg = ModelConfig.from_dict({"vocab_size": vocab, "d_model": d_model, "n_layer": n_layer,
                                 "pattern": pattern or list(layers), "layers": layers, **extra})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # sinks start at 0; make them matter
        for m in model.modules():
            if getattr(m, "sinks", None) is not None:
                m.sinks.normal_()
    return model


def check_step_equals_forward(model, T=41, B=2, seed=0, splits=None):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        ref, _ = model(idx)
    if splits is None:  # random chunk sizes, with several 1-token decode steps
        splits, left = [], T
        while left:
            t = min(left, [1, 1, 2, 5, 17][int(torch.randint(0, 5, (1,), generator=g))])
            splits.append(t)
            left -= t
    cache = model.new_cache(B, T)
    outs, pos = [], 0
    for t in splits:
        outs.append(model.step(idx[:, pos:pos + t], cache))
        pos += t
    diff = (torch.cat(outs, 1) - ref).abs().max().item()
    assert diff <= 1e-4, f"step vs forward max abs diff {diff} (splits {splits})"
    return cache


ATTN = {
    "mha": {"kind": "attn", "n_heads": 4},
    "gqa": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2},
    "mqa": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1},
    "nope": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "rope": False},
    "window": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "window": 6},
    "sinks": {"kind": "attn", "n_heads": 4, "sinks": True},
    "window_sinks": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1, "window": 5, "sinks": True},
    "qk_norm": {"kind": "attn", "n_heads": 2, "head_dim": 24, "qk_norm": True, "window": 1},
}


@pytest.mark.parametrize("name", list(ATTN))
@pytest.mark.parametrize("seed", [0, 1])
def test_step_equals_forward_attention(name, seed):
    check_step_equals_forward(make_model({name: ATTN[name]}), seed=seed)


def test_step_equals_forward_hybrid_pattern():
    layers = {"local": ATTN["window_sinks"], "global": ATTN["gqa"]}
    model = make_model(layers, pattern=["local", "local", "global"], n_layer=6)
    for seed in range(3):
        check_step_equals_forward(model, T=53, seed=seed)
    check_step_equals_forward(model, T=53, splits=[53])
    check_step_equals_forward(model, T=53, splits=[1] * 53)


def test_ring_buffer_bytes_stay_constant_past_the_window():
    model = make_model({"w": ATTN["window_sinks"]}, n_layer=2)
    cache = model.new_cache(1, 10_000)
    start = cache.nbytes()
    assert start == 2 * 2 * 5 * 1 * 8 * 4  # layers * (K, V) * window * Hkv * D * fp32
    for _ in range(20):
        model.step(torch.randint(0, 61, (1, 1)), cache)
    assert cache.nbytes() == start
    global_model = make_model({"g": ATTN["gqa"]}, n_layer=1)
    assert global_model.new_cache(1, 100).nbytes() == 2 * 100 * 2 * 8 * 4


def test_global_cache_overflow_is_a_clear_error():
    model = make_model({"g": ATTN["gqa"]}, n_layer=1)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="exceeds the cache"):
        model.step(torch.zeros(1, 5, dtype=torch.long), cache)


def test_generate_uses_the_cache_and_matches_greedy_forward():
    model = make_model({"local": ATTN["window_sinks"], "global": ATTN["gqa"]})
    idx = torch.randint(0, 61, (2, 7))
    out = model.generate(idx, 12, temperature=0)
    assert out.shape == (2, 19)
    seq = idx
    for _ in range(12):  # greedy without a cache
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_sampling_options():
    model = make_model({"g": ATTN["gqa"]})
    idx = torch.randint(0, 61, (3, 4))
    g = torch.Generator().manual_seed(0)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):  # both reduce to greedy
        out = model.generate(idx, 5, temperature=1.0, generator=g, **kw)
        assert torch.equal(out, model.generate(idx, 5, temperature=0))
    out = model.generate(idx, 5, temperature=1.0, top_k=5, top_p=0.9, generator=g)
    assert out.shape == (3, 9) and out.max() < 61


def test_forward_loss_and_ignore_index():
    model = make_model({"g": ATTN["gqa"]})
    idx = torch.randint(0, 61, (2, 9))
    targets = idx.clone()
    targets[:, :5] = -1
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 9, 61)
    ref = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, 61), targets[:, 5:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    assert model(idx)[1] is None


def test_output_head_is_tied_and_residual_projections_scaled():
    model = make_model({"g": ATTN["gqa"]}, n_layer=8)
    assert model.lm_head.weight is model.wte.weight
    std = model.blocks[0].mixer.wo.weight.std().item()
    assert 0.5 * 0.02 / 4 < std < 1.5 * 0.02 / 4  # 0.02 / sqrt(2 * n_layer)
