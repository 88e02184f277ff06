"""Sample from a trained checkpoint; tokens stream to stdout as they are produced.

    python sample.py --ckpt out/default --prompt "def main(" --max_new_tokens 300
    python sample.py --ckpt out/default/ckpt_300.pt --prompt_file p.txt --num_samples 3 --top_p 0.9

The prompt is prefilled in one parallel `step`, then tokens are decoded one at a time from the cache.
Byte-level checkpoints (vocab 257) use UTF-8 bytes; others need `--tokenizer` (a tiktoken encoding).
"""
import argparse
import os
import sys

import torch

from config import from_raw
from data.tokens import DataError
from model import GPT, ConfigError
from train import latest_checkpoint, load_checkpoint


def load_model(path, device="cpu"):
    """A GPT from a checkpoint file, or from the latest checkpoint in a folder; returns (model, cfg)."""
    if os.path.isdir(path):
        folder, path = path, latest_checkpoint(path)
        if path is None:
            raise DataError(f"{folder}: no checkpoint (ckpt_*.pt) in this folder")
    ckpt = load_checkpoint(path)
    cfg = from_raw(ckpt["config"])
    model = GPT(cfg.model)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError:
        raise DataError(f"{path}: the checkpoint's weights do not fit its own config") from None
    return model.to(device).eval(), cfg


def make_codec(vocab_size, tokenizer):
    """(encode, decode) for the checkpoint's vocabulary."""
    if tokenizer is None:
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size={vocab_size} is not byte-level; pass --tokenizer NAME (tiktoken)")
        from data.stdlib import decode, encode
        return encode, decode
    import tiktoken
    enc = tiktoken.get_encoding(tokenizer)
    return (lambda s: enc.encode(s, allowed_special="all")), enc.decode


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/default", help="checkpoint file or folder (latest ckpt_*.pt)")
    p.add_argument("--prompt", default="\n", help="prompt text")
    p.add_argument("--prompt_file", help="read the prompt from this file instead")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache_len", type=int, default=None,
                   help="tokens global attention layers can cache (default: prompt + max_new_tokens)")
    p.add_argument("--tokenizer", default=None, help="tiktoken encoding name for non-byte vocabularies")
    args = p.parse_args(argv)
    for name, ok, allowed in [("num_samples", args.num_samples >= 1, ">= 1"),
                              ("max_new_tokens", args.max_new_tokens >= 1, ">= 1"),
                              ("temperature", args.temperature >= 0, ">= 0"),
                              ("top_k", args.top_k is None or args.top_k >= 1, ">= 1"),
                              ("top_p", args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]")]:
        if not ok:
            print(f"error: --{name} must be {allowed} (got {getattr(args, name)})", file=sys.stderr)
            return 2
    try:
        model, cfg = load_model(args.ckpt, args.device)
        encode, decode = make_codec(cfg.model.vocab_size, args.tokenizer)
        if args.prompt_file:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        prompt = encode(args.prompt)
        if not prompt:
            raise ConfigError("--prompt: must not be empty")
        if max(prompt) >= cfg.model.vocab_size:
            raise ConfigError(f"--prompt: token {max(prompt)} is outside the model's vocabulary ({cfg.model.vocab_size})")
    except (ConfigError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.num_samples, device=args.device)
    tokens = model.generate_stream(idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p, gen,
                                   max_len=args.cache_len)
    out, streamed = sys.stdout, [[] for _ in range(args.num_samples)]
    try:
        first = next(tokens)  # the prefill: a prompt too long for the cache fails here, before any output
        for i in range(args.num_samples):
            out.write(f"--- sample {i + 1}\n{args.prompt}" if args.num_samples > 1 else args.prompt)
            if i == 0:  # one batched generation; sample 1 streams live, the rest print after it
                printed = ""
                for token in _chain(first, tokens):
                    for j, t in enumerate(token.tolist()):
                        streamed[j].append(t)
                    text = decode(streamed[0])
                    out.write(text[len(printed):])  # only the newly completed characters
                    out.flush()
                    printed = text
            else:
                out.write(decode(streamed[i]))
            out.write("\n")
    except ValueError as e:
        print(f"\nerror: {e} (prompt {len(prompt)} tokens, --max_new_tokens {args.max_new_tokens}, "
              f"--cache_len {args.cache_len})", file=sys.stderr)
        return 2
    return 0


def _chain(first, rest):
    yield first
    yield from rest


if __name__ == "__main__":
    sys.exit(main())
