"""Benchmarks that print figures (not tests).

    python bench/bench_model.py train  [--config CFG] [overrides]  training tokens/s (fwd + bwd + AdamW),
                                                                  activation memory saved for backward
    python bench/bench_model.py decode [--config CFG] [overrides]  decode ms/token and cache bytes by context

Models are randomly initialised; only speed and memory are measured.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_config
from model import GPT, ConfigError
from train import make_optimizer, pick_device


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def saved_activation_bytes(model, x):
    """Bytes of the tensors autograd keeps from one forward for the backward, each storage once and
    parameters excluded: the activation memory of a training step (plus the weight copies a step
    builds, e.g. the concatenated q|k|v and gate|up matrices)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(kept.values())


def bench_train(cfg, steps, warmup):
    device = pick_device(cfg.train.device)
    model = GPT(cfg.model).to(device)
    opt = make_optimizer(model, cfg.train)
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    x = torch.randint(0, V, (B, T), device=device)
    saved = saved_activation_bytes(model, x)
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    dt = time.perf_counter() - t0
    print(f"train: {model.num_params() / 1e6:.2f}M params, B={B} T={T}, device {device}: "
          f"{steps * B * T / dt:,.0f} tokens/s ({dt / steps * 1000:.0f} ms/step), "
          f"{saved / 2**20:.1f} MiB of activations saved for backward")


@torch.no_grad()
def bench_decode(cfg, contexts, n_tokens):
    device = pick_device(cfg.train.device)
    model = GPT(cfg.model).to(device).eval()
    V = cfg.model.vocab_size
    print(f"decode: {model.num_params() / 1e6:.2f}M params, batch 1, device {device}")
    print(f"{'context':>8} {'ms/token':>9} {'cache MiB':>10}")
    for ctx in contexts:
        cache = model.new_cache(1, ctx + n_tokens + 1)
        prompt = torch.randint(0, V, (1, ctx), device=device)
        for start in range(0, ctx, 1024):  # chunked prefill
            model.step(prompt[:, start:start + 1024], cache)
        token = torch.randint(0, V, (1, 1), device=device)
        model.step(token, cache)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            model.step(token, cache)
        sync(device)
        ms = (time.perf_counter() - t0) / n_tokens * 1000
        print(f"{ctx:>8} {ms:>9.2f} {cache.nbytes() / 2**20:>10.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["train", "decode"])
    p.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps")
    p.add_argument("--warmup", type=int, default=2, help="train: untimed steps first")
    p.add_argument("--contexts", default="256,1024,4096,8192", help="decode: comma-separated contexts")
    p.add_argument("--tokens", type=int, default=50, help="decode: timed tokens per context")
    args, overrides = p.parse_known_args(argv)
    try:
        for name, ok, allowed in [("steps", args.steps >= 1, ">= 1"), ("warmup", args.warmup >= 0, ">= 0"),
                                  ("tokens", args.tokens >= 1, ">= 1")]:
            if not ok:
                raise ConfigError(f"--{name}: must be {allowed} (got {getattr(args, name)})")
        try:
            contexts = [int(c) for c in args.contexts.split(",")]
        except ValueError:
            contexts = []
        if not contexts or min(contexts) < 1:
            raise ConfigError(f"--contexts: comma-separated integers >= 1 (got {args.contexts!r})")
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if args.what == "train":
        bench_train(cfg, args.steps, args.warmup)
    else:
        bench_decode(cfg, contexts, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
