"""Config loading: YAML + dotted overrides; every bad config refused with one line naming the key."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from config import ROOT, apply_override, from_raw, load_config
from model import ConfigError

GOOD_LAYER = {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}


def raw(model=None, data=None, train=None):
    m = {"vocab_size": 64, "d_model": 32, "n_layer": 2, "pattern": ["a"], "layers": {"a": dict(GOOD_LAYER)}}
    m.update(model or {})
    return {"model": m, "data": data or {"kind": "mqar"}, "train": train or {}}


def layer(**kw):
    return {"layers": {"a": {**GOOD_LAYER, **kw}}}


def mla(dsa=None, **kw):
    spec = {"kind": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 8}
    if dsa is not None:
        spec["dsa"] = dsa
    return {"layers": {"a": {**spec, **kw}}}


BAD = [  # (config dict, what the one-line error must name)
    (raw(model={"d_modle": 32}), "model.d_modle: unknown key"),
    (raw(model=layer(kind="mamba")), "model.layers.a.kind: must be one of"),
    (raw(model={"pattern": ["a", "b"]}), "model.pattern[1]: must be one of the names in layers"),
    (raw(model=layer(n_kv_heads=3)), "model.layers.a.n_kv_heads: must be a divisor of n_heads=4"),
    (raw(model=layer(n_heads=5, n_kv_heads=1)), "model.layers.a.n_heads: must be a divisor of d_model=32"),
    (raw(model=layer(window=0)), "model.layers.a.window: must be an integer >= 1 or null"),
    (raw(model={"d_model": 0}), "model.d_model: must be an integer >= 1"),
    (raw(model={"n_layer": -1}), "model.n_layer: must be an integer >= 1"),
    (raw(model={"vocab_size": "big"}), "model.vocab_size: must be an integer"),
    (raw(model=layer(sinks="yes")), "model.layers.a.sinks: must be true or false"),
    (raw(model=layer(head_dim=7)), "model.layers.a.head_dim: must be even when rope is true"),
    (raw(model=layer(wndow=4)), "model.layers.a.wndow: unknown key"),
    (raw(model={"layers": {}}), "model.layers: must be a non-empty mapping"),
    (raw(model={"pattern": []}), "model.pattern: must be a non-empty list"),
    (raw(model={"mlp": {"kind": "gelu"}}), "model.mlp.kind: must be one of swiglu"),
    (raw(model={"backend": "cuda"}), "model.backend: must be null or one of torch, triton"),
    (raw(model=mla(kv_lora_rank=0)), "model.layers.a.kv_lora_rank: must be an integer >= 1"),
    (raw(model=mla(qk_rope_dim=3)), "model.layers.a.qk_rope_dim: must be even"),
    (raw(model=mla(q_lora_rank=0)), "model.layers.a.q_lora_rank: must be an integer >= 1"),
    (raw(model=mla(kv_rank=8)), "model.layers.a.kv_rank: unknown key"),
    (raw(model=mla(dsa={"top_k": 0})), "model.layers.a.dsa.top_k: must be an integer >= 1"),
    (raw(model=mla(dsa={"topk": 64})), "model.layers.a.dsa.topk: unknown key"),
    (raw(model=mla(dsa={"stage": "warmup"})), "model.layers.a.dsa.stage: must be one of dense_warmup, sparse"),
    (raw(model=mla(dsa={"head_dim": 16, "rope_dim": 32})), "model.layers.a.dsa.rope_dim: must be an even integer"),
    (raw(model=mla(dsa={"loss_weight": -1})), "model.layers.a.dsa.loss_weight: must be >= 0"),
    (raw(model=mla(dsa=[64])), "model.layers.a.dsa: must be a mapping"),
    (raw(train={"max_steps": 0}), "train.max_steps: must be an integer >= 1"),
    (raw(train={"lr": -1}), "train.lr: must be > 0"),
    (raw(train={"batchsize": 4}), "train.batchsize: unknown key"),
    (raw(train={"device": "tpu"}), "train.device: must be auto, cpu, cuda or cuda:N"),
    (raw(data={"kind": "mqar", "mqar_mix": [[64]]}), "data.mqar_mix: must be a list of [length, n_pairs] pairs"),
    (raw(data={"seed": 3}), "data.seed: must be null for stdlib (text corpora are read in order"),
    (raw(data={"kind": "mqar", "seed": "two"}), "data.seed: must be an integer"),
    (raw(data={"kind": "mqar", "seed": -1}), "data.seed: must be an integer >= 0 or null (got -1)"),
    (raw(train={"seed": -5}), "train.seed: must be an integer >= 0 (got -5)"),
    (raw(data={"kind": "imagenet"}), "data.kind: must be one of stdlib, bin, mqar"),
    (raw(data={"kind": "bin"}), "data.dir: must be a folder of prepared shards"),
    ({**raw(), "optim": {}}, "optim: must be a section"),
]

UNUSED = [  # settings the rest of the config would ignore: a dense model trained where a MoE was asked for
    (raw(model={"mlp": {"n_experts": 16}}), "model.mlp.n_experts: must be left out: it is a MoE setting and "
                                            "model.mlp.kind is swiglu (set model.mlp.kind: moe) (got 16)"),
    (raw(model={"mlp": {"kind": "moe", "bias_update_rate": 0.01}}),
     "model.mlp.bias_update_rate: must be left at its default without router: sigmoid"),
    (raw(model={"mlp": {"kind": "moe", "swiglu_limit": 5.0}}),
     "model.mlp.swiglu_limit: must be left at its default without expert_act: swiglu_clamped"),
    (raw(data={"kind": "stdlib", "n_pairs": 16}), "data.n_pairs: must be left at 8 for stdlib (it sets mqar's pairs)"),
    (raw(data={"kind": "palindrome", "mqar_mix": [[16, 2]]}), "data.mqar_mix: must be empty for palindrome"),
    (raw(data={"kind": "stdlib", "mqar_vocab": 16}), "data.mqar_vocab: must be null for stdlib"),
    (raw(train={"muon_lr": 0.05}), "train.muon_lr: must be left at 0.02 with optimizer adamw (it is Muon's lr"),
]


@pytest.mark.parametrize("cfg,message", UNUSED, ids=[m.split(":")[0] for _, m in UNUSED])
def test_a_setting_the_config_would_ignore_is_refused_before_training(cfg, message, tmp_path):
    """They were accepted and ignored. Refused where a config is about to train (load_config, train.train,
    ablate); a checkpoint's saved config that holds one still loads (from_raw), so old runs stay usable."""
    from config import refuse_unused
    from train import train
    with pytest.raises(ConfigError, match=re.escape(message)):
        refuse_unused(from_raw(cfg))
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))                 # JSON is YAML
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(from_raw(cfg))



@pytest.mark.parametrize("cfg,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_config_is_refused_with_one_line(cfg, message):
    with pytest.raises(ConfigError) as e:
        from_raw(cfg)
    text = str(e.value)
    assert message in text, text
    assert "\n" not in text


def test_good_config_and_defaults():
    cfg = from_raw(raw())
    attn = cfg.model.layers["a"]
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (4, 2, 8)
    assert cfg.model.mlp.hidden % 64 == 0 and cfg.train.max_steps > 0


@pytest.mark.parametrize("override, message", [
    ("--train.lr=inf", "train.lr: must be a finite number (got inf)"),
    ("--train.lr=nan", "train.lr: must be a finite number (got nan)"),
    ("--model.init_std=inf", "model.init_std: must be a finite number (got inf)"),
    ("--model.layers.mla.rope_theta=inf", "model.layers.mla.rope_theta: must be a finite number (got inf)"),
    ("--train.stop_at={val_loss: .nan}", "train.stop_at.val_loss: must be a finite number")])
def test_infinite_or_nan_numbers_are_refused(override, message):
    """An infinite lr or init_std was accepted and trained on NaNs."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_any_seq_len_without_context_parallelism():
    """seq_len must divide into 2N pieces only under context parallelism (an odd seq_len was refused at N = 1)."""
    assert from_raw(raw(train={"seq_len": 65})).train.seq_len == 65
    with pytest.raises(ConfigError, match=r"seq_len=66 divisible by 2N"):
        from_raw(raw(train={"seq_len": 66, "context_parallel": 2}))


def test_mla_config_with_dsa():
    cfg = from_raw(raw(model=mla(dsa={"top_k": 16, "stage": "dense_warmup"})))
    a = cfg.model.layers["a"]
    assert a.kind == "mla" and a.dsa.top_k == 16 and a.dsa.stage == "dense_warmup" and a.dsa.n_heads == 4
    assert from_raw(raw(model=mla())).model.layers["a"].dsa is None


def test_pattern_is_cycled_to_n_layer():
    cfg = from_raw(raw(model={"n_layer": 5, "pattern": ["a", "a", "b"],
                              "layers": {"a": dict(GOOD_LAYER), "b": {**GOOD_LAYER, "window": 8}}}))
    assert [c.window for c in cfg.model.layer_configs()] == [None, None, 8, None, None]


def test_dotted_overrides():
    cfg = load_config(os.path.join(ROOT, "configs", "swa_sinks.yaml"),
                      ["--train.max_steps=7", "--model.n_layer=4", "--model.layers.local.window=null",
                       "--train.lr=1e-3", "--model.pattern=[global]"])
    assert cfg.train.max_steps == 7 and cfg.model.n_layer == 4 and cfg.train.lr == 1e-3
    assert cfg.model.pattern == ["global"] and cfg.model.layers["local"].window is None
    default = load_config(None, ["--model.n_layer=2", "--train.seq_len=64"])  # the embedded default
    assert default.model.n_layer == 2 and default.train.seq_len == 64 and default.data.kind == "stdlib"
    with pytest.raises(ConfigError, match="is not a section"):
        apply_override({"train": {"lr": 1}}, "--train.lr.x=3")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["--train.max_stepz=3"])


def test_every_shipped_config_loads():
    paths = glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
    assert paths
    for path in paths:
        load_config(path)


@pytest.mark.parametrize("args,message", [
    (["--model.n_layer=0"], "model.n_layer: must be an integer >= 1"),
    (["missing.yaml"], "missing.yaml: config file not found"),
    (["--model.layers.kda.kind=rnn"], "model.layers.kda.kind: must be one of"),
])
def test_entry_point_exits_2_with_one_line(args, message, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_yaml_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_a_key_given_twice_and_a_top_level_that_is_not_a_mapping_are_refused(tmp_path):
    """YAML keeps the last of two equal keys: a second `model:` section replaced the first without a word
    (its d_model was lost). A top level that is a list was a traceback. Merge keys may still be overridden."""
    cases = [("model:\n  d_model: 64\nmodel:\n  n_layer: 2\n",
              r"not valid YAML at line 3, column 1: key 'model' appears twice in one mapping \(first at line 1\)"),
             ("train:\n  lr: 1.0e-3\n  max_steps: 2\n  lr: 3.0e-3\n",
              r"at line 4, column 3: key 'lr' appears twice in one mapping \(first at line 2\); YAML would keep only"),
             ("- model\n", r"must be a mapping of sections \(key: value lines\) at the top, got a list")]
    for text, match in cases:
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_config(str(tmp_path / "c.yaml"))
    (tmp_path / "c.yaml").write_text("model:\n  <<: &base {d_model: 64, n_layer: 2}\n  d_model: 32\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert (cfg.model.d_model, cfg.model.n_layer) == (32, 2)
