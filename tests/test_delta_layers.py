"""The delta-rule mixers (kda, gdn, linear) in the model: step == forward, constant-size caches,
KDA with a channel-constant gate == GDN, parameter dtypes and weight-decay groups."""
import pytest
import torch

from kernels import delta_rule
from test_model import ATTN, check_step_equals_forward, make_model
from train import make_optimizer

DELTA = {kind: {"kind": kind, "n_heads": 2, "head_dim": 16, "v_head_dim": 8} for kind in ("kda", "gdn", "linear")}


@pytest.mark.parametrize("kind", list(DELTA))
def test_step_equals_forward_delta(kind):
    model = make_model({kind: DELTA[kind]}, n_layer=2)
    for seed in range(2):
        check_step_equals_forward(model, T=70, seed=seed)  # crosses a chunk boundary (64)


@pytest.mark.parametrize("options", [{"conv_size": 0}, {"conv_size": 2, "qk_norm": False}, {"output_gate": False}])
def test_step_equals_forward_delta_options(options):
    model = make_model({"kda": {**DELTA["kda"], **options}}, n_layer=1)
    check_step_equals_forward(model, T=30)


def test_step_equals_forward_hybrid_of_everything():
    layers = {"kda": DELTA["kda"], "gdn": DELTA["gdn"], "lin": DELTA["linear"],
              "local": ATTN["window_sinks"], "global": ATTN["gqa"]}
    model = make_model(layers, pattern=["kda", "local", "gdn", "lin", "global"], n_layer=5)
    for seed in range(2):
        check_step_equals_forward(model, T=80, seed=seed)


def test_kda_with_channel_constant_gate_equals_gdn():
    torch.manual_seed(0)
    B, T, H, K, V = 2, 70, 2, 16, 8
    q, k = torch.nn.functional.normalize(torch.randn(2, B, T, H, K), dim=-1)
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    g_head = -torch.rand(B, T, H)
    o_gdn, s_gdn = delta_rule(q, k, v, g_head, beta, output_final_state=True)
    o_kda, s_kda = delta_rule(q, k, v, g_head[..., None].expand(B, T, H, K), beta, output_final_state=True)
    torch.testing.assert_close(o_kda, o_gdn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_kda, s_gdn, atol=1e-5, rtol=1e-5)
    # the same at layer level: a KDA layer whose gate projection ignores the channel equals GDN
    kda = make_model({"m": DELTA["kda"]}, n_layer=1).blocks[0].mixer
    gdn = make_model({"m": DELTA["gdn"]}, n_layer=1).blocks[0].mixer
    with torch.no_grad():
        for name in ("w_qkv", "w_beta", "wo"):
            getattr(kda, name).weight.copy_(getattr(gdn, name).weight)
        kda.conv.copy_(gdn.conv)
        kda.A_log.copy_(gdn.A_log)
        kda.w_f[0].weight.zero_()
        kda.dt_bias.copy_(gdn.dt_bias.repeat_interleave(16))
        gdn.w_f.weight.zero_()
        kda.w_g[0].weight.zero_()  # sigmoid(0) = 1/2 vs silu: compare without the output gate
    x = torch.randn(2, 40, 32)
    kda.cfg.output_gate = gdn.cfg.output_gate = False
    try:
        torch.testing.assert_close(kda(x), gdn(x), atol=1e-5, rtol=1e-5)
    finally:
        kda.cfg.output_gate = gdn.cfg.output_gate = True


@pytest.mark.parametrize("kind", list(DELTA))
def test_decode_cache_bytes_do_not_grow(kind):
    model = make_model({kind: DELTA[kind]}, n_layer=2)
    cache = model.new_cache(1, 2000)
    model.step(torch.randint(0, 61, (1, 10)), cache)
    after_10 = cache.nbytes()
    model.step(torch.randint(0, 61, (1, 990)), cache)
    # per layer: fp32 state H*K*V + conv state (conv_size - 1) * (2 H K + H V) fp32
    assert cache.nbytes() == after_10 == 2 * (2 * 16 * 8 * 4 + 3 * (2 * 16 + 2 * 16 + 2 * 8) * 4)


def test_gate_parameters_are_fp32_and_not_decayed():
    from config import TrainConfig
    model = make_model({"kda": DELTA["kda"], "gdn": DELTA["gdn"]}, n_layer=2)
    special = {n: p for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    assert len(special) == 4 and all(p.dtype == torch.float32 for p in special.values())
    opt = make_optimizer(model, TrainConfig())
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(p) in no_decay for p in special.values())
    assert id(model.blocks[0].mixer.w_qkv.weight) not in no_decay


def test_gate_init_ranges():
    mixer = make_model({"kda": DELTA["kda"]}, n_layer=1).blocks[0].mixer
    A = mixer.A_log.exp()
    assert (A >= 1).all() and (A <= 16).all()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert (dt >= 1e-3 - 1e-7).all() and (dt <= 1e-1 + 1e-7).all()


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_step_equals_forward_triton_backend(kind):
    """The Triton kernels (under TRITON_INTERPRET=1 on CPU) inside a model: chunked forward, chunked
    prefill with an initial state, and the fused decode step all agree."""
    model = make_model({kind: {**DELTA[kind], "head_dim": 16, "v_head_dim": 16}}, n_layer=1, backend="triton")
    check_step_equals_forward(model, T=20, B=1, splits=[7, 1, 1, 11])
    torch_model = make_model({kind: {**DELTA[kind], "head_dim": 16, "v_head_dim": 16}}, n_layer=1)
    idx = torch.randint(0, 61, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], torch_model(idx)[0], atol=1e-4, rtol=1e-4)
