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


def paged_attention(q, k_pool, v_pool, block_table, seq_lens, *, window=None, sinks=None, scale=None, backend=None):
    """Causal softmax attention over keys that live in a pool of fixed-size blocks (PagedAttention).

    q [B,T,Hq,Dk]  k_pool [N,bs,Hkv,Dk]  v_pool [N,bs,Hkv,Dv]  block_table [B,nb] int (block j of row b
    holds its positions j*bs .. j*bs+bs-1)  seq_lens [B]: keys of row b (its new tokens included).
    Query t of row b sits at position seq_lens[b] - T + t and sees keys <= its position (and, with a
    window, > position - window); table entries past a row's keys (or left of its window) are never
    read, any valid block id may pad them. window, sinks, scale as in `attention`. -> o [B,T,Hq,Dv]
    """
    B, T, Hq, Dk = q.shape
    Hkv = k_pool.shape[2]
    if k_pool.shape[:3] != v_pool.shape[:3] or k_pool.shape[3] != Dk or block_table.shape[0] != B:
        raise ValueError(f"paged_attention: shapes q{tuple(q.shape)} k_pool{tuple(k_pool.shape)} "
                         f"v_pool{tuple(v_pool.shape)} block_table{tuple(block_table.shape)} do not match")
    if Hq % Hkv:
        raise ValueError(f"paged_attention: need Hq % Hkv == 0, got Hq={Hq} Hkv={Hkv}")
    if _pick(backend, q) == "triton" and T == 1:  # decode; chunks of a prefill take the torch path
        from .triton_paged import paged_decode_triton
        return paged_decode_triton(q, k_pool, v_pool, block_table, seq_lens, window=window, sinks=sinks, scale=scale)
    from .torch_paged import paged_attention_torch
    return paged_attention_torch(q, k_pool, v_pool, block_table, seq_lens, window=window, sinks=sinks, scale=scale)
