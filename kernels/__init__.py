"""The ops. One function per op; `backend` picks the implementation.

    backend="torch"   pure PyTorch: the reference, and the CPU path
    backend="triton"  the Triton kernels: the GPU path
    backend=None      triton on CUDA tensors, torch elsewhere

Every op takes and returns [B, T, H, D] tensors (time before heads). See SPEC 0.3.

The Triton paths launch through torch.library ops (torch.ops.hybrid.*, registered in triton_*.py with
fake impls and autograd), so torch.compile captures them without a graph break.

Packed documents (varlen, the flash-attention / flash-linear-attention convention): `cu_seqlens`
int32 [n_docs + 1] = (0, end of every document, N) with B == 1 and the documents laid end to end in
time. A document boundary resets the causal range (attention) or the state (delta rule, linear
attention), also inside a chunk or a tile: the kernels mask by document, nothing is padded.
"""
import os

import torch
# NB: the torch paths live in torch_*.py: a submodule named like an op (kernels/attention.py)
# would shadow the op function of the same name once imported.

BACKENDS = ("torch", "triton")


def runs_on(backend, device):
    """Whether `backend` can run on `device` (a torch.device): the Triton kernels need a CUDA device, or
    Triton's interpreter (TRITON_INTERPRET=1, what the tests use) on the CPU."""
    return backend != "triton" or device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pick(backend, x):
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def _one_dtype(q, *rest):
    """q and the tensors it is multiplied with (k, v; kv rows) in one dtype, as a Triton dot needs: the
    autocast dtype under autocast (what PyTorch's SDPA computes in there), else q's. Under bf16 autocast a
    layer may mix them (MLA's normed latent stays fp32 beside bf16 projections)."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    return tuple(x if x.dtype == dtype else x.to(dtype) for x in (q, *rest))


def check_cu_seqlens(cu_seqlens, B, N, op="cu_seqlens"):
    """Refuse bad packed-document boundaries with one line; returns them as int64 on the same device."""
    if B != 1:
        raise ValueError(f"{op}: cu_seqlens needs batch size 1 (all documents laid end to end in one row), got B={B}")
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32 (or int64) tensor [n_docs + 1], got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if torch.compiler.is_compiling():   # reading the values would break the graph: checked in eager runs only
        return cu_seqlens.long()
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != N or any(b < a for a, b in zip(cu, cu[1:])):
        shown = cu if len(cu) <= 8 else cu[:4] + ["..."] + cu[-3:]
        raise ValueError(f"{op}: cu_seqlens must start at 0, never decrease and end at the sequence length "
                         f"N={N}, got {shown}")
    return cu_seqlens.long()


def doc_index(cu_seqlens, N):
    """The document of every position: [N] int64 (cu_seqlens already checked). Empty documents are skipped."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(N, device=cu_seqlens.device), right=True)


def doc_positions(cu_seqlens, N):
    """Position of every token inside its document: [N] int64 (RoPE restarts at each document)."""
    return torch.arange(N, device=cu_seqlens.device) - cu_seqlens[doc_index(cu_seqlens, N)]


def attention(q, k, v, *, window=None, sinks=None, scale=None, backend=None, cu_seqlens=None):
    """Causal softmax attention; query t sits at absolute position S - T + t.

    q [B,T,Hq,Dk]  k [B,S,Hkv,Dk]  v [B,S,Hkv,Dv]  ->  o [B,T,Hq,Dv]
    window: each query sees exactly `window` keys (itself included); None = global.
    sinks:  [Hq] learned sink logits (a softmax column with no value); None = no sinks.
    cu_seqlens: packed documents (B == 1, T == S): a query sees only keys of its own document.
    """
    B, T, Hq, Dk = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != Dk:
        raise ValueError(f"attention: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} do not match")
    if S < T or Hq % Hkv:
        raise ValueError(f"attention: need S >= T and Hq % Hkv == 0, got T={T} S={S} Hq={Hq} Hkv={Hkv}")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1 or None, got {window}")
    if cu_seqlens is not None:
        if S != T:
            raise ValueError(f"attention: cu_seqlens needs queries and keys of the same length, got T={T} S={S}")
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, "attention")
    q, k, v = _one_dtype(q, k, v)
    if _pick(backend, q) == "torch":
        from .torch_attention import attention_torch
        return attention_torch(q, k, v, window=window, sinks=sinks, scale=scale, cu_seqlens=cu_seqlens)
    from .triton_attention import attention_triton
    return attention_triton(q, k, v, window=window, sinks=sinks, scale=scale, cu_seqlens=cu_seqlens)


def _check_packed_state(op, cu_seqlens, q, initial_state, output_final_state):
    """Packed documents: validated boundaries; states per document are not supported (refused)."""
    if cu_seqlens is None:
        return None
    if initial_state is not None or output_final_state:
        raise ValueError(f"{op}: initial_state / output_final_state are not supported with cu_seqlens "
                         f"(every document starts from a zero state); run documents with a state one by one")
    return check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], op)


def delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, backend=None,
               cu_seqlens=None):
    """Gated delta rule (KDA per-channel gate g [B,T,H,K], GDN per-head gate g [B,T,H]).

    S_t = Diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T (scale q_t)
    q,k [B,T,H,K]  v [B,T,H,V]  beta [B,T,H]  state [B,H,K,V] float32.
    Returns (o [B,T,H,V], final_state or None).
    cu_seqlens: packed documents (B == 1): the state restarts from zero at every document start;
    not combinable with initial_state / output_final_state.
    """
    cu_seqlens = _check_packed_state("delta_rule", cu_seqlens, q, initial_state, output_final_state)
    if _pick(backend, q) == "torch":
        from .torch_delta_rule import delta_rule_torch
        return delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    from .triton_delta_rule import delta_rule_triton
    return delta_rule_triton(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)


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


def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Plain linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t) (identity feature map,
    no normaliser). q,k [B,T,H,K]  v [B,T,H,V]. Returns (o, final_state or None). Torch path only: it is
    a few batched matmuls per chunk, which PyTorch already runs well on a GPU. cu_seqlens: packed
    documents, as for delta_rule."""
    cu_seqlens = _check_packed_state("linear_attention", cu_seqlens, q, initial_state, output_final_state)
    from .torch_delta_rule import linear_attention_torch
    return linear_attention_torch(q, k, v, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def linear_attention_step(q, k, v, state, *, scale=None):
    """One token of linear attention; state [B,H,K,V] float32 updated in place. Returns o [B,H,V]."""
    from .torch_delta_rule import linear_attention_step_torch
    return linear_attention_step_torch(q, k, v, state, scale=scale)


def sparse_mla_attention(q, kv, indices, *, d_v, scale, backend=None):
    """DSA's sparse stage: each query attends its own selected latent rows (absorbed MLA, SPEC 3).

    q [B,T,H,Dk] (Dk = d_c + d_rope)  kv [B,S,Dk] (one row per key, shared by every head)
    indices [B,T,k] int64: entries < 0 or > the query's position S - T + t are padding (no
    probability, no gradient). Keys are the kv rows, values their first d_v dims.
    Returns (o [B,T,H,d_v] in q's dtype, lse [B,T,H] fp32 natural-log log-sum-exp of each row's
    scaled logits over its valid entries, -inf for a row with none; lse carries no gradient).
    """
    B, T, H, Dk = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != Dk or kv.shape[1] < T:
        raise ValueError(f"sparse_mla_attention: need kv [B, S >= T, Dk] for q{tuple(q.shape)}, "
                         f"got kv{tuple(kv.shape)}")
    if indices.shape[:2] != (B, T) or indices.dim() != 3 or not 0 < d_v <= Dk:
        raise ValueError(f"sparse_mla_attention: need indices [B, T, k] and 0 < d_v <= Dk, got "
                         f"indices{tuple(indices.shape)} d_v={d_v} Dk={Dk}")
    q, kv = _one_dtype(q, kv)
    if _pick(backend, q) == "torch":
        from .torch_sparse import sparse_mla_attention_torch
        return sparse_mla_attention_torch(q, kv, indices, d_v=d_v, scale=scale)
    from .triton_sparse import sparse_mla_attention_triton
    return sparse_mla_attention_triton(q, kv, indices, d_v=d_v, scale=scale)


def index_topk(iq, iw, ik, k, *, backend=None):
    """DSA lightning indexer: the k best visible keys of each query, never the T x S score matrix.

    score[t, s] = sum_h iw[t,h] * ReLU(iq[t,h] . ik[s]) * d_I**-0.5 in fp32; query t sits at position
    S - T + t and sees keys s <= S - T + t. iq [B,T,H_I,d_I]  iw [B,T,H_I]  ik [B,S,d_I], k <= S.
    Returns [B, T, k] int64, best first, ties to the most recent key; entries < 0 or > the query's
    position are padding (only when a query sees fewer than k keys).
    """
    B, T, HI, dI = iq.shape
    S = ik.shape[1]
    if ik.dim() != 3 or ik.shape[0] != B or ik.shape[2] != dI or iw.shape != iq.shape[:3] or S < T:
        raise ValueError(f"index_topk: shapes iq{tuple(iq.shape)} iw{tuple(iw.shape)} ik{tuple(ik.shape)} do not match")
    if not 1 <= k <= S:
        raise ValueError(f"index_topk: k must be in [1, S={S}], got {k}")
    if _pick(backend, iq) == "torch":
        from .torch_sparse import index_topk_torch
        return index_topk_torch(iq, iw, ik, k)
    from .triton_sparse import index_topk_triton
    return index_topk_triton(iq, iw, ik, k)


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
    q, k, v = _one_dtype(q, k, v)
    if _pick(backend, q) == "torch":
        from .torch_sparse import block_sparse_attention_torch
        return block_sparse_attention_torch(q, k, v, block_indices, block_size, scale=scale)
    from .triton_sparse import block_sparse_attention_triton
    return block_sparse_attention_triton(q, k, v, block_indices, block_size, scale=scale)


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
