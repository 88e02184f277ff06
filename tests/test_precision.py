"""Every mixer kind under CPU bf16 autocast (what `train.precision: auto` uses on CUDA): a training step
(forward + backward) and decode (`step`) run, stay finite, and agree with fp32.

bf16 keeps 8 significant bits (relative rounding 2**-9 = 0.2%); a layer rounds its activations many times,
and a sparse layer may pick a different key on a near tie, so the stated tolerance is a few percent:
loss within 1% of fp32, the gradient (all parameters as one vector) within 8% relative L2 error, logits
within 5% of the largest fp32 logit."""
import pytest
import torch

from tests.test_model import make_model

DSA = {"n_heads": 2, "head_dim": 8, "rope_dim": 4, "top_k": 6}
MLA = {"kind": "mla", "n_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
       "v_head_dim": 8}
MIXERS = {
    "attn_gqa": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2},
    "attn_window_sinks": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1, "window": 5, "sinks": True},
    "attn_qk_norm_gate": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True, "output_gate": True},
    "kda": {"kind": "kda", "n_heads": 2},
    "gdn": {"kind": "gdn", "n_heads": 2},
    "linear": {"kind": "linear", "n_heads": 2},
    "mla": MLA,
    "dsa_sparse": {**MLA, "dsa": {**DSA, "stage": "sparse"}},
    "dsa_dense_warmup": {**MLA, "dsa": {**DSA, "stage": "dense_warmup"}},
    "nsa": {"kind": "nsa", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "cmp_block": 4, "cmp_stride": 2,
            "sel_block": 4, "n_sel": 3, "window": 6},
    "mfa": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12},
    "mfa_kr": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12, "key_reuse": True},
}
T = 23  # odd: an odd key count broke the DSA top-k under autocast (bf16 scores viewed as int32)

LOSS_RTOL, GRAD_RTOL, LOGIT_RTOL = 0.01, 0.08, 0.05


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def train_step(model, idx, autocast):
    model.zero_grad()
    with autocast:
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grad


def check_precision(model):
    idx = torch.randint(0, model.config.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(0))
    model.train()
    loss32, grad32 = train_step(model, idx, torch.autocast("cpu", enabled=False))
    loss16, grad16 = train_step(model, idx, bf16())
    assert torch.isfinite(loss16) and torch.isfinite(grad16).all()
    assert abs(loss16 - loss32) <= LOSS_RTOL * loss32, (loss16, loss32)
    assert (grad16 - grad32).norm() <= GRAD_RTOL * grad32.norm(), ((grad16 - grad32).norm() / grad32.norm()).item()
    model.eval()
    with torch.no_grad():
        ref, _ = model(idx[:, :T])
        cache = model.new_cache(2, T)
        with bf16():
            logits = torch.cat([model.step(idx[:, :7], cache)] + [model.step(idx[:, t:t + 1], cache)
                                                                   for t in range(7, T)], 1)
        assert torch.isfinite(logits).all()
        err = (logits.float() - ref).abs().max()
        assert err <= LOGIT_RTOL * ref.abs().max(), (err / ref.abs().max()).item()
        with bf16():  # generate: the path `train.py` samples with
            out = model.generate(idx[:, :5], 4, temperature=0)
        assert out.shape == (2, 9)


@pytest.mark.parametrize("name", list(MIXERS))
def test_training_step_and_decode_under_bf16_autocast(name):
    check_precision(make_model({name: MIXERS[name]}, n_layer=2))


def test_hybrid_under_bf16_autocast():
    layers = {"k": MIXERS["kda"], "d": MIXERS["dsa_sparse"]}
    check_precision(make_model(layers, pattern=["k", "k", "d"], n_layer=3))


MOES = {
    "softmax_shared_gate": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 16, "n_shared": 1,
                            "shared_gate": True},
    "sigmoid_groups": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 16, "n_shared": 1, "router": "sigmoid",
                       "routed_scale": 2.5, "n_group": 2, "topk_group": 1, "first_k_dense": 1},
    "gpt_oss_clamped": {"kind": "moe", "n_experts": 4, "top_k": 2, "hidden": 16, "bias": True,
                        "expert_act": "swiglu_clamped", "swiglu_limit": 0.5},
}


@pytest.mark.parametrize("name", list(MOES))
def test_moe_under_bf16_autocast(name):
    check_precision(make_model({"a": MIXERS["attn_gqa"]}, n_layer=2, mlp=MOES[name]))


@pytest.mark.parametrize("name", ["mla", "dsa_sparse", "nsa", "attn_window_sinks", "attn_qk_norm_gate", "mfa",
                                  "kda"])
def test_triton_backend_under_autocast_equals_torch(name):
    """What `train.py` runs on CUDA: the Triton kernels under autocast (fp16 here: the interpreter has no
    bf16 arithmetic). A Triton dot takes one dtype; MLA's normed latent stays fp32 beside its fp16
    projections, and that failed to compile on the first GPU (kernels._one_dtype now casts as SDPA does);
    Qwen3-Next's attention (qk-norm) gave fp32 q and k beside an fp16 v. Loss and gradients equal the torch
    backend's under the same autocast."""
    got, want = [], []
    for backend, out in (("triton", got), ("torch", want)):
        model = make_model({name: MIXERS[name]}, n_layer=2, backend=backend)
        idx = torch.randint(0, model.config.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(0))
        out.extend(train_step(model.train(), idx, torch.autocast("cpu", dtype=torch.float16)))
    assert torch.isfinite(got[1]).all()
    assert abs(got[0] - want[0]) <= 1e-4 * want[0], (got[0], want[0])
    assert (got[1] - want[1]).norm() <= 5e-3 * want[1].norm(), ((got[1] - want[1]).norm() / want[1].norm()).item()
