"""cost.py against hand computations (GQA, windowed, KDA, MLA, MLA+DSA) and against the model."""
import os
from types import SimpleNamespace

import pytest

import cost
from config import from_raw
from model import GPT

D_MODEL = 64


def attn(**kw):
    c = dict(kind="attn", n_heads=4, n_kv_heads=2, head_dim=16, window=None, sinks=False, qk_norm=False)
    return SimpleNamespace(**{**c, **kw})


def test_gqa_layer_by_hand():
    c = cost.mixer_cost(attn(), D_MODEL, seq_len=8, ctx=100, dtype_bytes=2)
    params = 64 * 64 + 2 * 64 * 32 + 64 * 64                  # wq, wk, wv (2 kv heads of 16), wo
    assert c["params"] == params == 12288
    keys = (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8                 # causal: query t sees t+1 keys
    assert c["train_flops"] == 3 * (2 * params + 4 * 4 * 16 * keys) == 77184
    assert c["cache_bytes"] == 100 * 2 * 2 * 16 * 2 == 12800   # L * 2 (k, v) * Hkv * D * bytes
    assert c["cache_bytes_per_token"] == 128
    assert c["decode_flops"] == 2 * params + 4 * 4 * 16 * 100 == 50176
    assert c["decode_bytes"] == params * 2 + 12800 == 37376


def test_windowed_layer_by_hand():
    c = cost.mixer_cost(attn(window=4, sinks=True), D_MODEL, seq_len=8, ctx=100, dtype_bytes=2)
    assert c["params"] == 12288 + 4                            # + one sink logit per query head
    keys = (1 + 2 + 3 + 4 + 4 * 4) / 8                         # min(t+1, 4) keys
    assert c["train_flops"] == 3 * (2 * 12288 + 4 * 4 * 16 * keys)
    assert c["cache_bytes"] == 4 * 2 * 2 * 16 * 2 == 512       # L_eff = min(L, W) = 4
    assert cost.mixer_cost(attn(window=4), D_MODEL, 8, 10 ** 6)["cache_bytes"] == 512
    assert c["decode_flops"] == 2 * 12288 + 4 * 4 * 16 * 4


def test_kda_layer_by_hand():
    lc = SimpleNamespace(kind="kda", n_heads=2, head_dim=32, v_head_dim=32, conv_size=4, output_gate=True,
                         qk_norm=True)
    c = cost.mixer_cost(lc, D_MODEL, seq_len=128, ctx=100, dtype_bytes=2)
    ch = 2 * 64 + 64                                           # q, k, v channels (H*K, H*K, H*V)
    mm = 64 * ch + 64 * 2 + (64 * 32 + 32 * 64) + (64 * 32 + 32 * 64) + 64 * 64   # qkv, beta, gate, out gate, wo
    assert mm == 24704 and c["params"] == mm + ch * 4 + 2 + 64 + 32   # conv, A_log, dt_bias, o_norm
    head = 6 * 32 * 32 + 64 * (3 * 32 + 2 * 32) + 64 * 64 / 3  # chunk C = 64
    assert c["train_flops"] == pytest.approx(3 * (2 * mm + 2 * 4 * ch + 2 * head))
    state, conv = 2 * 32 * 32 * 4, 3 * ch * 2                  # fp32 state + 3 past inputs in bf16
    assert c["cache_bytes"] == state + conv == 9344
    assert cost.mixer_cost(lc, D_MODEL, 128, 10 ** 6)["cache_bytes"] == 9344   # independent of L
    assert c["decode_flops"] == 2 * mm + 2 * 4 * ch + 2 * 7 * 32 * 32
    assert c["decode_bytes"] == c["params"] * 2 + 2 * state + conv


def mla(dsa=None):
    return SimpleNamespace(kind="mla", n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8,
                           v_head_dim=16, rope=True, dsa=dsa)


def test_mla_layer_by_hand():
    c = cost.mixer_cost(mla(), D_MODEL, seq_len=8, ctx=100, dtype_bytes=2)
    q = 64 * 32 + 32 * 4 * (16 + 8)                            # W_dq, W_uq
    dkv, ukv, o = 64 * (32 + 8), 32 * 4 * (16 + 16), 4 * 16 * 64
    assert c["params"] == q + dkv + ukv + o + 32 + 32 == 15936  # + the two RMSNorms (q latent, kv latent)
    assert c["train_flops"] == 3 * (2 * (q + dkv + ukv + o) + 2 * 4 * (16 + 8 + 16) * 4.5) == 99552
    assert c["cache_bytes"] == 100 * (32 + 8) * 2 == 8000       # L * (d_c + d_rope) * bytes
    absorbed = 2 * 4 * 16 * 32 + 2 * 4 * 32 * 16                 # q_nope -> latent, latent -> v
    per_key = 2 * 4 * (32 + 8) + 2 * 4 * 32                      # scores + latent output
    assert c["decode_flops"] == 2 * (q + dkv + o) + absorbed + 100 * per_key == 89344
    assert c["decode_bytes"] == 15936 * 2 + 8000
    nope = cost.mixer_cost(SimpleNamespace(**{**vars(mla()), "rope": False}), D_MODEL, 8, 100)
    assert nope["cache_bytes"] == 100 * (32 + 8) * 2            # rope: false keeps the unrotated key part


def test_mla_dsa_layer_by_hand():
    dsa = {"n_heads": 2, "head_dim": 8, "rope_dim": 4, "top_k": 10}
    c = cost.mixer_cost(mla(dsa), D_MODEL, seq_len=8, ctx=100, dtype_bytes=2)
    idx = 32 * 2 * 8 + 64 * 8 + 64 * 2                           # q_I from c_q, k_I, head weights
    assert c["params"] == 15936 + idx + 2 * 8                   # + LayerNorm on k_I
    assert c["train_flops"] == 3 * (2 * 15872 + 1440 + 2 * idx + 2 * 2 * 8 * 4.5) == 106896
    assert c["cache_bytes"] == 100 * (32 + 8) * 2 + 100 * 8 * 2 == 9600    # + the indexer keys
    # decode: the indexer scores all 100 keys, the attention reads top_k = 10
    dec = 2 * 11776 + 4096 + 4096 + 10 * (2 * 4 * 40 + 2 * 4 * 32) + 2 * idx + 2 * 2 * 8 * 100
    assert c["decode_flops"] == dec == 43008
    assert c["decode_bytes"] == c["params"] * 2 + 10 * 80 + 1600
    # top_k >= every length: same attention FLOPs as dense MLA
    big = cost.mixer_cost(mla({**dsa, "top_k": 10 ** 9}), D_MODEL, 8, 100)
    assert big["decode_flops"] - c["decode_flops"] == 90 * (2 * 4 * 40 + 2 * 4 * 32)


def small_model(pattern, layers):
    return from_raw({"model": {"vocab_size": 50, "d_model": 32, "n_layer": len(pattern), "pattern": pattern,
                               "layers": layers, "mlp": {"hidden": 64}}}).model


@pytest.mark.parametrize("pattern,layers", [
    (["g", "w"], {"g": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True},
                  "w": {"kind": "attn", "n_heads": 4, "window": 8, "sinks": True}}),
    (["k", "d", "l"], {"k": {"kind": "kda", "n_heads": 2}, "d": {"kind": "gdn", "n_heads": 2},
                       "l": {"kind": "linear", "n_heads": 2, "output_gate": False, "conv_size": 0}}),
])
def test_params_and_cache_match_the_model(pattern, layers):
    cfg = small_model(pattern, layers)
    model = GPT(cfg)
    assert cost.num_params(cfg) == model.num_params()
    for L in (5, 40):  # fp32 caches: dtype_bytes=4 must match what new_cache allocates
        assert cost.cache_bytes(cfg, L, dtype_bytes=4) == model.new_cache(1, L).nbytes()


def test_report_and_cli(capsys):
    cfg = small_model(["k", "g"], {"k": {"kind": "kda", "n_heads": 2}, "g": {"kind": "attn", "n_heads": 2}})
    text = cost.report(cfg, 64, 4096)
    assert "k (kda)" in text and "g (attn)" in text and "total" in text and "memory" in text
    assert cost.train_flops_per_token(cfg, 64) > 6 * (cost.num_params(cfg) - 50 * 32)
    flops, nbytes, t = cost.decode_cost(cfg, 4096)
    assert t == max(flops / 989e12, nbytes / 4.8e12)
    assert cost.main(["configs/kimi_linear.yaml"]) == 0
    assert "total" in capsys.readouterr().out
    assert cost.main(["configs/kimi_linear.yaml", "--model.n_layerz=3"]) == 2


@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear", "gpt_oss", "deepseek_v32"])
def test_miniatures_params_and_cache_bytes_equal_the_models(name):
    """The published layouts (MoE, grouped GDN value heads, gated/partial-RoPE/biased attention, NoPE MLA
    keeping its rope key part, DSA, untied heads): cost.py's counts are the model's own."""
    import yaml
    from config import ROOT
    from model import ModelConfig
    with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as f:
        cfg = ModelConfig.from_dict(yaml.safe_load(f)["model"])
    model = GPT(cfg)
    assert cost.num_params(cfg) == model.num_params()
    assert cost.cache_bytes(cfg, 300, dtype_bytes=4) == model.new_cache(1, 300).nbytes()
