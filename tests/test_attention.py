"""kernels.attention (torch backend) against a naive oracle: full score matrix, explicit mask, sinks
as an extra softmax column. Forward and gradients of q, k, v and sinks."""
import pytest
import torch

from kernels import attention


def naive_attention(q, k, v, window=None, sinks=None):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * D ** -0.5
    qpos = torch.arange(S - T, S)[:, None]
    kpos = torch.arange(S)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (kpos > qpos - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, Hq, 1, 1).expand(B, Hq, T, 1)], dim=-1)
        p = scores.softmax(-1)[..., :-1]
    else:
        p = scores.softmax(-1)
    return torch.einsum("bhts,bshd->bthd", p, v)


CASES = [  # T, S, Hq, Hkv, window
    (37, 37, 4, 4, None), (37, 37, 4, 2, 3), (37, 37, 4, 1, 1), (150, 150, 4, 2, 64), (131, 131, 2, 1, 64),
    (5, 40, 4, 2, None), (1, 40, 4, 1, 3), (13, 29, 4, 4, 64), (9, 9, 4, 2, 9), (9, 9, 4, 2, 100),
    (17, 200, 4, 1, 64), (1, 40, 4, 2, None),
]


@pytest.mark.parametrize("Dv", [12, 16])   # Dk == Dv: global attention with sinks takes SDPA's path
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("T,S,Hq,Hkv,window", CASES)
def test_attention_matches_oracle(T, S, Hq, Hkv, window, sinks, Dv):
    torch.manual_seed(T * 31 + S)
    q = torch.randn(2, T, Hq, 16, requires_grad=True)
    k = torch.randn(2, S, Hkv, 16, requires_grad=True)
    v = torch.randn(2, S, Hkv, Dv, requires_grad=True)
    s = (torch.randn(Hq) * 2).requires_grad_() if sinks else None
    out = attention(q, k, v, window=window, sinks=s, backend="torch")
    ref = naive_attention(q, k, v, window, s)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    params = [q, k, v] + ([s] if sinks else [])
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


def test_window_at_least_T_equals_global():
    q, k, v = torch.randn(1, 50, 4, 8), torch.randn(1, 50, 2, 8), torch.randn(1, 50, 2, 8)
    sinks = torch.randn(4)
    for s in (None, sinks):
        torch.testing.assert_close(attention(q, k, v, window=50, sinks=s), attention(q, k, v, sinks=s))
        torch.testing.assert_close(attention(q, k, v, window=500, sinks=s), attention(q, k, v, sinks=s))


def test_sink_minus_inf_equals_no_sinks():
    q, k, v = torch.randn(1, 50, 4, 8), torch.randn(1, 50, 2, 8), torch.randn(1, 50, 2, 8)
    no_sink = torch.full((4,), float("-inf"))
    for window in (None, 7):
        torch.testing.assert_close(attention(q, k, v, window=window, sinks=no_sink),
                                   attention(q, k, v, window=window), atol=1e-6, rtol=1e-6)


def test_sinks_take_probability_mass():
    """With a huge sink logit the attention output goes to zero (rows sum to < 1)."""
    q, k, v = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    out = attention(q, k, v, sinks=torch.full((2,), 30.0))
    assert out.abs().max() < 1e-6


def test_bad_shapes_are_refused():
    q, k, v = torch.randn(1, 10, 3, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="S >= T"):
        attention(torch.randn(1, 11, 2, 8), k, v)
    with pytest.raises(ValueError, match="window"):
        attention(torch.randn(1, 10, 2, 8), k, v, window=0)
    with pytest.raises(ValueError, match="backend"):
        attention(torch.randn(1, 10, 2, 8), k, v, backend="cuda")


def _saved_bytes(T, window):
    """Bytes autograd keeps for the backward of one attention call (what forward+backward holds)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    q = torch.randn(1, T, 2, 16, requires_grad=True)
    k = torch.randn(1, T, 2, 16, requires_grad=True)
    v = torch.randn(1, T, 2, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(q, k, v, window=window, sinks=torch.zeros(2, requires_grad=True))
    out.sum().backward()
    return total[0]


def test_no_score_matrix_is_held():
    """At T=8192 with sinks, window 128 (the blocked path) or global (SDPA with the sink channel): no T x T
    score matrix is ever held."""
    windowed, full = _saved_bytes(8192, 128), _saved_bytes(8192, None)
    scores = 8192 * 8192 * 2 * 4                      # one fp32 score matrix for the 2 heads: 537 MB
    assert windowed < scores / 10, windowed           # measured: 40 MB (query blocks of 128 x 256 keys)
    assert full < scores / 100, full                  # measured: 4.5 MB (inputs, output, log-sum-exp)
