"""The ops. One function per op; `backend` picks the implementation.

    backend="torch"   pure PyTorch: the reference, and the CPU path
    backend="triton"  the Triton kernels: the GPU path
    backend=None      triton on CUDA tensors, torch elsewhere

Every op takes and returns [B, T, H, D] tensors (time before heads). See SPEC 0.3.
"""
# NB: the torch paths live in torch_*.py: a submodule named like an op (kernels/attention.py)
# would shadow the op function of the same name once imported.

BACKENDS = ("torch", "triton")


def _pick(backend, x):
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def attention(q, k, v, *, window=None, sinks=None, scale=None, backend=None):
    """Causal softmax attention; query t sits at absolute position S - T + t.

    q [B,T,Hq,Dk]  k [B,S,Hkv,Dk]  v [B,S,Hkv,Dv]  ->  o [B,T,Hq,Dv]
    window: each query sees exactly `window` keys (itself included); None = global.
    sinks:  [Hq] learned sink logits (a softmax column with no value); None = no sinks.
    """
    B, T, Hq, Dk = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != Dk:
        raise ValueError(f"attention: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} do not match")
    if S < T or Hq % Hkv:
        raise ValueError(f"attention: need S >= T and Hq % Hkv == 0, got T={T} S={S} Hq={Hq} Hkv={Hkv}")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1 or None, got {window}")
    if _pick(backend, q) == "torch":
        from .torch_attention import attention_torch
        return attention_torch(q, k, v, window=window, sinks=sinks, scale=scale)
    from .triton_attention import attention_triton
    return attention_triton(q, k, v, window=window, sinks=sinks, scale=scale)


def delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, backend=None):
    """Gated delta rule (KDA per-channel gate g [B,T,H,K], GDN per-head gate g [B,T,H]).

    S_t = Diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T (scale q_t)
    q,k [B,T,H,K]  v [B,T,H,V]  beta [B,T,H]  state [B,H,K,V] float32.
    Returns (o [B,T,H,V], final_state or None).
    """
    if _pick(backend, q) == "torch":
        from .torch_delta_rule import delta_rule_torch
        return delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state)
    from .triton_delta_rule import delta_rule_triton
    return delta_rule_triton(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)


def delta_rule_step(q, k, v, g, beta, state, *, scale=None, backend=None):
    """One-token delta-rule update for decode, state updated in place.

    q,k [B,H,K]  v [B,H,V]  g [B,H,K] or [B,H]  beta [B,H]  state [B,H,K,V] float32.
    Returns o [B,H,V].
    """
    if _pick(backend, q) == "torch":
        from .torch_delta_rule import delta_rule_step_torch
        return delta_rule_step_torch(q, k, v, g, beta, state, scale=scale)
    from .triton_delta_rule import delta_rule_step_triton
    return delta_rule_step_triton(q, k, v, g, beta, state, scale=scale)


def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    """Plain linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t) (identity feature map,
    no normaliser). q,k [B,T,H,K]  v [B,T,H,V]. Returns (o, final_state or None). Torch path only: it is
    a few batched matmuls per chunk, which PyTorch already runs well on a GPU."""
    from .torch_delta_rule import linear_attention_torch
    return linear_attention_torch(q, k, v, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state)


def linear_attention_step(q, k, v, state, *, scale=None):
    """One token of linear attention; state [B,H,K,V] float32 updated in place. Returns o [B,H,V]."""
    from .torch_delta_rule import linear_attention_step_torch
    return linear_attention_step_torch(q, k, v, state, scale=scale)


def block_sparse_attention(q, k, v, block_indices, block_size, *, scale=None, backend=None):
    """NSA's selection branch: each query attends the key blocks its GQA group selected.

    q [B,T,Hq,D]  k [B,S,Hkv,D]  v [B,S,Hkv,Dv]  block_indices [B,T,Hkv,n] int64 ids of blocks of
    `block_size` keys (-1 = unused slot; no duplicates). Query t sits at position S - T + t and
    sees the keys j <= its position of its blocks; the Hq // Hkv query heads of a kv head share its
    blocks. A row with no visible key outputs 0. Returns o [B,T,Hq,Dv] in q's dtype.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D or S < T or Hq % Hkv:
        raise ValueError(f"block_sparse_attention: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"do not match (need S >= T, Hq % Hkv == 0)")
    if block_indices.dim() != 4 or block_indices.shape[:3] != (B, T, Hkv) or block_size < 1:
        raise ValueError(f"block_sparse_attention: need block_indices [B, T, Hkv, n] and block_size >= 1, got "
                         f"{tuple(block_indices.shape)} and {block_size}")
    scale = D ** -0.5 if scale is None else scale
    if _pick(backend, q) == "torch":
        from .torch_sparse import block_sparse_attention_torch
        return block_sparse_attention_torch(q, k, v, block_indices, block_size, scale=scale)
    from .triton_sparse import block_sparse_attention_triton
    return block_sparse_attention_triton(q, k, v, block_indices, block_size, scale=scale)
