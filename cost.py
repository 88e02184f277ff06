"""Training cost model: FLOPs per token, peak FLOP/s per device, model-FLOPs utilisation (MFU).

    from cost import train_flops_per_token, peak_flops, mfu
    f = train_flops_per_token(cfg.model, seq_len)      # FLOPs of one trained token (forward + backward)
    mfu(f, tokens_per_s, n_devices, peak_flops(device)) # None on CPU or an unknown GPU

One trained token costs (forward + backward = 3 x forward; a multiply-add is 2 FLOPs):

    6 * N_matmul  +  sum over layers of mixer_flops(layer)

N_matmul: the parameters that multiply activations: every parameter of >= 2 dims inside the blocks
(Linear weights; a depthwise short conv's [C, 1, w] weight is C * w multiply-adds per token too) plus
the output head (vocab * d_model; the tied embedding lookup itself is not a matmul). Norm weights,
biases, sinks and gate scalars are elementwise and left out.

mixer_flops: the work that is not a weight matmul (scores against keys, the recurrent state), per
token, for training, at sequence length T. ctx(W) = mean over t = 1..T of min(t, W) is the average
number of keys a causal query sees (W = T for global attention: ctx = (T + 1) / 2).

    attn   6 * Hq * (D + D) * ctx(window or T)             QK^T and PV, Hq query heads of dim D
    mla    6 * H * ((qk_nope + qk_rope) + v_head) * ctx(T)  expanded form (training and prefill)
    mla + dsa
           main: 6 * H * ((qk_nope + qk_rope) + v_head) * ctx(top_k) (stage sparse; ctx(T) in
           dense_warmup); indexer: 6 * H_I * d_I * ctx(T) (scores of every causal key, trained by L_I)
    kda, gdn (chunked delta rule, chunk C = min(64, T), per head, key dim K, value dim V), forward:
           A = (K e^G)(K e^-G)^T        2CK        T = (I + A)^-1 (forward substitution) 2C^2/3
           W = T(beta K e^G)            2CK        U = T(beta V)                          2CV
           V_new = U - W S              2KV        O = (Q e^G) S                         2KV
           P = tril(Q K^T e^(G_i-G_j))  2CK        O += P V_new                          2CV
           S <- S + (K e^..)^T V_new    2KV
           = 6KV + 6CK + 4CV + 2C^2/3, times 3 for training, times H
    linear (plain linear attention, chunked): forward 4KV + 2CK + 2CV (QS, QK^T, PV, K^T V), x 3, x H
    other kinds: parameters only (0 here; their matrices are in N_matmul)

This counts the useful work of the math, not what a kernel executes (masked halves of causal
blocks, recomputation in the backward are not counted), which is the MFU convention (PaLM, App. B).
"""
import math

# Dense bf16 tensor-core peak per device (no sparsity), matched against torch.cuda.get_device_name.
PEAK_FLOPS = {
    "H200": 989e12,   # also GH200
    "H100": 989e12,   # SXM; the PCIe card is lower (756e12)
    "A100": 312e12,
    "B200": 2250e12,
}

DELTA_RULE_CHUNK = 64


def causal_context(seq_len, window=None):
    """Mean over query positions t = 1..T of the number of keys it sees, min(t, window)."""
    T = seq_len
    if window is None or window >= T:
        return (T + 1) / 2
    W = window
    return (W * (W + 1) / 2 + (T - W) * W) / T


def _get(cfg, key, default=None):
    """A field of a config dataclass or dict (sub-blocks like `dsa:` may be either)."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def mixer_flops(layer_cfg, seq_len):
    """Training FLOPs per token of one mixer beyond its weight matmuls (see the module docstring)."""
    kind, T = layer_cfg.kind, seq_len
    if kind == "attn":
        D = layer_cfg.head_dim
        return 6 * layer_cfg.n_heads * (D + D) * causal_context(T, layer_cfg.window)
    if kind == "mla":
        H = layer_cfg.n_heads
        qk = _get(layer_cfg, "qk_nope_dim", 0) + _get(layer_cfg, "qk_rope_dim", 0)
        v = _get(layer_cfg, "v_head_dim", 0)
        dsa = _get(layer_cfg, "dsa")
        if not dsa:
            return 6 * H * (qk + v) * causal_context(T)
        sparse = _get(dsa, "stage", "sparse") != "dense_warmup"
        main = 6 * H * (qk + v) * causal_context(T, _get(dsa, "top_k") if sparse else None)
        n_idx = _get(dsa, "n_heads", _get(dsa, "index_n_heads", 4))
        d_idx = _get(dsa, "head_dim", _get(dsa, "index_head_dim", 64))
        return main + 6 * n_idx * d_idx * causal_context(T)
    if kind in ("kda", "gdn", "linear"):
        H, K = layer_cfg.n_heads, _get(layer_cfg, "head_dim")
        V = _get(layer_cfg, "v_head_dim") or K
        C = min(_get(layer_cfg, "chunk_size") or DELTA_RULE_CHUNK, T)
        if kind == "linear":
            fwd = 4 * K * V + 2 * C * K + 2 * C * V
        else:
            fwd = 6 * K * V + 6 * C * K + 4 * C * V + 2 * C * C / 3
        return 3 * H * fwd
    return 0.0


def _matrix_params(module):
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def layer_costs(model_cfg, seq_len):
    """Per layer: {'kind', 'matmul_params', 'mixer_flops', 'flops'} (training FLOPs per token)."""
    import torch

    from model import Block
    out = []
    for c in model_cfg.layer_configs():
        try:
            with torch.device("meta"):  # shapes only, no memory, no init cost
                block = Block(c, model_cfg)
        except Exception:  # a mixer whose constructor needs real tensors
            block = Block(c, model_cfg)
        n = _matrix_params(block)
        extra = mixer_flops(c, seq_len)
        out.append({"kind": c.kind, "matmul_params": n, "mixer_flops": extra, "flops": 6 * n + extra})
    return out


def train_flops_per_token(model_cfg, seq_len):
    """FLOPs to train on one token (forward + backward) of a sequence of seq_len tokens."""
    head = model_cfg.vocab_size * model_cfg.d_model
    return 6 * head + sum(layer["flops"] for layer in layer_costs(model_cfg, seq_len))


def peak_flops(device):
    """Peak dense bf16 FLOP/s of `device` (a torch.device or string), None for CPU or an unknown GPU."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def mfu(flops_per_token, tokens_per_s, n_devices, peak):
    """Model-FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak or not math.isfinite(tokens_per_s):
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)
