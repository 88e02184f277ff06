"""Triton delta rule (kernels/triton_delta_rule.py) against a token-by-token loop, fp32 on CPU under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Shapes are kept tiny: the interpreter is slow.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.triton_delta_rule import delta_rule_step_triton, delta_rule_triton, fused_recurrent_delta_rule_triton

TOL = 1e-4  # max abs error, relative to the max abs of the reference


def loop_reference(q, k, v, g, beta, scale=None, initial_state=None):
    """The recurrence, one token at a time (differentiable; run it in float64).

    S' = Diag(exp(g_t)) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T (scale q_t).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(B, T, H, K)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        prediction = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * bt.unsqueeze(-1), vt - prediction)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, dim=1), S


def make_inputs(B, T, H, K, V, per_channel, strong_decay=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    gate_shape = (B, T, H, K) if per_channel else (B, T, H)
    if strong_decay:  # per-step log decay down to -20
        g = -20.0 * torch.rand(gate_shape, generator=gen)
    else:
        g = -F.softplus(torch.randn(gate_shape, generator=gen)) * 0.3
    beta = torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, h0


def assert_close(actual, expected, name):
    """max |actual - expected| <= TOL * max |expected|. A reference that is identically zero (dg at T=1
    without an initial state: the gate only scales a zero state) is measured against the unit scale of
    the inputs and cotangents instead, since the kernel's value there is a rounding-level cancellation."""
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    ref = expected.to(actual.dtype)
    err = (actual - ref).abs().max().item()
    ref_max = ref.abs().max().item()
    bound = TOL * (ref_max if ref_max > 0 else 1.0)
    assert err <= bound, f"{name}: max abs err {err:.3e} > {bound:.3e} (ref max {ref.abs().max().item():.3e})"


def check_against_loop(B, T, H, K, V, per_channel, with_h0, strong_decay=False, scale=None):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, per_channel, strong_decay)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen)
    d_final = torch.randn(B, H, K, V, generator=gen)
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if with_h0 else [])

    leaves64 = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)[:len(names)]]
    o_ref, s_ref = loop_reference(*leaves64[:5], scale=scale, initial_state=leaves64[5] if with_h0 else None)
    ((o_ref * do.double()).sum() + (s_ref * d_final.double()).sum()).backward()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)[:len(names)]]
    o, s = delta_rule_triton(*leaves[:5], scale=scale, initial_state=leaves[5] if with_h0 else None,
                             output_final_state=True)
    ((o * do).sum() + (s * d_final).sum()).backward()

    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V) and s.dtype == torch.float32
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final_state")
    for name, x, x_ref in zip(names, leaves, leaves64):
        assert x.grad is not None and x.grad.shape == x.shape, name
        assert_close(x.grad, x_ref.grad, f"d{name}")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_chunk_per_channel_gate_with_initial_state(T):
    check_against_loop(B=1, T=T, H=2, K=32, V=16, per_channel=True, with_h0=True)


@pytest.mark.parametrize("T", [1, 65, 130])
def test_chunk_per_head_gate(T):
    check_against_loop(B=1, T=T, H=2, K=16, V=32, per_channel=False, with_h0=False)


@pytest.mark.parametrize("per_channel,with_h0", [(True, False), (False, True)])
def test_chunk_gate_and_state_variants(per_channel, with_h0):
    check_against_loop(B=1, T=64, H=1, K=16, V=32, per_channel=per_channel, with_h0=with_h0)


@pytest.mark.parametrize("per_channel", [True, False])
def test_chunk_strong_decay_is_finite_and_matches(per_channel):
    check_against_loop(B=1, T=130, H=1, K=32, V=16, per_channel=per_channel, with_h0=True, strong_decay=True)


def test_chunk_non_power_of_two_dims_and_custom_scale():
    check_against_loop(B=2, T=70, H=1, K=24, V=20, per_channel=True, with_h0=True, scale=0.3)


def test_no_final_state_and_gradient_without_it():
    q, k, v, g, beta, _ = make_inputs(1, 65, 1, 16, 16, per_channel=True)
    o, s = delta_rule_triton(q, k, v, g, beta)
    assert s is None
    o_ref, _ = loop_reference(q.double(), k.double(), v.double(), g.double(), beta.double())
    assert_close(o, o_ref, "o")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = delta_rule_triton(*leaves)
    o.sum().backward()
    leaves64 = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    loop_reference(*leaves64)[0].sum().backward()
    for name, x, x_ref in zip("q k v g beta".split(), leaves, leaves64):
        assert_close(x.grad, x_ref.grad, f"d{name}")


@pytest.mark.parametrize("per_channel", [True, False])
def test_step_kernel_against_loop(per_channel):
    B, T, H, K, V = 2, 5, 2, 32, 16
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, per_channel, strong_decay=not per_channel)
    o_ref, s_ref = loop_reference(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                  initial_state=h0.double())
    state = h0.clone()
    for t in range(T):
        o_t = delta_rule_step_triton(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert o_t.shape == (B, H, V)
        assert_close(o_t, o_ref[:, t], f"o[{t}]")
    assert_close(state, s_ref, "state (updated in place)")


def test_fused_recurrent_few_tokens_matches_chunked():
    q, k, v, g, beta, h0 = make_inputs(1, 7, 2, 16, 32, per_channel=True)
    state = h0.clone()
    o_rec = fused_recurrent_delta_rule_triton(q, k, v, g, beta, state)
    o_chunk, s_chunk = delta_rule_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o_rec, o_chunk, "o")
    assert_close(state, s_chunk, "state")


def test_dispatch_through_kernels_package():
    import kernels
    q, k, v, g, beta, h0 = make_inputs(1, 3, 1, 16, 16, per_channel=False)
    o, s = kernels.delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    o_ref, s_ref = loop_reference(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                  initial_state=h0.double())
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final_state")
    state = h0.clone()
    o0 = kernels.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, backend="triton")
    assert_close(o0, o_ref[:, 0], "step o")


def test_bad_shapes_are_refused():
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 16, 16, per_channel=True)
    with pytest.raises(ValueError, match="g must be"):
        delta_rule_triton(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="state must be"):
        delta_rule_step_triton(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], torch.zeros(1, 1, 16, 16).double())
