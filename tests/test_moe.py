"""Mixture of experts (SPEC 10): grouped experts == a token-by-token reference (forward and backward),
step == forward, the sigmoid router's balancing bias, load metrics, DDP/FSDP2 on 2 ranks == 1 rank."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from config import ROOT, from_raw
from model import ConfigError, ModelConfig, MoE, SwiGLU
from test_model import check_step_equals_forward, make_model
from test_scale import child_env, free_port, losses
from train import latest_checkpoint, load_checkpoint, train

ATTN = {"a": {"kind": "attn", "n_heads": 2}}
MOE = {"kind": "moe", "n_experts": 5, "top_k": 2, "hidden": 16}
ROUTERS = {
    "softmax": dict(MOE, n_shared=1, shared_hidden=24, shared_gate=True),
    "softmax_unnormalised": dict(MOE, norm_topk=False),
    "sigmoid": dict(MOE, router="sigmoid", n_shared=2, routed_scale=2.5, first_k_dense=1, dense_hidden=40),
    "sigmoid_grouped": dict(MOE, n_experts=6, router="sigmoid", n_group=3, topk_group=2),
    "gpt_oss": dict(MOE, bias=True, expert_act="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=0.1),
}


def oai_swiglu(g, u, alpha, limit):
    """gpt-oss's expert activation, as its reference writes it."""
    g, u = torch.minimum(g, torch.tensor(limit)), torch.maximum(torch.minimum(u, torch.tensor(limit)),
                                                                torch.tensor(-limit))
    return g * torch.sigmoid(alpha * g) * (u + 1)


def naive_expert(moe, e, xt):
    c = moe.cfg
    if not c.bias:
        return (F.silu(moe.w1[e] @ xt) * (moe.w3[e] @ xt)) @ moe.w2[e].T
    h = oai_swiglu(moe.w1[e] @ xt + moe.b1[e], moe.w3[e] @ xt + moe.b3[e], c.swiglu_alpha, c.swiglu_limit)
    return moe.w2[e] @ h + moe.b2[e]


def naive_moe(moe, x):
    """Token by token: route, run each chosen expert, weight, sum; plus the shared expert."""
    c = moe.cfg
    out = []
    for xt in x.reshape(-1, x.shape[-1]):
        logits = moe.router.weight.float() @ xt.float() + (moe.router.bias if c.bias else 0)
        scores = logits.softmax(-1) if c.router == "softmax" else logits.sigmoid()
        choice = scores + (0 if c.router == "softmax" else moe.router_bias)
        if c.n_group > 1:  # per group the sum of its best two; experts outside the best groups cannot win
            size = c.n_experts // c.n_group
            sums = torch.stack([choice[g * size:(g + 1) * size].sort(descending=True).values[:2].sum()
                                for g in range(c.n_group)])
            kept = set(sums.argsort(descending=True)[:c.topk_group].tolist())
            choice = torch.stack([choice[e] if e // size in kept else torch.tensor(float("-inf"))
                                  for e in range(c.n_experts)])
        chosen = torch.topk(choice, c.top_k).indices
        w = scores[chosen] / (scores[chosen].sum() if c.norm_topk else 1) * c.routed_scale
        y = sum(w[j] * naive_expert(moe, e, xt) for j, e in enumerate(chosen.tolist()))
        if moe.shared is not None:
            s = moe.shared(xt)
            y = y + (torch.sigmoid(moe.shared_gate(xt)) * s if moe.shared_gate is not None else s)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("padded", [False, True], ids=["per_expert", "padded_bmm"])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_grouped_experts_equal_token_by_token_forward_and_backward(name, padded):
    """Both expert layouts (per-expert matmuls: the CPU default; padded batched matmuls: the CUDA
    default) equal a token-by-token loop, forward and backward."""
    model = make_model(ATTN, n_layer=2, mlp=ROUTERS[name])
    moe = model.blocks[-1].mlp
    assert isinstance(moe, MoE)
    moe.padded = padded
    with torch.no_grad():
        moe.router_bias.normal_(0, 0.1)  # a bias that changes the selection (sigmoid router)
        if moe.cfg.bias:  # learned biases away from 0; gate/up ones large enough that the clamp binds
            for b in (moe.router.bias, moe.b1, moe.b3, moe.b2):
                b.normal_(0, 0.1)
    x = torch.randn(2, 7, 32, requires_grad=True)
    y = moe(x)
    ref = naive_moe(moe, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, moe.w1, moe.w2, moe.router.weight], g)
    ref_grads = torch.autograd.grad(ref, [x, moe.w1, moe.w2, moe.router.weight], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_padded_experts_with_an_expert_that_gets_no_token():
    """An expert no token picks: the padded layout gives the per-expert result and its weights a zero
    gradient (not None), like the per-expert loop."""
    model = make_model(ATTN, n_layer=1, mlp=dict(ROUTERS["gpt_oss"], n_experts=6))
    moe = model.blocks[0].mlp
    with torch.no_grad():
        moe.router.bias.zero_()[5] = -100.0  # expert 5 never wins
    x = torch.randn(2, 7, 32)
    assert moe.route(x.reshape(-1, 32))[0].eq(5).sum() == 0
    results = []
    for padded in (False, True):
        moe.padded = padded
        y = moe(x)
        results.append((y, torch.autograd.grad(y.square().sum(), [moe.w1, moe.w2, moe.b2])))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert g1[0][5].abs().sum() == 0 and g1[2][5].abs().sum() == 0


@pytest.mark.parametrize("name", list(ROUTERS))
def test_step_equals_forward_with_moe(name):
    model = make_model({"g": {"kind": "gdn", "n_heads": 2, "head_dim": 8}, **ATTN}, pattern=["g", "a"],
                       n_layer=2, mlp=ROUTERS[name])
    check_step_equals_forward(model, T=19)


def test_first_k_dense_layers_keep_a_dense_mlp():
    model = make_model(ATTN, n_layer=3, mlp=ROUTERS["sigmoid"])
    assert isinstance(model.blocks[0].mlp, SwiGLU) and model.blocks[0].mlp.w1.out_features == 40
    assert all(isinstance(b.mlp, MoE) for b in model.blocks[1:])
    assert "blocks.1.mlp.router_bias" in model.state_dict()       # the bias is saved (sigmoid only)
    soft = make_model(ATTN, n_layer=1, mlp=ROUTERS["softmax"])
    assert not any("router_bias" in k or ".load" in k for k in soft.state_dict())


def test_balancing_bias_moves_load_toward_the_underused_experts():
    model = make_model(ATTN, n_layer=2, mlp=dict(ROUTERS["sigmoid"], bias_update_rate=0.01)).train()
    moe = model.blocks[1].mlp
    with torch.no_grad():
        moe.router.weight[0] += 1.0  # expert 0 takes every token with a positive input sum
    model(torch.randint(0, 61, (4, 16)))
    load = moe.load.clone()
    stats = model.update_router_biases()
    assert stats["dropped_tokens"] == 0 and len(stats["expert_load"]) == 1
    assert abs(sum(stats["expert_load"][0]) - 1) < 1e-6
    over, under = load > load.mean(), load < load.mean()
    assert (moe.router_bias[over] == -0.01).all() and (moe.router_bias[under] == 0.01).all()
    assert moe.load.sum() == 0                                      # counted afresh for the next step
    before = moe.router_bias.clone()
    model(torch.randint(0, 61, (4, 16)))
    model.update_router_biases(update=False)                        # a skipped step: no nudge
    assert torch.equal(before, moe.router_bias) and moe.load.sum() == 0


@pytest.mark.parametrize("mlp, message", [
    (dict(MOE, top_k=6), "model.mlp.top_k: must be in [1, n_experts=5]"),
    (dict(MOE, router="relu"), "model.mlp.router: must be one of softmax, sigmoid"),
    (dict(MOE, shared_gate=True), "model.mlp.shared_gate: must be false without shared experts"),
    (dict(MOE, first_k_dense=3), "model.mlp.first_k_dense: must be in [0, n_layer=2]"),
    ({"kind": "experts"}, "model.mlp.kind: must be one of swiglu, moe"),
    (dict(MOE, expert_act="gelu"), "model.mlp.expert_act: must be one of swiglu, swiglu_clamped"),
    (dict(MOE, n_group=2), "model.mlp.n_group: must be a divisor of n_experts=5"),
    (dict(MOE, n_experts=6, n_group=3, topk_group=4), "model.mlp.topk_group: must be in [1, n_group=3]"),
])
def test_bad_moe_config_is_refused_in_one_line(mlp, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({"d_model": 32, "n_layer": 2, "layers": ATTN, "pattern": ["a"], "mlp": mlp})
    assert str(e.value).startswith(message)


def moe_run(out_dir, **train_kw):
    return {"model": {"vocab_size": 32, "d_model": 32, "n_layer": 2, "pattern": ["a"], "layers": ATTN,
                      "mlp": dict(ROUTERS["sigmoid"], bias_update_rate=0.01)},
            "data": {"kind": "mqar", "n_pairs": 4},
            "train": {"max_steps": 4, "batch_size": 8, "seq_len": 32, "lr": 3e-3, "warmup_steps": 1,
                      "log_interval": 1, "eval_interval": 1000, "eval_batches": 1, "ckpt_interval": 1000,
                      "out_dir": str(out_dir), **train_kw}}


def rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def test_training_logs_expert_load(tmp_path):
    train(from_raw(moe_run(tmp_path, grad_accum=2)), quiet=True)
    for r in rows(tmp_path):
        assert r["dropped_tokens"] == 0 and len(r["expert_load"]) == 1 and len(r["expert_load"][0]) == 5
        assert abs(sum(r["expert_load"][0]) - 1) < 1e-6
    bias = load_checkpoint(latest_checkpoint(tmp_path))["model"]["blocks.1.mlp.router_bias"]
    assert 0 < bias.abs().max() <= 4 * 0.01 + 1e-6                 # 4 steps of +-bias_update_rate


@pytest.mark.slow
def test_moe_under_ddp_and_fsdp_on_two_ranks_matches_one_rank(tmp_path):
    runs = {p: moe_run(tmp_path / p, parallel=p, grad_accum=2) for p in ("ddp", "fsdp")}
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(list(runs.values())))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                        os.path.join(ROOT, "tests", "dist_worker.py"), str(spec)],
                       capture_output=True, text=True, timeout=600, env=child_env(threads=1))
    assert r.returncode == 0, r.stderr[-3000:]
    train(from_raw(moe_run(tmp_path / "one", grad_accum=2)), quiet=True)
    one = losses(tmp_path / "one")
    ref_bias = load_checkpoint(latest_checkpoint(tmp_path / "one"))["model"]["blocks.1.mlp.router_bias"]
    for name in runs:
        two = losses(tmp_path / name)
        assert max(abs(one[s] - two[s]) for s in one) <= 1e-5, (name, one, two)
        torch.testing.assert_close(torch.tensor([r["expert_load"] for r in rows(tmp_path / name)]),
                                   torch.tensor([r["expert_load"] for r in rows(tmp_path / "one")]), rtol=0, atol=1e-6)
        bias = load_checkpoint(latest_checkpoint(tmp_path / name))["model"]["blocks.1.mlp.router_bias"]
        assert torch.equal(bias, ref_bias), name


@pytest.mark.parametrize("name", list(ROUTERS))
def test_cost_counts_all_and_active_parameters(name):
    import cost
    model = make_model(ATTN, n_layer=2, mlp=ROUTERS[name])
    cfg = model.config
    assert cost.num_params(cfg) == model.num_params()
    c = cfg.mlp
    expert = 3 * 32 * c.hidden + ((2 * c.hidden + 32) if c.bias else 0)
    idle = (c.n_experts - c.top_k) * expert * (2 - c.first_k_dense)  # experts a token skips
    assert cost.active_params(cfg) == model.num_params() - idle
    dense = make_model(ATTN, n_layer=2)
    assert cost.active_params(dense.config) == cost.num_params(dense.config) == dense.num_params()


def test_cost_flops_and_decode_bytes_are_those_of_the_active_experts():
    """A token's MoE costs what a dense SwiGLU top_k * hidden wide costs, plus the router's matmul
    (2 FLOPs and one read per weight: d_model x n_experts per layer)."""
    import cost
    base = {"d_model": 32, "n_layer": 2, "layers": ATTN, "pattern": ["a"]}
    moe = ModelConfig.from_dict(dict(base, mlp=MOE))
    dense = ModelConfig.from_dict(dict(base, mlp={"kind": "swiglu", "hidden": MOE["top_k"] * MOE["hidden"]}))
    router = 2 * 32 * MOE["n_experts"]                                   # weights over both layers
    assert cost.train_flops_per_token(moe, 64) == cost.train_flops_per_token(dense, 64) + 3 * 2 * router
    (f_moe, b_moe, _), (f_dense, b_dense, _) = cost.decode_cost(moe, 100, 2), cost.decode_cost(dense, 100, 2)
    assert f_moe == f_dense + 2 * router and b_moe == b_dense + 2 * router
    assert cost.active_params(moe) == cost.num_params(dense) + router
