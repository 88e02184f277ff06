"""The model's equivalences on random configs: option combinations the per-kind tests do not list.

Each seed draws a model of one or two mixers (attention with any of window / sinks / NoPE / partial RoPE /
QK-norm / output gate / biases; KDA, GDN or linear attention with grouped value heads, other value widths,
other conv widths or none, no QK-norm, no output gate; MLA with or without a query latent, RoPE part or
DSA in either stage; NSA with small blocks; MFA with or without key reuse), a SwiGLU or MoE MLP, tied
or untied head, and checks what every config must satisfy:
  - step == forward over random splits into chunks and single tokens (tests/test_model.py),
  - packed documents == the documents run one by one, logits and every gradient (tests/test_varlen.py; in
    float64, so that fp32 rounding, which grows with the random widths and MoE, never reads as a mismatch),
  - the serving engine's greedy output and logits == model.generate / model.step per request, every
    block back in its pool (tests/test_engine.py), at random block sizes, prefill chunks, batch sizes
    and prefix sharing,
  - the Triton backend (under the interpreter on CPU) == the torch backend, logits and every gradient,
    packed documents or not.
The default run checks 24 seeds of each equivalence and 3 of the backends (about 30 s); `pytest -m slow`
checks 200 and 40.
"""
import contextlib
import random

import pytest
import torch

from engine import Engine, Request
from model import MIXERS, NSA
from tests.test_engine import check_contract
from tests.test_model import check_step_equals_forward, make_model
from tests.test_varlen import check_model_packed_equals_separate, cu_of, objective

VOCAB = 37


def random_mixer(r):
    kind = r.choice(["attn", "attn", "kda", "gdn", "linear", "mla", "mla_dsa", "nsa", "mfa"])
    if kind == "attn":
        H = r.choice([2, 4])
        m = {"kind": "attn", "n_heads": H, "n_kv_heads": r.choice([h for h in (1, 2, 4) if H % h == 0]),
             "head_dim": r.choice([8, 12, 16])}
        for key, value, p in [("window", r.choice([1, 3, 7, 20]), .4), ("sinks", True, .4), ("qk_norm", True, .3),
                              ("output_gate", True, .3), ("bias", True, .2)]:
            if r.random() < p:
                m[key] = value
        if r.random() < .3:
            m["rope"] = False
        elif r.random() < .3:
            m["rope_fraction"] = 0.5
        return m
    if kind in ("kda", "gdn", "linear"):
        H = r.choice([1, 2])
        m = {"kind": kind, "n_heads": H, "head_dim": r.choice([8, 16])}
        for key, value in [("n_v_heads", 2 * H), ("v_head_dim", r.choice([4, 12])), ("conv_size", r.choice([0, 2, 3])),
                           ("qk_norm", False), ("output_gate", False)]:
            if r.random() < .3:
                m[key] = value
        return m
    if kind in ("mla", "mla_dsa"):
        m = {"kind": "mla", "n_heads": r.choice([2, 4]), "kv_lora_rank": r.choice([8, 16]),
             "qk_nope_dim": r.choice([4, 8]), "qk_rope_dim": r.choice([0, 4]), "v_head_dim": r.choice([4, 6])}
        if r.random() < .5:
            m["q_lora_rank"] = 12
        if r.random() < .3:
            m["rope"] = False
        if kind == "mla_dsa":
            m["dsa"] = {"n_heads": 2, "head_dim": 8, "rope_dim": r.choice([0, 4]), "top_k": r.choice([1, 3, 5, 40]),
                        "stage": r.choice(["dense_warmup", "sparse"])}
        return m
    if kind == "nsa":
        H, d = r.choice([2, 4]), r.choice([1, 2])
        return {"kind": "nsa", "n_heads": H, "n_kv_heads": r.choice([h for h in (1, 2) if H % h == 0]),
                "head_dim": 8, "cmp_stride": d, "cmp_block": d * r.choice([1, 2, 3]), "sel_block": d * r.choice([2, 4]),
                "n_sel": r.choice([3, 4, 6]), "window": r.choice([1, 5, 9]), "rope": r.random() < .7}
    return {"kind": "mfa", "n_heads": r.choice([2, 4]), "head_dim": r.choice([8, 16]),
            "share_q_dim": r.choice([6, 12]), "key_reuse": r.random() < .5, "rope": r.random() < .7}


def random_config(seed):
    r = random.Random(seed)
    layers = {f"m{i}": random_mixer(r) for i in range(r.choice([1, 2]))}
    pattern = [r.choice(list(layers)) for _ in range(r.choice([1, 2]))]
    pattern += [name for name in layers if name not in pattern]
    mlp = {}
    if r.random() < .3:
        mlp = {"kind": "moe", "n_experts": 4, "top_k": r.choice([1, 2]), "hidden": 16, "n_shared": r.choice([0, 1]),
               "router": r.choice(["softmax", "sigmoid"])}
        mlp["shared_gate"] = mlp["n_shared"] > 0 and r.random() < .5
    return {"vocab_size": VOCAB, "d_model": 32, "n_layer": len(pattern), "pattern": pattern, "layers": layers,
            "mlp": mlp, "tie_embeddings": r.random() < .5, "backend": "torch"}


def build(cfg):
    """The model of random_config's dict, built as tests/test_model.py's make_model builds (seed 0, sinks
    drawn); NSA layers get larger weights, as in tests/test_nsa_mfa.py, so the selection's softmaxes are not
    flat (flat ones tie blocks to rounding, and step and forward may pick either: top-k's discontinuity)."""
    model = make_model(cfg["layers"], cfg["pattern"], n_layer=cfg["n_layer"], d_model=cfg["d_model"],
                       vocab=cfg["vocab_size"], mlp=cfg["mlp"], tie_embeddings=cfg["tie_embeddings"],
                       backend=cfg["backend"])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NSA):
                for p in m.parameters():
                    p.normal_(0, 0.3)
    return model


@contextlib.contextmanager
def naming(cfg):
    """A failure names the config that was drawn."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}; layers {list(cfg['layers'].values())}, mlp {cfg['mlp']}") from None


DEFAULT, SLOW = range(24), range(24, 200)
SEEDS = [*DEFAULT, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW)]


def test_default_seeds_draw_every_mixer_kind_and_both_mlps():
    configs = [random_config(s) for s in DEFAULT]
    kinds = {layer["kind"] for cfg in configs for layer in cfg["layers"].values()}
    assert kinds == set(MIXERS)
    assert any(layer.get("dsa") for cfg in configs for layer in cfg["layers"].values())
    assert {cfg["mlp"].get("kind", "swiglu") for cfg in configs} == {"swiglu", "moe"}


@pytest.mark.parametrize("seed", SEEDS)
def test_step_equals_forward(seed):
    cfg = random_config(seed)
    r = random.Random(seed)
    with naming(cfg):
        check_step_equals_forward(build(cfg).eval(), T=r.choice([9, 41, 70]), B=2, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_packed_equals_separate(seed):
    cfg = random_config(seed)
    with naming(cfg):
        check_model_packed_equals_separate(build(cfg).double().train(), [1 + seed % 3, 17, 40, 5], seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_engine_equals_generate(seed):
    cfg = random_config(seed)
    model = build(cfg).eval()
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (r.choice([0, 9]),), generator=g).tolist()
    reqs = [Request(prefix + torch.randint(0, VOCAB, (r.choice([1, 3, 8, 17, 30]),), generator=g).tolist(),
                    r.choice([1, 2, 5, 13]), rid=i) for i in range(r.randint(1, 6))]
    reqs.append(Request(list(reqs[0].prompt), 4, rid="twin"))     # an identical prompt: a fork of its blocks
    engine = Engine(model, max_batch=r.choice([1, 2, 3, 8]), prefill_chunk=r.choice([1, 3, 8, 64]),
                    block_size=r.choice([1, 2, 4, 16]), keep_logits=True, prefix_sharing=r.random() < .7)
    engine.run(reqs)
    with naming(cfg):
        assert not [q.error for q in reqs if q.error]
        check_contract(model, reqs)
        for group in engine.groups.values():  # every block back in its pool
            assert len(group.pool.free) == group.pool.n_blocks and not group.pool.prefix


# the default run: three seeds that hold KDA + DSA, MLA + GDN and NSA between them (attention, MFA and linear
# attention come in the slow run)
TRITON_DEFAULT = [0, 5, 6]


@pytest.mark.parametrize("seed", [*TRITON_DEFAULT, *(pytest.param(s, marks=pytest.mark.slow)
                                                    for s in range(40) if s not in TRITON_DEFAULT)])
def test_triton_equals_torch(seed):
    """Logits and every parameter gradient, torch backend against the triton backend (same weights)."""
    cfg = random_config(seed)
    r = random.Random(seed)
    models = [build({**cfg, "backend": backend}).train() for backend in ("torch", "triton")]
    N = r.choice([23, 70])
    cu_seqlens = cu_of([5, 1, N - 6]) if r.random() < .5 else None
    idx = torch.randint(0, VOCAB, (1, N), generator=torch.Generator().manual_seed(seed))
    w = torch.randn(1, N, VOCAB, generator=torch.Generator().manual_seed(seed + 1)) / N
    results = []
    for model in models:
        logits, total = objective(model, idx, cu_seqlens, w)
        results.append((logits, torch.autograd.grad(total, list(model.parameters()), allow_unused=True)))
    (ref_logits, ref_grads), (logits, grads) = results
    with naming(cfg):
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        for (name, _), a, b in zip(models[0].named_parameters(), ref_grads, grads):
            assert (a is None) == (b is None), name
            if a is not None:
                assert (a - b).abs().max().item() <= 1e-4, name
