"""convert.py (SPEC 12): tiny random transformers models of each family (built in code, no download)
go in as project checkpoints and back out; logits agree to 1e-4 relative in fp32 and greedy
continuations are identical, both ways. Bad input: one line, exit 2, nothing written."""
import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a requirement: the interchange format)

import convert  # noqa: E402
from sample import load_model  # noqa: E402

V = 97
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, rms_norm_eps=1e-6,
            initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
HF_CONFIGS = {
    "llama": dict(BASE, model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "llama_bias": dict(BASE, model_type="llama", num_attention_heads=4, num_key_value_heads=4,
                       attention_bias=True, tie_word_embeddings=False),
    "qwen3": dict(BASE, model_type="qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                  tie_word_embeddings=False),
    "qwen3_next": dict(BASE, model_type="qwen3_next", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=0, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "kimi_linear": dict(BASE, model_type="kimi_linear", num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        linear_head_dim=8, linear_num_heads=4, mlp_layer_types=["dense"] * 4,
                        layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "qwen3_next_moe": dict(BASE, model_type="qwen3_next", num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                           linear_num_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                           shared_expert_intermediate_size=12, mlp_only_layers=[0], norm_topk_prob=False,
                           num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"]),
    "kimi_linear_moe": dict(BASE, model_type="kimi_linear", num_attention_heads=2, num_key_value_heads=2,
                            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                            linear_head_dim=8, linear_num_heads=2, num_hidden_layers=3,
                            mlp_layer_types=["dense", "sparse", "sparse"], num_local_experts=6,
                            num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=8,
                            routed_scaling_factor=2.446, n_group=1, topk_group=1,
                            layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "deepseek_v32": dict(BASE, model_type="deepseek_v32", num_attention_heads=2, num_key_value_heads=2,
                         q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                         index_n_heads=8, index_head_dim=8, index_topk=5, num_hidden_layers=3,
                         first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         moe_intermediate_size=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": dict(BASE, model_type="gpt_oss", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    swiglu_limit=0.5, tie_word_embeddings=False,  # a limit the clamp reaches; a window decode passes
                    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
    "qwen3_next_full_attention": dict(BASE, model_type="qwen3_next", num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=0, tie_word_embeddings=False, num_hidden_layers=2,
                                      layer_types=["full_attention"] * 2),
    "kimi_linear_q_lora": dict(BASE, model_type="kimi_linear", num_attention_heads=2, num_key_value_heads=2,
                               q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                               v_head_dim=6, linear_head_dim=8, linear_num_heads=2, num_hidden_layers=2,
                               mlp_layer_types=["dense"] * 2, layer_types=["full_attention", "linear_attention"]),
}


def tiny_hf_model(name, folder, seed=0, cfg=None):
    """A random transformers model of config HF_CONFIGS[name] (or cfg), every weight perturbed, saved to folder."""
    cfg = dict(cfg or HF_CONFIGS[name])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or "A_log" in n or n.endswith("_bias"):  # norms, biases, gates' constants, sinks
                p.add_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # the balancing bias: one that changes the routing
                b.normal_(0, 0.05)
    model.save_pretrained(folder)
    return model


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_greedy(model, idx, n):
    out = model.generate(idx, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[:, idx.shape[1]:]


@pytest.fixture
def no_index_ties(monkeypatch):
    """DSA's top-k under an exact tie of index scores is unspecified (torch.topk's order in transformers;
    ours takes the most recent key). A tie is exact when every index head's ReLU is 0, likely with a few
    index heads (1 in 2^H_I pairs), hence 8-16 here. The comparisons hold where no tie straddles a top-k
    boundary; this fixture fails the test if one did, rather than let it pass or fail by chance."""
    import model
    real, ties = model.topk_select, []

    def checked(scores, qpos, k):
        S = scores.shape[-1]
        if k < S:
            seen = scores.masked_fill(torch.arange(S)[None, None, :] > qpos[None, :, None], float("-inf"))
            top = seen.topk(k + 1, dim=-1).values
            ties.append(bool(((top[..., k - 1] == top[..., k]) & (top[..., k] > float("-inf"))).any()))
        return real(scores, qpos, k)
    monkeypatch.setattr(model, "topk_select", checked)
    yield
    assert not any(ties), "an exact tie of index scores at a top-k boundary: the comparison is by chance"


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_hf_and_back_matches_transformers(name, tmp_path, no_index_ties):
    hf = tiny_hf_model(name, tmp_path / "hf")
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    ours, _ = load_model(str(tmp_path / "ours"))
    idx = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits
        assert relative_error(ours(idx)[0], ref) <= 1e-4
    assert torch.equal(ours.generate(idx[:, :9], 8, temperature=0)[:, 9:], hf_greedy(hf, idx[:, :9], 8))

    assert convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert relative_error(back(idx).logits, ref) <= 1e-4
    for k, v in hf.state_dict().items():  # the round trip keeps every weight (to fp32 rounding of 1 + w)
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=1e-6)


def random_hf_config(seed):
    """One of HF_CONFIGS with its options drawn: head counts and widths, which layers are linear or full
    attention, which MLPs are MoE (leading dense layers only: what the project expresses), DSA's top-k and
    expert groups, the window, a tied or untied head. Every draw must convert."""
    r = random.Random(seed)
    name = r.choice(sorted(HF_CONFIGS))
    cfg = dict(HF_CONFIGS[name], hidden_size=r.choice([32, 48]))
    family, n = cfg["model_type"], r.choice([2, 3])
    if family != "kimi_linear":  # kimi_linear's head is always untied in transformers
        cfg["tie_word_embeddings"] = r.random() < .5
    if family in ("llama", "qwen3", "gpt_oss"):
        heads = r.choice([2, 4])  # transformers asks for a divisor of hidden_size here, head_dim or not
        cfg.update(num_attention_heads=heads, head_dim=r.choice([8, 12, 16]),
                   num_key_value_heads=r.choice([h for h in (1, 2, 4) if heads % h == 0]))
    if family == "llama":
        cfg["attention_bias"] = r.random() < .5
    if family == "gpt_oss":
        cfg.update(sliding_window=r.choice([2, 4, 7]), num_local_experts=4, num_experts_per_tok=r.choice([1, 2]))
    if family == "qwen3_next":
        key_heads = r.choice([1, 2])
        cfg.update(num_hidden_layers=n, linear_num_key_heads=key_heads,
                   linear_num_value_heads=key_heads * r.choice([1, 2, 3]), linear_key_head_dim=r.choice([4, 8]),
                   linear_value_head_dim=r.choice([4, 6, 8]), linear_conv_kernel_dim=r.choice([2, 4]),
                   head_dim=r.choice([8, 16]),
                   num_attention_heads=r.choice([2, 4]), num_key_value_heads=r.choice([1, 2]),
                   layer_types=[r.choice(["linear_attention", "full_attention"]) for _ in range(n)])
        if cfg["num_experts"]:
            cfg.update(mlp_only_layers=list(range(r.choice([0, 1]))), norm_topk_prob=r.random() < .5)
    if family == "kimi_linear":
        heads = r.choice([2, 4])
        cfg.update(num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=heads,
                   linear_num_heads=r.choice([1, 2, 4]), linear_head_dim=r.choice([4, 8]),
                   q_lora_rank=r.choice([None, 12]), qk_rope_head_dim=r.choice([2, 4]), v_head_dim=r.choice([6, 8]),
                   layer_types=[r.choice(["linear_attention", "full_attention"]) for _ in range(n)])
        dense = r.choice(range(n + 1)) if "num_local_experts" in cfg else n
        cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n - dense)
    if family == "deepseek_v32":
        heads = r.choice([2, 4])
        n_group, topk_group = r.choice([(1, 1), (2, 1), (4, 2)])
        cfg.update(num_attention_heads=heads, num_key_value_heads=heads, index_topk=r.choice([3, 5, 30]),
                   first_k_dense_replace=r.choice([0, 1, 3]), n_group=n_group, topk_group=topk_group)
    return name, cfg


@pytest.mark.parametrize("seed", [*range(12), *(pytest.param(s, marks=pytest.mark.slow) for s in range(12, 200))])
def test_random_hf_configs_convert_both_ways(seed, tmp_path, no_index_ties):
    """from-hf gives transformers' logits, to-hf gives back every weight and the logits (logits without
    transformers' cache: its generate fails on a model of linear-attention layers only)."""
    name, cfg = random_hf_config(seed)
    hf = tiny_hf_model(name, tmp_path / "hf", seed=seed, cfg=cfg)
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0, cfg
    ours, _ = load_model(str(tmp_path / "ours"))
    idx = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(idx, use_cache=False).logits
        assert relative_error(ours(idx)[0], ref) <= 1e-4, cfg
    assert convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0, cfg
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        assert relative_error(back(idx, use_cache=False).logits, ref) <= 1e-4, cfg
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=1e-6)


OUR_CONFIGS = {
    "llama": {"layers": {"a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}}, "pattern": ["a"]},
    "llama_bias": {"layers": {"a": {"kind": "attn", "n_heads": 4, "bias": True, "rope_theta": 500.0}},
                   "pattern": ["a"], "tie_embeddings": False},
    "qwen3": {"layers": {"a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1, "head_dim": 12, "qk_norm": True}},
              "pattern": ["a"], "tie_embeddings": False},
    "qwen3_next": {"layers": {"g": {"kind": "gdn", "n_heads": 2, "n_v_heads": 4, "head_dim": 8},
                              "a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "qk_norm": True,
                                    "output_gate": True, "rope_fraction": 0.5}},
                   "pattern": ["g", "g", "a"], "tie_embeddings": False},
    "kimi_linear": {"layers": {"k": {"kind": "kda", "n_heads": 2, "head_dim": 8},
                               "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8,
                                     "qk_rope_dim": 4, "v_head_dim": 8, "rope": False}},
                    "pattern": ["k", "m"]},
    "qwen3_next_moe": {"layers": {"g": {"kind": "gdn", "n_heads": 2, "head_dim": 8},
                                  "a": {"kind": "attn", "n_heads": 2, "head_dim": 8, "qk_norm": True,
                                        "output_gate": True, "rope_fraction": 0.25}},
                       "pattern": ["g", "a"], "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8,
                                                      "n_shared": 1, "shared_hidden": 16, "shared_gate": True}},
    "qwen3_next_gated_attention_only": {"layers": {"a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
                                                         "qk_norm": True, "output_gate": True,
                                                         "rope_fraction": 0.25}},
                                        "pattern": ["a"], "tie_embeddings": False},
    "deepseek_v32": {"layers": {"m": {"kind": "mla", "n_heads": 2, "q_lora_rank": 12, "kv_lora_rank": 16,
                                      "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 8,
                                      "dsa": {"n_heads": 16, "head_dim": 8, "rope_dim": 4, "top_k": 6}}},
                     "pattern": ["m"], "tie_embeddings": False,
                     "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8, "n_shared": 1, "n_group": 2,
                             "topk_group": 1, "router": "sigmoid", "routed_scale": 2.5, "first_k_dense": 1}},
    "gpt_oss": {"layers": {"s": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "window": 4, "sinks": True,
                                 "bias": True},
                           "f": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "sinks": True, "bias": True}},
                "pattern": ["s", "f"], "tie_embeddings": False,
                "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 16, "bias": True,
                        "expert_act": "swiglu_clamped", "swiglu_limit": 0.1}},
    "kimi_linear_moe": {"layers": {"k": {"kind": "kda", "n_heads": 2, "head_dim": 8},
                                   "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8,
                                         "qk_rope_dim": 4, "v_head_dim": 8, "rope": False}},
                        "pattern": ["k", "m"], "tie_embeddings": False,
                        "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8, "n_shared": 1,
                                "router": "sigmoid", "routed_scale": 2.5, "first_k_dense": 1, "dense_hidden": 24}},
    "kimi_linear_moe_groups": {"layers": {"k": {"kind": "kda", "n_heads": 2, "head_dim": 8},
                                          "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8,
                                                "qk_rope_dim": 4, "v_head_dim": 8, "rope": False}},
                               "pattern": ["k", "m"], "tie_embeddings": False,
                               "mlp": {"kind": "moe", "n_experts": 8, "top_k": 2, "hidden": 8, "n_shared": 2,
                                       "router": "sigmoid", "routed_scale": 2.446, "n_group": 4, "topk_group": 2,
                                       "norm_topk": False}},
}


def our_checkpoint(folder, model_cfg, **train):
    """A checkpoint of a fresh random project model (what train.py writes, minus optimizer state)."""
    from config import from_raw
    raw = {"model": {"vocab_size": V, "d_model": 32, "n_layer": 3, "mlp": {"hidden": 48}, **model_cfg},
           "data": {"kind": "mqar", "n_pairs": 2}, "train": {"out_dir": str(folder), **train}}
    torch.manual_seed(0)
    model = convert.GPT(from_raw(raw).model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or n.endswith((".b1", ".b2", ".b3")):  # norms, biases, sinks
                p.add_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("router_bias"):
                b.normal_(0, 0.05)
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict(), "step": 7, "config": raw}, os.path.join(folder, "ckpt_7.pt"))
    return model.eval()


@pytest.mark.parametrize("name", list(OUR_CONFIGS))
def test_to_hf_matches_the_project_model(name, tmp_path, no_index_ties):
    ours = our_checkpoint(tmp_path / "run", OUR_CONFIGS[name])
    assert convert.main(["to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert hf.config.model_type == max((f for f in convert.FAMILIES if name == f or name.startswith(f + "_")), key=len)
    idx = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(hf(idx).logits, ours(idx)[0]) <= 1e-4
    assert torch.equal(ours.generate(idx[:, :7], 8, temperature=0)[:, 7:], hf_greedy(hf, idx[:, :7], 8))


def test_converted_checkpoint_trains_a_step_and_samples(tmp_path):
    from config import load_config
    from train import train
    tiny_hf_model("qwen3_next", tmp_path / "hf")
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "in")]) == 0
    converted, _ = load_model(str(tmp_path / "in"))
    ckpt = torch.load(tmp_path / "in" / "ckpt_0.pt", weights_only=True)
    import yaml
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": ckpt["config"]["model"], "data": {"kind": "mqar", "n_pairs": 2}}))
    cfg = load_config(str(path), [f"--train.out_dir={tmp_path / 'run'}", f"--train.init_from={tmp_path / 'in'}",
                                  "--train.max_steps=1", "--train.batch_size=2", "--train.seq_len=16",
                                  "--train.eval_batches=1", "--train.sample_tokens=0", "--train.warmup_steps=0"])
    train(cfg, quiet=True)
    trained, _ = load_model(str(tmp_path / "run"))
    a, b = converted.state_dict(), trained.state_dict()
    moved = [k for k in a if not torch.equal(a[k], b[k])]
    assert moved and all((a[k] - b[k]).abs().max() < 0.1 for k in a)  # one step from the converted weights
    out = trained.generate(torch.tensor([[1, 2, 3]]), 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8)


def run_cli(args, capsys):
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    code = convert.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_hf_model("llama", hf_dir)
    from safetensors.torch import load_file, save_file
    weights = load_file(hf_dir / "model.safetensors")
    cases = []
    # a missing weight
    bad = tmp_path / "missing"
    bad.mkdir()
    (bad / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"},
              bad / "model.safetensors")
    cases.append((bad, "error: missing weight model.layers.1.self_attn.k_proj.weight"))
    # a shape that does not fit
    bad = tmp_path / "shape"
    bad.mkdir()
    (bad / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({**weights, "model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)}, bad / "model.safetensors")
    cases.append((bad, "error: weight model.layers.0.mlp.up_proj.weight has shape (40, 32); config.json implies (48, 32)"))
    # an unsupported family
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    cases.append((bad, "error: " + str(bad / "config.json") + ": model_type='gpt2' is not a family"))
    for folder, message in cases:
        code, err = run_cli(["from-hf", str(folder), "--out", str(tmp_path / "out")], capsys)
        assert code == 2 and err.startswith(message) and "\n" not in err, err
        assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("model_cfg, message", [
    ({"layers": {"a": {"kind": "attn", "n_heads": 4, "window": 8}}, "pattern": ["a"]},
     "error: model.layers.a.window=8: llama has no sliding-window layers"),
    ({"layers": {"a": {"kind": "attn", "n_heads": 4}, "b": {"kind": "attn", "n_heads": 2}}, "pattern": ["a", "b"]},
     "error: model.layers.b: llama has one attn layer config for all layers"),
    ({"layers": {"g": {"kind": "gdn", "n_heads": 2}, "a": {"kind": "attn", "n_heads": 4, "qk_norm": True}},
      "pattern": ["g", "a"]}, "error: model.layers.a.output_gate=False: qwen3_next has no attention without"),
    ({"layers": {"k": {"kind": "kda", "n_heads": 2}, "a": {"kind": "attn", "n_heads": 4}}, "pattern": ["k", "a"]},
     "error: model.layers.a.kind='attn': no transformers family mixes attn + kda layers"),
    ({"layers": {"k": {"kind": "kda", "n_heads": 2},
                 "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
                       "v_head_dim": 8}}, "pattern": ["k", "m"]},
     "error: model.layers.m.rope=true: kimi_linear's MLA has no positions"),
    ({"layers": {"m": {"kind": "mla", "n_heads": 2, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_dim": 8,
                       "qk_rope_dim": 4, "v_head_dim": 8}}, "pattern": ["m"]},
     "error: model.layers.m.dsa: null; deepseek_v32 has the DSA indexer in every layer"),
    ({"layers": {"m": {"kind": "mla", "n_heads": 2, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_dim": 8,
                       "qk_rope_dim": 4, "v_head_dim": 8, "dsa": {"n_heads": 4, "head_dim": 8, "rope_dim": 2}}},
      "pattern": ["m"]}, "error: model.layers.m.dsa.rope_dim=2: deepseek_v32's indexer rotates qk_rope_dim=4"),
    ({"layers": {"m": {"kind": "mla", "n_heads": 2, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_dim": 8,
                       "qk_rope_dim": 4, "v_head_dim": 8, "dsa": {"n_heads": 4, "head_dim": 8, "rope_dim": 4,
                                                                 "stage": "dense_warmup"}}},
      "pattern": ["m"]}, "error: model.layers.m.dsa.stage='dense_warmup': deepseek_v32 attends to the indexer's top-k"),
    ({"layers": {"k": {"kind": "kda", "n_heads": 2},
                 "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
                       "v_head_dim": 8, "rope": False}}, "pattern": ["k", "m"],
      "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8, "n_shared": 1, "router": "sigmoid",
              "bias": True}}, "error: model.mlp.bias=true: kimi_linear's router and experts have no biases"),
    ({"layers": {"a": {"kind": "attn", "n_heads": 4, "sinks": True}}, "pattern": ["a"]},
     "error: model.mlp.kind='swiglu': gpt_oss has an MoE in every layer (no dense MLP)"),
    ({"layers": {"a": {"kind": "attn", "n_heads": 4, "sinks": True}}, "pattern": ["a"],
      "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8}}, "error: model.mlp.bias=False: gpt_oss's MoE "
     "has bias=True"),
    ({"layers": {"s": {"kind": "attn", "n_heads": 4, "window": 4, "sinks": True},
                 "f": {"kind": "attn", "n_heads": 2, "sinks": True}}, "pattern": ["s", "f"],
      "mlp": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 8, "bias": True, "expert_act": "swiglu_clamped"}},
     "error: model.layers.f: gpt_oss's layers differ only in their window; it differs from model.layers.s in more"),
])
def test_config_no_family_expresses_is_refused(model_cfg, message, tmp_path, capsys):
    our_checkpoint(tmp_path / "run", model_cfg)
    code, err = run_cli(["to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")], capsys)
    assert code == 2 and err.startswith(message) and "\n" not in err, err
    assert not os.path.exists(tmp_path / "hf")


def test_gpt_oss_with_yarn_rope_is_refused(tmp_path, capsys):
    """gpt-oss as published stretches RoPE with YaRN (factor 32); the project has plain RoPE only."""
    cfg = {k: v for k, v in HF_CONFIGS["gpt_oss"].items() if k not in ("model_type", "rope_parameters")}
    transformers.GptOssConfig(**cfg).save_pretrained(tmp_path / "hf")
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.ones(32)}, tmp_path / "hf" / "model.safetensors")
    code, err = run_cli(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err == "error: config.json rope_parameters.rope_type='yarn': only default RoPE converts " \
        "(no scaling)", err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name", ["kimi_linear", "qwen3_next", "gpt_oss", "deepseek_v32"])
def test_shipped_miniature_converts_to_its_family(name, tmp_path, no_index_ties):
    """configs/<name>.yaml is that transformers family (no option refused) and the same model there."""
    import yaml
    from config import ROOT
    with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as f:
        model_cfg = yaml.safe_load(f)["model"]
    if name == "deepseek_v32":  # the stage the two-stage recipe ends in
        model_cfg["layers"]["mla"]["dsa"]["stage"] = "sparse"
    ours = our_checkpoint(tmp_path / "run", model_cfg)
    assert convert.main(["to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert hf.config.model_type == name
    idx = torch.randint(0, model_cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert relative_error(hf(idx).logits, ours(idx)[0]) <= 1e-4
    assert torch.equal(ours.generate(idx[:, :16], 8, temperature=0)[:, 16:], hf_greedy(hf, idx[:, :16], 8))


def test_multi_token_prediction_weights_are_skipped_and_only_they(tmp_path, capsys):
    """DeepSeek checkpoints carry their MTP module as one more layer, model.layers.{num_hidden_layers}."""
    from safetensors.torch import load_file, save_file
    tiny_hf_model("deepseek_v32", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**weights, "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}, tmp_path / "hf" / "model.safetensors")
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 0
    save_file({**weights, "model.layers.2.eh_proj.weight": torch.zeros(32, 64)}, tmp_path / "hf" / "model.safetensors")
    code, err = run_cli(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out2")], capsys)
    assert code == 2 and err == "error: weight model.layers.2.eh_proj.weight has no place in the project's " \
        "deepseek_v32 model", err


def test_trained_checkpoint_out_and_back_in_trains_and_samples(tmp_path, capsys):
    """A checkpoint train.py wrote (a sigmoid MoE whose balancing bias has moved) -> to-hf -> from-hf is
    the same model, weight for weight; train.init_from trains on from it and sample.py samples it."""
    import sample
    from config import from_raw
    from train import train
    model_cfg = dict(OUR_CONFIGS["kimi_linear_moe"], vocab_size=257, d_model=32, n_layer=3)
    raw = {"model": model_cfg, "data": {"kind": "stdlib"},
           "train": {"max_steps": 3, "batch_size": 2, "seq_len": 16, "warmup_steps": 0, "eval_batches": 1,
                     "sample_tokens": 0, "out_dir": str(tmp_path / "run")}}
    train(from_raw(raw), quiet=True)
    trained, _ = load_model(str(tmp_path / "run"))
    assert trained.blocks[1].mlp.router_bias.abs().max() > 0  # the balancing bias moved: it travels too
    assert convert.main(["to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    idx = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert relative_error(hf(idx).logits, trained(idx)[0]) <= 1e-4
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back, _ = load_model(str(tmp_path / "back"))
    a, b = trained.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    raw["train"].update(max_steps=1, init_from=str(tmp_path / "back"), out_dir=str(tmp_path / "ft"))
    train(from_raw(raw), quiet=True)
    tuned, _ = load_model(str(tmp_path / "ft"))
    c = tuned.state_dict()
    moved = [k for k in a if not torch.equal(a[k], c[k])]
    assert moved and all((a[k] - c[k]).abs().max() < 0.1 for k in a)  # one step from the converted weights
    capsys.readouterr()
    assert sample.main(["--ckpt", str(tmp_path / "back"), "--prompt", "def ", "--max_new_tokens", "6",
                        "--tokenizer", "bytes"]) == 0  # tokenizers are not converted: name it
    assert capsys.readouterr().out.startswith("def ")


def cli(*args):
    import subprocess
    import sys
    from config import ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_help_names_both_directions():
    r = cli("--help")
    assert r.returncode == 0 and "to-hf" in r.stdout and "from-hf" in r.stdout and "python convert.py" in r.stdout
    r = cli("from-hf", "--help")
    assert r.returncode == 0 and "--out" in r.stdout and r.stderr == ""


def bad_folder(folder, case):
    """An HF folder with one thing wrong; returns the error line expected for it."""
    from safetensors.torch import load_file, save_file
    tiny_hf_model("llama", folder.parent / "good")
    weights = load_file(folder.parent / "good" / "model.safetensors")
    config = (folder.parent / "good" / "config.json").read_text()
    cfg, tensors, message = {
        "family": ('{"model_type": "gpt2"}', weights,
                   f"error: {folder / 'config.json'}: model_type='gpt2' is not a family this converter knows"),
        "missing": (config, {k: v for k, v in weights.items() if k != "model.norm.weight"},
                    "error: missing weight model.norm.weight (a llama model with this config.json has it)"),
        "shape": (config, {**weights, "model.embed_tokens.weight": torch.zeros(V + 1, 32)},
                  "error: weight model.embed_tokens.weight has shape (98, 32); config.json implies (97, 32)")}[case]
    folder.mkdir()
    (folder / "config.json").write_text(cfg)
    save_file(tensors, folder / "model.safetensors")
    return message


@pytest.mark.parametrize("case", ["family", pytest.param("missing", marks=pytest.mark.slow),
                                  pytest.param("shape", marks=pytest.mark.slow)])
def test_cli_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path):
    """As a command (a process of its own, ~10-20 s each on a loaded machine, hence two are slow)."""
    message = bad_folder(tmp_path / case, case)
    r = cli("from-hf", str(tmp_path / case), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(message), (case, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(tmp_path / "out")


def test_ctrl_c_while_converting_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """Ctrl-C was a traceback; now one line, exit 130, nothing in --out and no temporary left, and the same
    command then succeeds."""
    import safetensors.torch
    import data.tokens
    our_checkpoint(tmp_path / "run", OUR_CONFIGS["llama"])

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    for argv, module, name in [
            (["to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")], safetensors.torch, "save_file"),
            (["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")], data.tokens, "atomic_write")]:
        before = sorted(p.name for p in tmp_path.iterdir())
        with monkeypatch.context() as m:
            m.setattr(module, name, ctrl_c)
            code, err = run_cli(argv, capsys)
        assert code == 130 and err == f"interrupted: nothing was written to {argv[-1]}", err
        out = argv[-1]
        assert not os.path.exists(out) or not os.listdir(out)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != os.path.basename(out)) == before
        assert convert.main(argv) == 0


def test_from_hf_of_a_hub_name_says_to_download_it(tmp_path, capsys, monkeypatch):
    """from-hf reads a local folder; a hub id (no such folder here) said "no config.json", now how to get it."""
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["from-hf", "org/Model-1B", "--out", "out"], capsys)
    assert code == 2 and err == "error: org/Model-1B: no such folder; from-hf reads a local transformers model folder " \
        "(a hub model: download it first, e.g. huggingface-cli download org/Model-1B --local-dir hf/model, then pass " \
        "hf/model)", err
    os.makedirs("empty")
    code, err = run_cli(["from-hf", "empty", "--out", "out"], capsys)
    assert code == 2 and err == "error: empty: no config.json (not a transformers model folder)", err
    assert not os.path.exists("out")


def test_quantized_folder_is_refused(tmp_path, capsys):
    """The hub's gpt-oss keeps its experts in MXFP4 (quantization_config); only plain weights convert."""
    tiny_hf_model("gpt_oss", tmp_path / "hf")
    import json
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err == f"error: {tmp_path / 'hf' / 'config.json'}: quantization_config " \
        "(quant_method='mxfp4'): quantized weights (e.g. gpt-oss's MXFP4 experts) do not convert; save a " \
        "dequantized copy first", err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name, change, message", [
    ("kimi_linear", {"attention_bias": True}, "error: config.json attention_bias=true: kimi_linear's attention biases"),
    ("deepseek_v32", {"attention_bias": True}, "error: config.json attention_bias=true: not converted"),
    ("qwen3_next_moe", {"mlp_only_layers": [1]}, "error: config.json mlp_only_layers=[1], decoder_sparse_step=1: only "
     "leading dense layers convert (first_k_dense)"),
    ("kimi_linear_moe", {"mlp_layer_types": ["sparse", "dense", "sparse"]}, "error: config.json: MoE layers after a "
     "dense one"),
])
def test_hf_option_the_project_lacks_is_refused(name, change, message, tmp_path, capsys):
    HF_CONFIGS[f"{name}_changed"] = dict(HF_CONFIGS[name], **change)
    try:
        tiny_hf_model(f"{name}_changed", tmp_path / "hf")
    finally:
        del HF_CONFIGS[f"{name}_changed"]
    code, err = run_cli(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.startswith(message) and "\n" not in err, err
    assert not os.path.exists(tmp_path / "out")


def test_from_hf_reads_a_sharded_bf16_folder(tmp_path):
    """Hub checkpoints come in bf16, in several safetensors shards with an index: read into fp32, the
    same model as transformers' with those bf16 weights."""
    hf = tiny_hf_model("qwen3_next_moe", tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    assert convert.main(["from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    ours, _ = load_model(str(tmp_path / "ours"))
    assert all(v.dtype == torch.float32 for v in ours.state_dict().values())
    hf = hf.float()
    idx = torch.randint(0, V, (2, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(ours(idx)[0], hf(idx).logits) <= 1e-4
