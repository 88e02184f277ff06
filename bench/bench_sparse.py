"""Benchmark the sparse attention ops against dense causal attention (kernels.attention).

    python bench/bench_sparse.py                         # on a CUDA GPU: Triton paths, T = 8k, 16k, 32k
    python bench/bench_sparse.py --cpu-T 1024 2048       # without CUDA: the torch paths on the CPU

Rows (forward, and forward+backward, ms):
    nsa_sel   kernels.block_sparse_attention: every query's GQA group attends n_sel blocks of
              block_size keys (block 0, the query's own block and the one before it, the rest random)
    dense     kernels.attention with the same q, k, v (the NSA paper's FlashAttention baseline)
    dsa       kernels.sparse_mla_attention: H heads over top_k latent rows of d_c + d_rope (absorbed MLA)
    dsa_dense kernels.attention on the same absorbed form (one kv head, values = the first d_c dims)
    dsa_topk  kernels.index_topk: the lightning indexer's scores + top-k (forward only)
The NSA paper (8k, B=4, 64 heads, D=128): selection forward 9.95 ms vs FlashAttention 13.46 ms.
Without CUDA the GPU figures are "unmeasured" and the torch paths are timed on the CPU instead.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768], help="T = S on the GPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=64, help="NSA query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="NSA kv heads (GQA groups)")
    p.add_argument("--dim", type=int, default=128, help="NSA head dim (Dk = Dv)")
    p.add_argument("--block-size", type=int, default=64, help="NSA selection block l'")
    p.add_argument("--n-sel", type=int, default=16, help="NSA selected blocks per query")
    p.add_argument("--dsa-heads", type=int, default=64)
    p.add_argument("--d-c", type=int, default=512, help="DSA latent (values) dims")
    p.add_argument("--d-rope", type=int, default=64)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--cpu-T", type=int, nargs="+", default=[1024, 2048], help="T for the CPU figures")
    args = p.parse_args(argv)
    for name, value in vars(args).items():  # every size: an integer >= 1 (0 or less was a traceback)
        if any(isinstance(v, int) and not isinstance(v, bool) and v < 1 for v in (value if isinstance(value, list) else [value])):
            print(f"error: --{name.replace('_', '-')}: must be integers >= 1 (got {value})", file=sys.stderr)
            sys.exit(2)
    return args


def nsa_blocks(B, T, Hkv, n_sel, block_size, device, generator):
    """[B,T,Hkv,n_sel]: block 0, the query's own block and the previous one, then random distinct earlier blocks."""
    own = torch.arange(T, device=device) // block_size                               # S == T
    rand = torch.rand(B, T, Hkv, own.max().item() + 1, device=device, generator=generator)
    rand = rand.masked_fill(torch.arange(rand.shape[-1], device=device) > own[None, :, None, None], -1.0)
    rand[..., 0] = 3.0
    rand.scatter_(-1, own.view(1, T, 1, 1).expand(B, T, Hkv, 1), 2.0)
    rand.scatter_(-1, (own - 1).clamp(min=0).view(1, T, 1, 1).expand(B, T, Hkv, 1), 1.5)
    top = rand.topk(min(n_sel, rand.shape[-1]), -1)
    return top.indices.masked_fill(top.values < 0, -1)


def dsa_indices(B, T, top_k, device, generator):
    """[B,T,top_k]: each query's own key and random earlier ones (padding for queries with fewer)."""
    pos = torch.arange(T, device=device)
    idx = (torch.rand(B, T, top_k, device=device, generator=generator) * (pos[None, :, None] + 1)).long()
    idx[..., 0] = pos
    return idx


def cases(a, T, device, dtype):
    """name -> (fn, inputs needing grad) for one sequence length."""
    g = torch.Generator(device=device).manual_seed(0)
    B, H, Hkv, D = a.batch, a.heads, a.kv_heads, a.dim
    rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g).requires_grad_()  # noqa: E731
    q, k, v = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    blocks = nsa_blocks(B, T, Hkv, a.n_sel, a.block_size, device, g)
    Dk = a.d_c + a.d_rope
    ql, kv = rnd(B, T, a.dsa_heads, Dk), rnd(B, T, Dk)
    top_k = min(a.top_k, T)
    idx = dsa_indices(B, T, top_k, device, g)
    iq, iw, ik = (torch.randn(B, T, a.index_heads, a.index_dim, device=device, dtype=dtype, generator=g),
                  torch.randn(B, T, a.index_heads, device=device, dtype=dtype, generator=g),
                  torch.randn(B, T, a.index_dim, device=device, dtype=dtype, generator=g))
    rows = kv[:, :, None]
    return {
        "nsa_sel": (lambda: kernels.block_sparse_attention(q, k, v, blocks, a.block_size), [q, k, v]),
        "dense": (lambda: kernels.attention(q, k, v), [q, k, v]),
        "dsa": (lambda: kernels.sparse_mla_attention(ql, kv, idx, d_v=a.d_c, scale=Dk ** -0.5)[0], [ql, kv]),
        "dsa_dense": (lambda: kernels.attention(ql, rows, rows[..., :a.d_c], scale=Dk ** -0.5), [ql, kv]),
        "dsa_topk": (lambda: kernels.index_topk(iq, iw, ik, top_k), None),
    }


def fwd_bwd(fn, inputs):
    def run():
        o = fn()
        torch.autograd.grad(o, inputs, torch.ones_like(o))
    return run


def gpu(a):
    import triton.testing
    dtype = torch.bfloat16
    print(f"GPU {torch.cuda.get_device_name()}  bf16  B={a.batch}  NSA: {a.heads} heads / {a.kv_heads} kv heads, "
          f"D={a.dim}, {a.n_sel} blocks of {a.block_size}  DSA: {a.dsa_heads} heads, d_c={a.d_c}, "
          f"d_rope={a.d_rope}, top_k={a.top_k}, indexer {a.index_heads}x{a.index_dim}")
    print(f"{'T':>6} {'op':>10} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    for T in a.seqlens:
        for name, (fn, inputs) in cases(a, T, "cuda", dtype).items():
            try:
                with torch.no_grad():
                    f = triton.testing.do_bench(fn)
                fb = triton.testing.do_bench(fwd_bwd(fn, inputs)) if inputs else float("nan")
            except Exception as e:  # e.g. a kernel out of resources at this shape: say so, go on
                print(f"{T:>6} {name:>10} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            print(f"{T:>6} {name:>10} {f:>9.2f} {fb:>11.2f}", flush=True)
        torch.cuda.empty_cache()


def cpu_time(fn, reps=2):
    fn()                                                    # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def cpu(a):
    print("GPU figures: unmeasured: no CUDA.")
    small = argparse.Namespace(**{**vars(a), "batch": 1, "heads": 8, "kv_heads": 2, "dim": 64, "block_size": 32,
                                  "n_sel": 8, "dsa_heads": 8, "d_c": 64, "d_rope": 16, "top_k": 128,
                                  "index_heads": 4, "index_dim": 32})
    print(f"CPU torch paths, fp32, {torch.get_num_threads()} thread(s), ms (mean of 2 after a warm-up). "
          f"NSA: 8 heads / 2 kv heads, D=64, 8 blocks of 32; DSA: 8 heads, d_c=64, d_rope=16, top_k=128, "
          f"indexer 4x32")
    print(f"{'T':>6} {'op':>10} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    for T in a.cpu_T:
        for name, (fn, inputs) in cases(small, T, "cpu", torch.float32).items():
            with torch.no_grad():
                f = cpu_time(fn)
            fb = cpu_time(fwd_bwd(fn, inputs)) if inputs else float("nan")
            print(f"{T:>6} {name:>10} {f:>9.1f} {fb:>11.1f}", flush=True)


if __name__ == "__main__":
    args = parse_args()
    gpu(args) if torch.cuda.is_available() else cpu(args)
