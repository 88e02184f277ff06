"""Layer options of the published hybrids (SPEC 12): attention output gate, partial RoPE, attention
biases, delta-rule value heads grouped over key heads, an untied output head. Each option: step ==
forward, and an identity to the layer without it."""
import pytest
import torch
import torch.nn.functional as F

import model as M
from model import ConfigError, ModelConfig
from test_model import check_step_equals_forward, make_model

ATTN = {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "head_dim": 16}
OPTIONS = {
    "output_gate": {**ATTN, "output_gate": True},
    "rope_quarter": {**ATTN, "rope_fraction": 0.25},
    "bias": {**ATTN, "bias": True, "output_gate": True, "window": 5, "sinks": True},
    "qwen3_next_attn": {**ATTN, "output_gate": True, "rope_fraction": 0.25, "qk_norm": True},
    "gdn_grouped_v": {"kind": "gdn", "n_heads": 2, "n_v_heads": 4, "head_dim": 8, "v_head_dim": 6},
    "kda_grouped_v": {"kind": "kda", "n_heads": 2, "n_v_heads": 6, "head_dim": 8},
    "linear_grouped_v": {"kind": "linear", "n_heads": 2, "n_v_heads": 4, "head_dim": 8},
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_step_equals_forward(name):
    check_step_equals_forward(make_model({name: OPTIONS[name]}, n_layer=2), T=23)


def test_untied_head_step_equals_forward_and_equals_tied_when_copied():
    tied = make_model({"a": ATTN}, n_layer=2)
    untied = make_model({"a": ATTN}, n_layer=2, tie_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_params() == tied.num_params() + 61 * 32
    check_step_equals_forward(untied, T=17)
    untied.load_state_dict(tied.state_dict())   # the tied state dict holds the head under both names
    idx = torch.randint(0, 61, (2, 9))
    assert torch.equal(untied(idx)[0], tied(idx)[0])


def naive_rope(x, positions, r, theta):
    """Rotate pairs (x[i], x[i + r/2]) for i < r/2 by position * theta**(-2i/r), one pair at a time."""
    out = x.clone()
    for t, p in enumerate(positions.tolist()):
        for i in range(r // 2):
            a = p * theta ** (-2 * i / r)
            c, s = torch.tensor(a).cos(), torch.tensor(a).sin()
            x1, x2 = x[:, t, :, i], x[:, t, :, i + r // 2]
            out[:, t, :, i], out[:, t, :, i + r // 2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_partial_rope_rotates_the_first_dims_only(fraction):
    cfg = ModelConfig.from_dict({"d_model": 32, "layers": {"a": {**ATTN, "rope_fraction": fraction}},
                                 "pattern": ["a"]}).layers["a"]
    assert cfg.rope_dim == int(16 * fraction)
    x = torch.randn(2, 5, 3, 16)
    positions = torch.arange(3, 8)
    cos, sin = M.rope_angles(positions, cfg.rope_dim, 10000.0)
    torch.testing.assert_close(M.apply_rope(x, cos, sin), naive_rope(x, positions, cfg.rope_dim, 10000.0))


@pytest.mark.parametrize("fraction,per_row", [(1.0, False), (0.5, False), (0.5, True)])
def test_rope_backward_is_the_inverse_rotation(fraction, per_row):
    """The hand-written backward (rotate the gradient by -angle) == autograd through the naive rotation."""
    r = int(16 * fraction)
    x = torch.randn(2, 5, 3, 16, requires_grad=True)
    positions = torch.arange(3, 8)
    cos, sin = M.rope_angles(positions.expand(2, 5) if per_row else positions, r, 10000.0)
    g = torch.randn(2, 5, 3, 16)
    ours, = torch.autograd.grad(M.apply_rope(x, cos, sin), x, g)
    naive, = torch.autograd.grad(naive_rope(x, positions, r, 10000.0), x, g)
    torch.testing.assert_close(ours, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_backward_by_hand_equals_autograd(dtype):
    """SwiGLU's SiluMul (silu(gate) * up, backward by hand) == autograd through silu and the product,
    forward and both gradients, bit for bit; g left untouched."""
    gate = torch.randn(3, 7, 24, dtype=dtype, requires_grad=True)
    up = torch.randn(3, 7, 24, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 7, 24, dtype=dtype)
    g_before = g.clone()
    ours = M.SiluMul.apply(gate, up)
    ref = F.silu(gate) * up
    got = torch.autograd.grad(ours, (gate, up), g)
    want = torch.autograd.grad(ref, (gate, up), g)
    assert torch.equal(ours, ref) and torch.equal(g, g_before)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("n, k", [(683, 256), (256, 683), (300, 270)])
def test_padded_linear_equals_linear(n, k):
    """model.linear pads an odd width (n: the output, in forward; k: dx's width, in backward) to a multiple of
    16 for the matmul and cuts the result back: the same output and both gradients as F.linear (to fp32
    rounding: the padded product is another sgemm), on 1,024 rows (where it pads)."""
    torch.manual_seed(0)
    x = torch.randn(4, 256, k, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(n, k) * k ** -0.5).requires_grad_()
    g = torch.randn(4, 256, n)
    ours = M.linear(x, w)
    assert type(ours.grad_fn).__name__ == "PaddedLinearBackward"
    ref = F.linear(x.double(), w.double())
    got = torch.autograd.grad(ours, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g.double())
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_linear_pads_only_where_it_pays():
    """Aligned widths, narrow layers, few rows and bf16 take F.linear's own path (no padding);
    SwiGLU at hidden 683 (Qwen3-Next's) pads its three matmuls and equals its formula."""
    w = torch.randn(683, 256, requires_grad=True)
    fn = lambda x, w: type(M.linear(x, w).grad_fn).__name__
    assert fn(torch.randn(1024, 256), w) == "PaddedLinearBackward"
    assert fn(torch.randn(1023, 256), w) != "PaddedLinearBackward"                          # few rows
    assert fn(torch.randn(1024, 256), torch.randn(688, 256, requires_grad=True)) != "PaddedLinearBackward"
    assert fn(torch.randn(1024, 256), torch.randn(100, 256, requires_grad=True)) != "PaddedLinearBackward"
    assert fn(torch.randn(1024, 256).bfloat16(), w.bfloat16()) != "PaddedLinearBackward"
    mlp = M.SwiGLU(256, 683)
    x = torch.randn(2, 512, 256, requires_grad=True)
    y = mlp(x)
    torch.testing.assert_close(y, mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x)), rtol=1e-5, atol=1e-6)
    dx, = torch.autograd.grad(y.sum(), x)
    dx_ref, = torch.autograd.grad(mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x)).sum(), x)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)


def naive_short_conv(past, u, w, doc_pos):
    """silu(sum_s w[W-1-s] x[t-s]) token by token over x = [past | u], skipping taps that reach before
    the token's document (doc_pos [T]: position in its document)."""
    W, T = w.shape[0], u.shape[1]
    x = torch.cat([past, u], dim=1)
    rows = []
    for t in range(T):
        taps = [w[W - 1 - s] * x[:, W - 1 + t - s] for s in range(W) if doc_pos is None or doc_pos[t] >= s]
        rows.append(F.silu(sum(taps)))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("T,packed", [(11, False), (11, True), (2, False), (1, False)])
def test_short_conv_by_hand_equals_the_token_loop(T, packed):
    """ShortConv (taps fused into one buffer, backward by hand) == the token-by-token convolution, forward
    and the gradients of the past, the inputs and the filter (fp64); T below the filter's width reads the
    past only; packed documents drop the taps that reach into the previous document."""
    torch.manual_seed(0)
    B, C, W = 2, 6, 4
    past = torch.randn(B, W - 1, C, dtype=torch.float64, requires_grad=True)
    u = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(W, C, dtype=torch.float64, requires_grad=True)
    doc_pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5])[:T] if packed else None
    if packed:
        past = torch.zeros_like(past, requires_grad=True)                # packed rows start a document
    g = torch.randn(B, T, C, dtype=torch.float64)
    ours = M.ShortConv.apply(past, u, w, doc_pos)
    naive = naive_short_conv(past, u, w, doc_pos)
    torch.testing.assert_close(ours, naive)
    for a, b in zip(torch.autograd.grad(ours, (past, u, w), g), torch.autograd.grad(naive, (past, u, w), g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("what", ["rms_norm", "l2_norm", "silu_mul", "rope", "short_conv"])
def test_hand_written_functions_compile_without_graph_breaks(what):
    """The autograd Functions on the CPU hot path give way to their formulas under torch.compile, which trace
    whole (fullgraph=True; aot_eager: the capture is what is tested) and give eager's values and gradients
    (the Functions' eager paths write into views with out=, which Dynamo refuses, and torch 2.11 differentiates
    a compiled Function whose forward returns a tensor it wrote in place wrongly: model.scale_norm). Checked
    under torch 2.11 too (a side venv)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16, requires_grad=True)
    cos, sin = M.rope_angles(torch.arange(5), 8, 10000.0)
    norm = M.RMSNorm(16)
    f = {"rms_norm": norm, "l2_norm": M.l2norm, "silu_mul": lambda x: M.silu_mul(x, x.flip(-1)),
         "rope": lambda x: M.apply_rope(x, cos, sin),
         "short_conv": lambda x: M.short_conv(x[:, :3, 0], x[:, :, 1], x[0, :4, 2], None)}[what]
    g = torch.randn_like(f(x))
    eager = f(x), *torch.autograd.grad(f(x), x, g)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    for a, b in zip((y, *torch.autograd.grad(y, x, g)), eager):
        torch.testing.assert_close(a, b)


def test_rope_of_a_strided_view_equals_the_naive_rotation():
    """apply_rope on q sliced out of a fused q|k|v projection (a strided view, as in Attention) == the naive
    rotation of a contiguous copy, forward and backward, full and partial RoPE."""
    qkv = torch.randn(2, 5, 3 * 3 * 16, requires_grad=True)
    positions = torch.arange(3, 8)
    for r in (16, 8):
        q = qkv[..., :48].view(2, 5, 3, 16)
        cos, sin = M.rope_angles(positions, r, 10000.0)
        g = torch.randn(2, 5, 3, 16)
        ours = M.apply_rope(q, cos, sin)
        naive = naive_rope(q.contiguous(), positions, r, 10000.0)
        torch.testing.assert_close(ours, naive)
        torch.testing.assert_close(torch.autograd.grad(ours, qkv, g)[0], torch.autograd.grad(naive, qkv, g)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["rms", "l2"])
def test_norm_backward_by_hand_equals_autograd(dtype, norm):
    """ScaleNorm (RMSNorm, and the L2 norm of KDA/GDN's q, k): forward and hand-written backward ==
    autograd through the fp32 formula, and the incoming gradient is left untouched."""
    x = torch.randn(3, 7, 2, 16, dtype=dtype, requires_grad=True)
    w = (1 + 0.5 * torch.randn(16)).requires_grad_(norm == "rms")

    def formula(x):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w if norm == "rms" else \
            (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return y

    ours = M.ScaleNorm.apply(x, w, 1e-6, 16) if norm == "rms" else M.l2norm(x)
    ref = formula(x)
    assert ours.dtype == ref.dtype
    g = torch.randn_like(ref)
    g_before = g.clone()
    inputs = [x, w] if norm == "rms" else [x]
    got, want = torch.autograd.grad(ours, inputs, g), torch.autograd.grad(ref, inputs, g)
    assert torch.equal(g, g_before)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(ours, ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_norm_and_rope_keep_little_for_backward():
    """RMSNorm keeps x and its [..., 1] scale only; RoPE keeps only its angles (nothing the size of x)."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    norm = M.RMSNorm(16)
    kept = {}

    def pack(t):
        kept[t.data_ptr()] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        normed = norm(x)        # outputs kept alive: a freed graph's address reused would be counted once
        rotated = M.apply_rope(x.view(4, 8, 2, 8), *M.rope_angles(torch.arange(8), 8, 10000.0))
    assert normed.grad_fn is not None and rotated.grad_fn is not None
    assert sum(kept.values()) == x.nbytes + 4 * 8 * 4 + norm.weight.nbytes + 2 * 8 * 4 * 4


def test_output_gate_at_zero_weights_halves_the_output():
    gated = make_model({"a": {**ATTN, "output_gate": True}}, n_layer=2)
    plain = make_model({"a": ATTN}, n_layer=2)
    sd = {k: v for k, v in gated.state_dict().items() if ".wg." not in k}
    plain.load_state_dict(sd)
    with torch.no_grad():
        for block in gated.blocks:
            block.mixer.wg.weight.zero_()           # sigmoid(0) = 1/2 on every channel
        for block in plain.blocks:
            block.mixer.wo.weight.mul_(0.5)
    idx = torch.randint(0, 61, (2, 11))
    torch.testing.assert_close(gated(idx)[0], plain(idx)[0], rtol=1e-5, atol=1e-5)


def test_zero_biases_equal_no_biases():
    biased = make_model({"a": {**ATTN, "bias": True}}, n_layer=2)
    plain = make_model({"a": ATTN}, n_layer=2)
    plain.load_state_dict({k: v for k, v in biased.state_dict().items() if not k.endswith(".bias")})
    idx = torch.randint(0, 61, (2, 11))
    assert torch.equal(biased(idx)[0], plain(idx)[0])  # biases start at zero


def test_n_v_heads_equal_to_n_heads_is_the_plain_layer():
    base = {"kind": "gdn", "n_heads": 2, "head_dim": 8}
    a = make_model({"g": base}, n_layer=2)
    b = make_model({"g": {**base, "n_v_heads": 2}}, n_layer=2)
    idx = torch.randint(0, 61, (2, 11))
    assert torch.equal(a(idx)[0], b(idx)[0])


@pytest.mark.parametrize("kind", ["gdn", "kda", "linear"])
def test_grouped_value_heads_equal_repeated_key_heads(kind):
    """H key heads serving r*H value heads == r*H key heads whose q/k rows (and conv filters) are
    each key head's copied r times in a row."""
    K, H, r = 8, 2, 3
    grouped = make_model({"g": {"kind": kind, "n_heads": H, "n_v_heads": r * H, "head_dim": K}}, n_layer=1)
    full = make_model({"g": {"kind": kind, "n_heads": r * H, "head_dim": K}}, n_layer=1)
    sd = grouped.state_dict()
    for name in ("blocks.0.mixer.w_qkv.weight", "blocks.0.mixer.conv"):
        q, k, v = sd[name].split([H * K, H * K, r * H * K])
        rep = lambda w: w.view(H, K, -1).repeat_interleave(r, dim=0).reshape(r * H * K, -1)  # noqa: E731
        sd[name] = torch.cat([rep(q), rep(k), v])
    full.load_state_dict(sd)
    idx = torch.randint(0, 61, (2, 13))
    torch.testing.assert_close(grouped(idx)[0], full(idx)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer, message", [
    ({**ATTN, "rope_fraction": 0.0}, "model.layers.a.rope_fraction: must be in (0, 1]"),
    ({**ATTN, "rope_fraction": 0.1}, "model.layers.a.rope_fraction: must be a share of head_dim=16"),
    ({**ATTN, "output_gate": "yes"}, "model.layers.a.output_gate: must be true or false"),
    ({"kind": "gdn", "n_heads": 2, "n_v_heads": 3}, "model.layers.a.n_v_heads: must be a multiple of n_heads=2"),
])
def test_bad_options_are_refused_in_one_line(layer, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({"d_model": 32, "layers": {"a": layer}, "pattern": ["a"]})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
