"""hybrid's 3 GDN : 1 GQA model against transformers' Qwen3NextForCausalLM at the same shape, side by side.

Both models are built from one config (d=256, 4 layers [gdn, gdn, gdn, attn], 4 heads of 64, 2 kv heads,
SwiGLU 683, vocab 257; Qwen3-Next's layout: gated attention with q/k RMSNorm and partial RoPE 0.25, GDN with
short convolution, L2-normalised q/k and gated output): ours from the dict below, transformers' through
convert.qwen3_next_hf_config (the converter's own mapping, tested to give the same logits). transformers
runs its pure-PyTorch fallbacks (no flash-linear-attention / causal-conv1d installed; SDPA attention).

train:  fp32 training steps (forward + backward + AdamW, same lr), B x T tokens each, interleaved:
        repeat r times ours, theirs, so a noisy machine slows them alike. tokens/s, median over repeats.
decode: a prompt of --prompt tokens (prefill) then --new greedy tokens with each model's cache
        (ours: model.generate; theirs: generate(do_sample=False)), interleaved; ms per run, median.
Each ratio is the median of the per-repeat ratios, with bench_nanogpt.median_interval's interval for it.

    python bench/bench_qwen3next.py --threads 1
    python bench/bench_qwen3next.py --steps 1 --repeat 1 --T 64 --B 2 --new 4   # a quick smoke run
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import TrainConfig  # noqa: E402
from convert import qwen3_next_hf_config  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from train import make_optimizer  # noqa: E402
from bench_nanogpt import ratio_text  # noqa: E402


def our_config(args):
    return ModelConfig.from_dict(dict(
        vocab_size=args.vocab, d_model=args.d, n_layer=args.layers, norm_eps=1e-6, tie_embeddings=False,
        pattern=["gdn", "gdn", "gdn", "attn"],
        layers=dict(gdn=dict(kind="gdn", n_heads=args.heads, head_dim=64),
                    attn=dict(kind="attn", n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=64, qk_norm=True,
                              output_gate=True, rope_fraction=0.25)),
        mlp=dict(kind="swiglu", hidden=args.hidden)))


def their_model(mc):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = {k: v for k, v in qwen3_next_hf_config(mc).items() if k not in ("model_type", "architectures")}
    return Qwen3NextForCausalLM(Qwen3NextConfig(**cfg, attn_implementation="sdpa", use_cache=True))


def steps(name, model, opt, x, y):
    if name == "ours":
        _, loss = model(x, y)
    else:
        loss = model(input_ids=x, labels=x).loss                 # transformers shifts the labels itself
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def interleave(fns, repeat):
    """{name: [seconds of each repeat]}: one warm-up call of each fn, then `repeat` rounds calling each in turn."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():                                   # warm-up
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=683)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="training steps per timed run")
    p.add_argument("--repeat", type=int, default=5, help="interleaved repeats (median reported)")
    p.add_argument("--prompt", type=int, default=256, help="decode: prompt tokens (prefill)")
    p.add_argument("--new", type=int, default=32, help="decode: greedy new tokens (0: skip decode)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mc = our_config(args)
    models = {"ours": GPT(mc), "transformers": their_model(mc)}
    lr = 1e-3
    opts = {"ours": make_optimizer(models["ours"], TrainConfig(lr=lr)),
            "transformers": torch.optim.AdamW(models["transformers"].parameters(), lr=lr, betas=(0.9, 0.95),
                                              weight_decay=0.1)}
    x = torch.randint(0, args.vocab, (args.B, args.T))
    y = torch.roll(x, -1, dims=1)
    run = {n: (lambda n=n: [steps(n, models[n], opts[n], x, y) for _ in range(args.steps)]) for n in models}
    times = interleave(run, args.repeat)
    rate = {n: args.steps * args.B * args.T / statistics.median(s) for n, s in times.items()}
    params = {n: sum(q.numel() for q in m.parameters()) / 1e6 for n, m in models.items()}
    print(f"3 GDN : 1 GQA, d={args.d} layers={args.layers} heads={args.heads}x64 kv={args.kv_heads} "
          f"swiglu={args.hidden} vocab={args.vocab}, fp32, threads={torch.get_num_threads()}, "
          f"median of {args.repeat} interleaved repeats")
    print(f"train T={args.T} B={args.B}: ours {rate['ours']:,.0f} tok/s ({params['ours']:.2f}M params), "
          f"transformers {rate['transformers']:,.0f} tok/s ({params['transformers']:.2f}M params): "
          f"{ratio_text(times['transformers'], times['ours'], 'ours/transformers')}", flush=True)
    out = {"train_ours": rate["ours"], "train_transformers": rate["transformers"]}
    if args.new:
        for m in models.values():
            m.eval()
        prompt = torch.randint(0, args.vocab, (1, args.prompt))
        with torch.no_grad():
            gen = {"ours": lambda: models["ours"].generate(prompt, args.new, temperature=0.0),
                   "transformers": lambda: models["transformers"].generate(
                       prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                       min_new_tokens=args.new, do_sample=False)}
            runs = interleave(gen, args.repeat)
        d = {n: statistics.median(t) for n, t in runs.items()}
        print(f"prefill {args.prompt} + decode {args.new} tokens (B=1, greedy): ours {d['ours'] * 1e3:.0f} ms, "
              f"transformers {d['transformers'] * 1e3:.0f} ms: "
              f"{ratio_text(runs['transformers'], runs['ours'], 'faster (ours)')}", flush=True)
        out.update(decode_ours_s=d["ours"], decode_transformers_s=d["transformers"])
    return out


if __name__ == "__main__":
    main()
