"""Attention over a block table, pure PyTorch: the reference path and the CPU path (SPEC 11).

Each row's blocks are gathered into one [S, Hkv, D] run (S = blocks in the table x block size), keys
past the row's length or outside its window are masked, and the softmax runs in fp32, with an
optional sink column, like kernels/torch_attention.py. Rows may have different lengths.
"""
import torch


def paged_attention_torch(q, k_pool, v_pool, block_table, seq_lens, *, window=None, sinks=None, scale=None):
    B, T, Hq, Dk = q.shape
    bs, Hkv, Dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    G, S = Hq // Hkv, block_table.shape[1] * bs
    scale = Dk ** -0.5 if scale is None else scale
    k = k_pool[block_table].view(B, S, Hkv, Dk).transpose(1, 2).float()       # [B, Hkv, S, Dk]
    v = v_pool[block_table].view(B, S, Hkv, Dv).transpose(1, 2).float()       # [B, Hkv, S, Dv]
    qg = q.view(B, T, Hkv, G, Dk).permute(0, 2, 3, 1, 4).float()              # [B, Hkv, G, T, Dk]
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k) * scale                 # [B, Hkv, G, T, S]
    qpos = seq_lens.to(q.device)[:, None] - T + torch.arange(T, device=q.device)   # [B, T]
    kpos = torch.arange(S, device=q.device)
    visible = kpos[None, None, :] <= qpos[:, :, None]                        # [B, T, S]
    if window is not None:
        visible = visible & (kpos[None, None, :] > qpos[:, :, None] - window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is None:
        p = scores.softmax(-1)
    else:                                                                    # the sink: a column with no value
        sink = sinks.float().view(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
        p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    o = torch.einsum("bhgts,bhsd->bhgtd", p, v)                              # [B, Hkv, G, T, Dv]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv).to(q.dtype)
