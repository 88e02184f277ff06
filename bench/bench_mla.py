"""Decode latency and cache bytes: GQA vs MLA (absorbed, naive expanded) vs MLA + DSA.

    python bench/bench_mla.py [--contexts 512,8192] [--tokens 10] [--repeats 3] [--config configs/deepseek_v32.yaml]

The MLA dims come from the config's first mla layer (its dsa block for MLA+DSA, run in the sparse
stage); GQA global uses the same n_heads with head_dim = d_model / n_heads and n_kv_heads 2. Models are
randomly initialised, batch 1, fp32, on the config's device. The cache is filled with random rows
instead of a prefill (decode time depends only on what the cache holds), then `--tokens` 1-token
steps are timed (best of --repeats). "MLA expanded" re-expands K and V from the latent cache at every
step (the naive form).
"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cost  # noqa: E402
from config import load_config
from model import GPT, ConfigError, ModelConfig
from train import pick_device


def variants(model_raw):
    mla = next(spec for spec in model_raw["layers"].values() if spec.get("kind") == "mla")
    d_model, H = model_raw["d_model"], mla["n_heads"]
    plain = {k: v for k, v in mla.items() if k != "dsa"}
    sparse = copy.deepcopy(mla)
    sparse.setdefault("dsa", {})["stage"] = "sparse"
    gqa = {"kind": "attn", "n_heads": H, "n_kv_heads": 2, "head_dim": d_model // H}
    return [("GQA global", gqa, None), ("MLA absorbed", plain, True), ("MLA expanded", plain, False),
            (f"MLA+DSA top_k={sparse['dsa'].get('top_k', 2048)}", sparse, True)]


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def bench(model, ctx, n_tokens, repeats, device):
    cache = model.new_cache(1, ctx + repeats * n_tokens + 2)
    for layer in cache.layers:            # random rows stand in for a prefilled context
        for t in vars(layer).values():
            if torch.is_tensor(t):
                t.normal_()
    cache.pos = ctx
    token = torch.randint(0, model.config.vocab_size, (1, 1), device=device)
    model.step(token, cache)              # warm-up
    best = float("inf")
    for _ in range(repeats):              # best of `repeats`: a shared CPU is noisy
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            model.step(token, cache)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / n_tokens * 1000)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/deepseek_v32.yaml")
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--tokens", type=int, default=10, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="report the best of this many timings")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least hurt by a shared CPU)")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device = pick_device(cfg.train.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"decode, batch 1, fp32, device {device}, d_model {cfg.model.d_model}, {cfg.model.n_layer} layers, "
          f"threads {torch.get_num_threads()}")
    print(f"{'variant':<22} {'context':>8} {'ms/token':>9} {'B/token/layer':>14} {'cache MiB':>10}")
    for name, spec, absorb in variants(cfg.raw["model"]):
        raw = {**cfg.raw["model"], "pattern": ["x"], "layers": {"x": spec}}
        torch.manual_seed(0)
        model = GPT(ModelConfig.from_dict(raw)).to(device).eval()
        for block in model.blocks:
            block.mixer.absorb = absorb
        per_token = cost.mixer_cost(model.config.layers["x"], cfg.model.d_model, 1, 1, 4)["cache_bytes_per_token"]
        for ctx in contexts:
            ms = bench(model, ctx, args.tokens, args.repeats, device)
            # bytes held for the context itself (the cache is allocated a few tokens longer)
            mib = per_token * ctx * cfg.model.n_layer / 2**20
            print(f"{name:<22} {ctx:>8} {ms:>9.2f} {per_token:>14} {mib:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
