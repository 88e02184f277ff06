"""Cost model of a config: parameters, training FLOPs, decode cache, decode FLOPs and bytes, and a
roofline estimate of decode time on an H200 (SPEC 6), per layer kind and in total.

    python cost.py configs/kimi_linear.yaml                 # the table
    python cost.py configs/default.yaml --seq_len 4096 --ctx 131072 --dtype_bytes 2

Everything is counted from the math, per token, batch 1, no kernel overheads:
  * a matmul x[n] @ W[n, m] costs 2nm FLOPs; training = 3 x forward (backward = 2 x forward);
  * softmax attention: q.k and p.v cost 2*Hq*Dk and 2*Hq*Dv per key seen; in training a causal
    query t sees min(t+1, W) keys (only the unmasked half is counted);
  * chunked delta rule (chunk C = 64) per head and token: the state terms W S, q S and k^T V_new
    (2KV each) plus the intra-chunk terms: k k^T and q k^T (C*K each, causal halves), the
    triangular solve (C^2/3), T (beta k) and T (beta v) (C*K, C*V), A_qk V_new (C*V); linear
    attention has only q S, k^T v and the q k^T, A v terms. Decode: 7KV (decay, S^T k, rank-1
    update, S^T q) for the delta rule, 4KV for linear attention;
  * MLA decodes in the absorbed form (SPEC 2): q_nope -> latent (2*H*nope*d_c), scores over the
    latent + rope key (2*H*(d_c+rope) per key), output in latent space (2*H*d_c per key), W_UV
    (2*H*d_c*v); W_UKV is not applied per token. DSA: the indexer scores every key
    (2*H_I*d_I per key) and the main attention reads only min(top_k, L) keys;
  * decode bytes = every weight read once (dtype_bytes) + the cache read (attention) or the state
    read and written (delta rule, fp32); roofline time = max(FLOPs / peak, bytes / bandwidth).
  * MFA (H heads of C = head_dim, share_q_dim r): matmuls d*r + r*H*C + d*C (+ d*C for S_V) + H*C*d;
    attention 4*H*C per key seen; MFA-KR applies its value map N (C x C) once per head after the
    attention: 2*H*C*C FLOPs per token (no S_V). Decode reads the whole cache;
  * NSA (Hq, Hkv heads of D; l = cmp_block, d = cmp_stride, l' = sel_block, n = n_sel, w = window):
    matmuls d*Hq*D (q) + 6*d*Hkv*D (three K/V pairs) + 3*d*Hq (gates) + Hq*D*d; the compression MLPs
    (2 x (l*D*D + D*D) weights, per kv head) run once per stride: 2 x that x Hkv / d FLOPs per token.
    A query at position t attends n_cmp(t+1) compressed keys, min(t+1, n*l') selected keys (an upper
    bound: the query's own block may be partly in the future) and min(t+1, w) window keys, 4*Hq*D per
    key; the block scores recompute the compressed scores (2*Hq*D per compressed key, forward only).
    Decode reads the compressed, selected, window and pending compression rows.
Cache bytes (SPEC 6): attention L_eff*2*Hkv*D (L_eff = min(L, W)); MLA L*(d_c + rope) (+ L*d_I for
the DSA indexer); delta rule H*K*V*4 + conv state (conv_size-1)*(2HK+HV), independent of L;
MFA L*2*C (L*C with key reuse), whatever the head count; NSA 2*Hkv*D * (L raw + n_cmp(L) compressed +
min(L, w) window ring + min(L, l-1) pending compression rows: the next compressed blocks' inputs),
n_cmp(L) = max(0, floor((L-l)/d) + 1). SPEC 6 writes every NSA and MFA formula out.
"""
import argparse
import os
import math
import sys
from types import SimpleNamespace

H200_FLOPS = 989e12       # dense bf16 FLOP/s
H200_BW = 4.8e12          # HBM3e bytes/s
# Dense bf16 tensor-core peak per device (no sparsity), matched against torch.cuda.get_device_name.
PEAK_FLOPS = {"H200": H200_FLOPS, "H100": 989e12, "A100": 312e12, "B200": 2250e12}
CONTEXTS = (4096, 32768, 131072, 1048576)
DELTA_CHUNK = 64


def _get(obj, key, default=None):
    """Attribute or dict entry (MLA's `dsa` block may be either)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def keys_seen_avg(T, window=None):
    """Mean number of keys a causal query sees over positions 0..T-1 with an optional window."""
    W = T if window is None else min(window, T)
    return (W * (W + 1) / 2 + (T - W) * W) / T


# ----------------------------------------------------------------------------------------------
# per mixer: parameters (matmul part and the rest), cache, FLOPs


def mixer_cost(lc, d, seq_len, ctx, dtype_bytes=2):
    """Costs of one mixer layer with config `lc` in a model of width d.

    Returns dict: params, matmul_params (weights used as matmuls per token in training),
    train_flops (per token, forward + backward, sequence length seq_len), cache_bytes_per_token,
    cache_bytes (at context ctx), decode_flops, decode_bytes (one new token at context ctx)."""
    kind = lc.kind
    if kind == "attn":
        Hq, Hkv, D, W = lc.n_heads, lc.n_kv_heads, lc.head_dim, lc.window
        gate = _get(lc, "output_gate", False)
        mm = d * Hq * D + 2 * d * Hkv * D + Hq * D * d + (d * Hq * D if gate else 0)
        biases = (Hq * D + 2 * Hkv * D + d + (Hq * D if gate else 0)) if _get(lc, "bias", False) else 0
        params = mm + biases + (2 * D if lc.qk_norm else 0) + (Hq if lc.sinks else 0)
        attn_fwd = 4 * Hq * D * keys_seen_avg(seq_len, W)
        L_eff = ctx if W is None else min(ctx, W)
        per_tok = 2 * Hkv * D * dtype_bytes
        cache = L_eff * per_tok
        return dict(params=params, train_flops=3 * (2 * mm + attn_fwd), cache_bytes_per_token=0 if W else per_tok,
                    cache_bytes=cache, decode_flops=2 * mm + 4 * Hq * D * L_eff,
                    decode_bytes=params * dtype_bytes + cache)
    if kind in ("kda", "gdn", "linear"):
        Hk, H, K, V = lc.n_heads, _get(lc, "n_v_heads") or lc.n_heads, lc.head_dim, lc.v_head_dim  # H: value heads
        ch = 2 * Hk * K + H * V                         # q, k, v channels
        mm = d * ch
        other = ch * lc.conv_size
        if kind != "linear":
            mm += d * H                                 # beta
            mm += (d * K + K * H * K) if kind == "kda" else d * H          # gate (low rank for kda)
            other += H + (H * K if kind == "kda" else H)                    # A_log, dt_bias
        if lc.output_gate:
            mm += (d * V + V * H * V) if kind == "kda" else d * H * V
            other += V                                  # o_norm
        mm += H * V * d                                 # wo
        C = min(DELTA_CHUNK, seq_len)
        if kind == "linear":
            head_fwd = 4 * K * V + C * K + C * V
            head_dec = 4 * K * V
        else:
            head_fwd = 6 * K * V + C * (3 * K + 2 * V) + C * C / 3
            head_dec = 7 * K * V
        conv_flops = 2 * lc.conv_size * ch
        state = H * K * V * 4
        conv_state = max(lc.conv_size - 1, 0) * ch * dtype_bytes
        params = mm + other
        return dict(params=params, train_flops=3 * (2 * mm + conv_flops + H * head_fwd), cache_bytes_per_token=0,
                    cache_bytes=state + conv_state, decode_flops=2 * mm + conv_flops + H * head_dec,
                    decode_bytes=params * dtype_bytes + 2 * state + conv_state)
    if kind == "mla":
        return _mla_cost(lc, d, seq_len, ctx, dtype_bytes)
    if kind == "mfa":
        return _mfa_cost(lc, d, seq_len, ctx, dtype_bytes)
    if kind == "nsa":
        return _nsa_cost(lc, d, seq_len, ctx, dtype_bytes)
    raise ValueError(f"cost: unknown mixer kind {kind!r}")


def _mla_cost(lc, d, seq_len, ctx, dtype_bytes):
    H, r, dc = lc.n_heads, _get(lc, "q_lora_rank") or 0, lc.kv_lora_rank
    nope, v = lc.qk_nope_dim, lc.v_head_dim
    rope = lc.qk_rope_dim                       # rotated, or an unrotated shared key part under NoPE
    q_mm = (d * r + r * H * (nope + rope)) if r else d * H * (nope + rope)
    dkv_mm = d * (dc + rope)
    ukv_mm = dc * H * (nope + v)
    o_mm = H * v * d
    norms = (r if r else 0) + dc
    mm = q_mm + dkv_mm + ukv_mm + o_mm
    params = mm + norms
    dsa = _get(lc, "dsa")
    per_tok = (dc + rope) * dtype_bytes
    top_k = None
    idx_fwd = idx_dec = idx_mm = idx_cache = 0
    if dsa is not None:
        HI, dI, top_k = _get(dsa, "n_heads"), _get(dsa, "head_dim"), _get(dsa, "top_k")
        idx_mm = (r if r else d) * HI * dI + d * dI + d * HI      # q_I, k_I, head weights
        params += idx_mm + 2 * dI                                   # + LayerNorm on k_I
        idx_fwd = 2 * idx_mm + 2 * HI * dI * keys_seen_avg(seq_len)
        idx_cache = ctx * dI * dtype_bytes
        idx_dec = 2 * idx_mm + 2 * HI * dI * ctx
    # training: the expanded form; with DSA each query attends to at most top_k keys
    attn_fwd = 2 * H * (nope + rope + v) * keys_seen_avg(seq_len, top_k)
    train = 3 * (2 * mm + attn_fwd + idx_fwd)
    # decode: the absorbed form over the latent cache
    n_sel = ctx if top_k is None else min(top_k, ctx)
    dec = 2 * (q_mm + dkv_mm + o_mm) + 2 * H * nope * dc + 2 * H * dc * v \
        + 2 * H * (dc + rope) * n_sel + 2 * H * dc * n_sel + idx_dec
    cache = ctx * per_tok + idx_cache
    read = n_sel * per_tok + idx_cache
    return dict(params=params, train_flops=train, cache_bytes_per_token=per_tok + (dI * dtype_bytes if dsa else 0),
                cache_bytes=cache, decode_flops=dec, decode_bytes=params * dtype_bytes + read)


def _mfa_cost(lc, d, seq_len, ctx, dtype_bytes):
    H, C, r, kr = lc.n_heads, lc.head_dim, lc.share_q_dim, lc.key_reuse
    mm = d * r + r * H * C + d * C + (0 if kr else d * C) + H * C * d
    params = mm + r + (C * C + C if kr else 0)            # + q_norm; MFA-KR: N and alpha
    kr_flops = 2 * H * C * C if kr else 0
    per_tok = (1 if kr else 2) * C * dtype_bytes
    return dict(params=params, train_flops=3 * (2 * mm + kr_flops + 4 * H * C * keys_seen_avg(seq_len)),
                cache_bytes_per_token=per_tok, cache_bytes=ctx * per_tok,
                decode_flops=2 * mm + kr_flops + 4 * H * C * ctx, decode_bytes=params * dtype_bytes + ctx * per_tok)


def n_compressed(L, l, d):
    """NSA compressed blocks complete within L keys: max(0, floor((L - l) / d) + 1)."""
    return max(0, (L - l) // d + 1)


def compressed_seen_avg(T, l, d):
    """Mean of n_compressed(t + 1) over t = 0 .. T-1 (sum of floor(u/d) + 1 for u = 0 .. T-l)."""
    if T < l:
        return 0.0
    q, r = divmod(T - l, d)
    return (T - l + 1 + d * q * (q - 1) // 2 + q * (r + 1)) / T


def _nsa_cost(lc, d, seq_len, ctx, dtype_bytes):
    Hq, Hkv, D = lc.n_heads, lc.n_kv_heads, lc.head_dim
    l, stride, n_keys, w = lc.cmp_block, lc.cmp_stride, lc.n_sel * lc.sel_block, lc.window
    mm = d * Hq * D + 6 * d * Hkv * D + 3 * d * Hq + Hq * D * d
    cmp_mlp = 2 * (l * D * D + D * D)                     # the key and the value MLP
    params = mm + cmp_mlp + 2 * l * D                     # + intra-block position embeddings
    cmp_flops = 2 * cmp_mlp * Hkv / stride                # one block per stride and kv head
    seen_cmp = compressed_seen_avg(seq_len, l, stride)
    keys = seen_cmp + keys_seen_avg(seq_len, n_keys) + keys_seen_avg(seq_len, w)
    train = 3 * (2 * mm + cmp_flops + 4 * Hq * D * keys) + 2 * Hq * D * seen_cmp
    row = 2 * Hkv * D * dtype_bytes                       # one K and V row of every kv head
    n_cmp = n_compressed(ctx, l, stride)
    read = n_cmp + min(ctx, n_keys) + min(ctx, w) + min(ctx, l - 1)
    return dict(params=params, train_flops=train, cache_bytes_per_token=row * (1 + 1 / stride),
                cache_bytes=row * (ctx + n_cmp + min(ctx, w) + min(ctx, l - 1)),
                decode_flops=2 * mm + cmp_flops + 4 * Hq * D * (n_cmp + min(ctx, n_keys) + min(ctx, w))
                + 2 * Hq * D * n_cmp, decode_bytes=params * dtype_bytes + row * read)


# ----------------------------------------------------------------------------------------------
# whole model


def _model_parts(model_cfg):
    """(d, vocab, hidden, [layer configs]) from a ModelConfig or a namespace with the same fields."""
    if hasattr(model_cfg, "layer_configs"):
        layers = model_cfg.layer_configs()
    else:
        pat = model_cfg.pattern
        layers = [model_cfg.layers[pat[i % len(pat)]] for i in range(model_cfg.n_layer)]
    layers = [SimpleNamespace(**lc) if isinstance(lc, dict) else lc for lc in layers]
    return model_cfg.d_model, model_cfg.vocab_size, model_cfg.mlp, layers


def _mlp_cost(mlp, d, n_layer):
    """(parameters, parameters active per token) of the MLPs of all layers. MoE (SPEC 10): a token
    uses top_k of the n_experts routed experts, the shared expert(s) and the router."""
    if _get(mlp, "kind", "swiglu") != "moe":
        p = 3 * d * _get(mlp, "hidden") * n_layer
        return p, p
    k_dense = _get(mlp, "first_k_dense", 0)
    dense = 3 * d * _get(mlp, "dense_hidden") * k_dense
    expert, E = 3 * d * _get(mlp, "hidden"), _get(mlp, "n_experts")
    bias = _get(mlp, "bias", False)
    expert += (2 * _get(mlp, "hidden") + d) if bias else 0                              # gpt-oss's biases
    shared_hidden = _get(mlp, "shared_hidden") or _get(mlp, "n_shared", 0) * _get(mlp, "hidden")
    always = 3 * d * shared_hidden + (d if _get(mlp, "shared_gate") else 0) + (d + bias) * E  # shared + gate + router
    n_moe = n_layer - k_dense
    return dense + n_moe * (E * expert + always), dense + n_moe * (_get(mlp, "top_k") * expert + always)


def _dense_cost(d, vocab, mlp, n_layer, dtype_bytes, untied=False):
    """Everything outside the mixers: embedding (+ the head unless tied), MLPs (dense or MoE), norms.
    FLOPs and decode bytes count the active parameters only."""
    mlp_params, mlp_active = _mlp_cost(mlp, d, n_layer)
    params = vocab * d * (2 if untied else 1) + mlp_params + (2 * n_layer + 1) * d
    mm = mlp_active + vocab * d                         # the head is a matmul, the lookup is not
    active = params - mlp_params + mlp_active
    return dict(params=params, active_params=active, train_flops=3 * 2 * mm, cache_bytes_per_token=0,
                cache_bytes=0, decode_flops=2 * mm, decode_bytes=active * dtype_bytes)


def layer_table(model_cfg, seq_len, ctx, dtype_bytes=2):
    """Rows per layer kind (grouped by identical config) + 'dense' + 'total': name, n, and the
    mixer_cost fields summed over the layers of that kind."""
    d, vocab, mlp, layers = _model_parts(model_cfg)
    untied = not _get(model_cfg, "tie_embeddings", True)
    names = {}
    if hasattr(model_cfg, "pattern"):
        pat = model_cfg.pattern
        for i in range(len(layers)):
            names.setdefault(pat[i % len(pat)], []).append(layers[i])
    else:
        for lc in layers:
            names.setdefault(lc.kind, []).append(lc)
    rows = []
    for name, lcs in names.items():
        c = mixer_cost(lcs[0], d, seq_len, ctx, dtype_bytes)
        c["active_params"] = c["params"]
        rows.append({"name": f"{name} ({lcs[0].kind})", "n": len(lcs), **{k: v * len(lcs) for k, v in c.items()}})
    rows.append({"name": "embed+mlp+norms", "n": len(layers),
                 **_dense_cost(d, vocab, mlp, len(layers), dtype_bytes, untied)})
    total = {"name": "total", "n": len(layers)}
    for key in rows[0]:
        if key not in ("name", "n"):
            total[key] = sum(r[key] for r in rows)
    rows.append(total)
    for r in rows:
        r["decode_s"] = roofline(r["decode_flops"], r["decode_bytes"])
    return rows


def roofline(flops, nbytes, peak=H200_FLOPS, bw=H200_BW):
    """Time of one decode step on an H200: max(compute time, memory time)."""
    return max(flops / peak, nbytes / bw)


def num_params(model_cfg):
    return layer_table(model_cfg, 1, 1)[-1]["params"]


def active_params(model_cfg):
    """Parameters a token uses (MoE: top_k routed experts + shared + router; = num_params if dense)."""
    return layer_table(model_cfg, 1, 1)[-1]["active_params"]


def train_flops_per_token(model_cfg, seq_len):
    """Training FLOPs (forward + backward) per token at sequence length seq_len."""
    return layer_table(model_cfg, seq_len, 1)[-1]["train_flops"]


def peak_flops(device):
    """Peak dense bf16 FLOP/s of `device` (a torch.device or string), None for CPU or an unknown GPU."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_FLOPS.items() if key in name), None)


def mfu(flops_per_token, tokens_per_s, n_devices, peak):
    """Model-FLOPs utilisation in [0, 1] (train_flops_per_token * tokens/s / peak), None without a peak."""
    if not peak or not math.isfinite(tokens_per_s):
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)


def cache_bytes(model_cfg, ctx, dtype_bytes=2):
    """Decode cache bytes of the whole model (batch 1) at context ctx."""
    return layer_table(model_cfg, 1, ctx, dtype_bytes)[-1]["cache_bytes"]


def decode_cost(model_cfg, ctx, dtype_bytes=2):
    """(FLOPs, bytes, roofline seconds) of decoding one token at context ctx, batch 1."""
    t = layer_table(model_cfg, 1, ctx, dtype_bytes)[-1]
    return t["decode_flops"], t["decode_bytes"], t["decode_s"]


# ----------------------------------------------------------------------------------------------
# report


def human(x, unit=""):
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def ctx_label(L):
    """4096 -> 4k, 1048576 -> 1M."""
    return f"{L // 1048576}M" if L >= 1048576 and L % 1048576 == 0 else f"{L // 1024}k" if L % 1024 == 0 else str(L)


def report(model_cfg, seq_len, ctx, dtype_bytes=2):
    """The cost tables as markdown text."""
    rows = layer_table(model_cfg, seq_len, ctx, dtype_bytes)
    at = {L: layer_table(model_cfg, seq_len, L, dtype_bytes) for L in CONTEXTS}
    head = ["layer kind", "n", "params", f"train FLOPs/tok @T={seq_len}", "cache B/tok"] + \
        [f"cache @{ctx_label(L)}" for L in CONTEXTS] + \
        [f"decode FLOPs @{ctx_label(ctx)}", f"decode bytes @{ctx_label(ctx)}", f"H200 µs @{ctx_label(ctx)}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [r["name"], str(r["n"]), human(r["params"]), human(r["train_flops"]),
                 human(r["cache_bytes_per_token"], "B") if r["cache_bytes_per_token"] else "0 (const)"]
        cells += [human(at[L][i]["cache_bytes"], "B") for L in CONTEXTS]
        cells += [human(r["decode_flops"]), human(r["decode_bytes"], "B"), f"{r['decode_s'] * 1e6:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Decode of one token, batch 1, whole model (H200: 989 TFLOP/s bf16, 4.8 TB/s):", "",
              "| context | FLOPs | bytes | FLOP/byte | roofline µs | bound |", "|---|---|---|---|---|---|"]
    for L in CONTEXTS:
        t = at[L][-1]
        ai = t["decode_flops"] / t["decode_bytes"]
        bound = "memory" if ai < H200_FLOPS / H200_BW else "compute"
        lines.append(f"| {ctx_label(L)} | {human(t['decode_flops'])} | {human(t['decode_bytes'], 'B')} | {ai:.3g} | "
                     f"{t['decode_s'] * 1e6:.3g} | {bound} |")
    return "\n".join(lines)


def main(argv=None):
    # the config and the overrides are taken by split_args, not argparse: argparse reads an override
    # with a space (--model.mlp={kind: moe, ...}) as the config path
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [config.yaml] [--section.key=value ...] [options]",
                                epilog="config.yaml: default configs/default.yaml; overrides: e.g. --model.n_layer=4")
    p.add_argument("--seq_len", type=int, default=None, help="training sequence length (default: the config's)")
    p.add_argument("--ctx", type=int, default=32768, help="context for the per-layer decode columns")
    p.add_argument("--dtype_bytes", type=int, default=2, help="bytes per weight / cache element (2 = bf16)")
    args, extra = p.parse_known_args(argv)
    from config import DEFAULT_CONFIG, load_config, split_args
    from model import ConfigError
    try:
        for name, ok, allowed in [("seq_len", args.seq_len is None or args.seq_len >= 1, ">= 1"),
                                  ("ctx", args.ctx >= 1, ">= 1"),
                                  ("dtype_bytes", args.dtype_bytes in (1, 2, 4), "1, 2 or 4")]:
            if not ok:
                raise ConfigError(f"--{name}: must be {allowed} (got {getattr(args, name)})")
        path, overrides, bad = split_args(extra)
        if bad:
            raise ConfigError(f"{bad[0]}: not a config (*.yaml, *.yml) nor an override; overrides look like "
                              f"--section.key=value")
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seq_len = args.seq_len or cfg.train.seq_len
    try:
        print(f"{path or os.path.relpath(DEFAULT_CONFIG)}: {human(num_params(cfg.model))} parameters "
              f"({human(active_params(cfg.model))} active), "
              f"{human(train_flops_per_token(cfg.model, seq_len))} training FLOPs/token at seq_len {seq_len}, "
              f"{args.dtype_bytes}-byte weights and cache\n", flush=True)
        print(report(cfg.model, seq_len, args.ctx, args.dtype_bytes), flush=True)
    except BrokenPipeError:  # `cost.py | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
