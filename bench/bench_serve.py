"""Serving throughput and cache memory: the engine (engine.py) against one-by-one `generate`.

    python bench/bench_serve.py [--ckpt out/default] [--n_requests 64] [--max_batch 16] [--max_prompt 256]
                                [--max_new 128] [--prefix 512] [--threads 1]

1. `--n_requests` requests with prompt lengths uniform in [8, max_prompt] and generation lengths
   uniform in [8, max_new] (seed 0), greedy: generated tokens per second of the engine (continuous
   batching, `--max_batch`, chunked prefill) and of `model.generate` on each request alone, measured
   side by side in this process; the outputs are checked equal.
2. Peak cache bytes of that run: the engine's blocks in use (+ delta-rule slots) against contiguous
   max-length caches for max_batch requests (what `generate` on a batch allocates: every request at the
   longest context).
3. Prefix sharing: 16 requests with a common `--prefix`-token prompt prefix (+ 1-16 own tokens):
   blocks allocated with and without sharing, and blocks saved.
Without --ckpt the model is the default config (configs/default.yaml) randomly initialised: speed and
memory do not depend on the weights. CPU, fp32.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_config  # noqa: E402
from engine import Engine, EngineError, Request  # noqa: E402
from model import GPT  # noqa: E402


def make_requests(n, max_prompt, max_new, vocab, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(8, max_prompt + 1, (1,), generator=g))
        N = int(torch.randint(8, max_new + 1, (1,), generator=g))
        out.append(Request(list(prefix) + torch.randint(0, vocab, (P,), generator=g).tolist(), N, rid=i))
    return out


def one_by_one(model, reqs):
    return [model.generate(torch.tensor([r.prompt]), r.max_new_tokens, temperature=0)[0, len(r.prompt):].tolist()
            for r in reqs]


def parse_checked(argv):
    """The flags, or None after one error line naming the first one out of range."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--n_requests", type=int, default=64)
    p.add_argument("--max_batch", type=int, default=16)
    p.add_argument("--prefill_chunk", type=int, default=256)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--max_prompt", type=int, default=256)
    p.add_argument("--max_new", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name, lo in [("n_requests", 1), ("max_batch", 1), ("prefill_chunk", 1), ("block_size", 1),
                     ("max_prompt", 8), ("max_new", 8), ("prefix", 1), ("threads", 1)]:
        if getattr(args, name) < lo:
            print(f"error: --{name}: must be an integer >= {lo} (got {getattr(args, name)})", file=sys.stderr)
            return None
    return args


def bench_model(ckpt):
    """The checkpoint's model (None after one error line), or the default config's with seed-0 weights."""
    if ckpt:
        from data.tokens import DataError
        from model import ConfigError
        from sample import load_model
        try:
            model, _ = load_model(ckpt)
            Engine(model)  # a mixer the engine does not serve: one line, before the timing
        except (ConfigError, DataError, EngineError) as e:
            print(f"error: {e}", file=sys.stderr)
            return None
        return model
    torch.manual_seed(0)
    return GPT(load_config(None, []).model).eval()


def throughput(model, reqs, args, kw):
    """Time the engine and one-by-one generate on the same requests, print tok/s and agreement; returns the
    engine (its pools hold the peak cache figures)."""
    n_new = sum(r.max_new_tokens for r in reqs)
    t0 = time.perf_counter()
    engine = Engine(model, **kw)
    engine.run(reqs)
    t_engine = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = one_by_one(model, reqs)
    t_single = time.perf_counter() - t0
    same = sum(r.out == o for r, o in zip(reqs, ref))
    print(f"\n{args.n_requests} requests, prompts 8-{args.max_prompt}, new tokens 8-{args.max_new} ({n_new} in all)")
    print(f"engine (max_batch {args.max_batch}, prefill_chunk {args.prefill_chunk}): {n_new / t_engine:8.1f} tok/s "
          f"({t_engine:.1f} s)")
    print(f"one by one (generate):            {n_new / t_single:8.1f} tok/s ({t_single:.1f} s)")
    print(f"speed-up: {t_single / t_engine:.2f}x; greedy outputs equal: {same}/{len(reqs)}")
    return engine


def cache_figures(model, engine, reqs, layers, max_batch):
    """The paged layers' peak cache against contiguous max-length caches."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    p = model.wte.weight
    contiguous = sum(model.blocks[i].mixer.new_cache(max_batch, longest, p.device, p.dtype).nbytes() for i in layers)
    per = engine.block_bytes()
    paged = sum(g.pool.peak * per[key] for key, g in engine.groups.items())
    slots = engine.peak_cache_bytes() - paged
    print(f"\npeak cache of the paged layers {layers}: {paged / 1e6:.2f} MB in blocks at the peak vs contiguous "
          f"max-length caches {contiguous / 1e6:.2f} MB ({max_batch} x {longest} tokens): {contiguous / paged:.1f}x "
          f"less; delta-rule state slots (the same either way): {slots / 1e6:.2f} MB")


def prefix_sharing(model, prefix_len, kw):
    """Blocks allocated for 16 requests with a common prefix, with and without sharing it."""
    V = model.config.vocab_size
    prefix = torch.randint(0, V, (prefix_len,), generator=torch.Generator().manual_seed(1)).tolist()
    allocs = {}
    for sharing in (True, False):
        g = torch.Generator().manual_seed(2)
        shared = [Request(prefix + torch.randint(0, V, (1 + i,), generator=g).tolist(), 4, rid=i) for i in range(16)]
        e = Engine(model, prefix_sharing=sharing, **kw)
        e.run(shared)
        pool = e.groups[None].pool
        allocs[sharing] = pool.allocs
        if sharing:
            shares, copies = pool.shares, pool.copies
    print(f"\nprefix sharing, 16 requests with a common {prefix_len}-token prefix: {allocs[True]} blocks allocated "
          f"vs {allocs[False]} without; {shares} block references shared, {copies} copied on write; "
          f"{allocs[False] - allocs[True]} blocks saved ({1 - allocs[True] / allocs[False]:.0%})")


def main(argv=None):
    args = parse_checked(argv)
    if args is None:
        return 2
    torch.set_num_threads(args.threads)
    model = bench_model(args.ckpt)
    if model is None:
        return 2
    kw = dict(max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, block_size=args.block_size)
    print(f"model: {model.config.pattern} x{model.config.n_layer}, d_model {model.config.d_model}, "
          f"{model.num_params() / 1e6:.2f}M params; {args.threads} thread(s)")
    reqs = make_requests(args.n_requests, args.max_prompt, args.max_new, model.config.vocab_size)
    engine = throughput(model, reqs, args, kw)
    layers = [i for g in engine.groups.values() for i in g.layers]
    if not layers:
        print("\nno paged layers (every layer keeps a fixed-size delta-rule state): no cache or prefix-sharing figures")
        return 0
    cache_figures(model, engine, reqs, layers, args.max_batch)
    if None not in engine.groups:
        print("\nno global attention layer: prefix sharing (of global layers' blocks) is not measured")
        return 0
    prefix_sharing(model, args.prefix, kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
