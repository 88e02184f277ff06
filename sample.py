"""Sample from a trained checkpoint; tokens stream to stdout as they are produced.

    python sample.py --ckpt out/default --prompt "def main(" --max_new_tokens 300
    python sample.py --ckpt out/default/ckpt_300.pt --prompt_file p.txt --num_samples 3 --top_p 0.9

The prompt is prefilled in one parallel `step`, then tokens are decoded one at a time from the cache.

Many prompts (one JSON object per line with a `prompt`; the output adds `completion`) are served
together by the engine (engine.py: continuous batching, chunked prefill, paged caches, KV policies):

    python sample.py --ckpt out/default --prompts_file prompts.jsonl --output out.jsonl --max_batch 16
    python sample.py ... --kv_policy streaming --kv_budget 256 --prefill_chunk 64 --block_size 16

Text is encoded with the checkpoint's corpus tokenizer (bytes for stdlib, the encoding named in a prepared
corpus's manifest.json); `--tokenizer` (a tiktoken encoding, or bytes) overrides it or fills in where
the corpus names none.
"""
import argparse
import os
import sys

import torch

import kernels
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
    cfg.converted_from = ckpt.get("converted_from")  # convert.py from-hf: no corpus, data.kind a placeholder
    device = torch.device(device)
    if not kernels.runs_on(cfg.model.backend, device):  # trained on a GPU with backend: triton, read here
        print(f"note: {path} was trained with model.backend triton, which needs CUDA; running on {device.type} with "
              f"the torch kernels (the same function)", file=sys.stderr)
        cfg.model.backend = None
    model = GPT(cfg.model)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError:
        raise DataError(f"{path}: the checkpoint's weights do not fit its own config") from None
    return model.to(device).eval(), cfg


def make_codec(cfg, tokenizer):
    """(encode, decode) for the checkpoint: --tokenizer if given, else its corpus's own tokenizer
    (bytes for stdlib, the manifest's encoding for prepared shards; with data.bos, encode puts the
    corpus's end-of-text token first, as training did)."""
    from data import corpus_codec
    from data.prepare import get_encoding
    if tokenizer is None and getattr(cfg, "converted_from", None):
        raise ConfigError(f"the checkpoint was converted from {cfg.converted_from} and tokenizers are not converted: "
                          f"pass --tokenizer NAME (that model's tiktoken encoding, or bytes)")
    if tokenizer is None:
        codec, why = corpus_codec(cfg)
        if codec is None:
            raise ConfigError(f"no tokenizer for this checkpoint ({why}); pass --tokenizer NAME (tiktoken or bytes)")
        if cfg.data.bos:  # trained with end-of-text at position 0 of every row: prompts start the same way
            from data import make_dataset
            encode, eot = codec[0], make_dataset(cfg).val[0].eot_id
            return (lambda s: [eot] + encode(s)), codec[1]
        return codec
    enc = get_encoding(tokenizer)
    if enc.n_vocab > cfg.model.vocab_size:
        raise ConfigError(f"--tokenizer {tokenizer}: {enc.n_vocab} tokens, more than the model's vocab_size "
                          f"{cfg.model.vocab_size}")
    return (lambda s: enc.encode(s, allowed_special="all")), enc.decode


def unbounded_layers(cfg):
    """Kinds of the layers whose decode cache must hold the whole context (global attention, MLA)."""
    kinds = {lc.kind for lc in cfg.model.layer_configs() if lc.kind == "mla"
             or (lc.kind == "attn" and getattr(lc, "window", None) is None)}
    return sorted(kinds)


def read_prompt(args):
    """The prompt text from --prompt_file or --prompt; not UTF-8 is one ConfigError line."""
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompt_file {args.prompt_file}: not UTF-8 text (byte {e.start}: "
                              f"{e.object[e.start:e.start + 1]!r})") from None
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise ConfigError("--prompt: not UTF-8 text (check the terminal's encoding, or use --prompt_file)") from None
    return args.prompt


def check_prompt(args, cfg, encode):
    """The prompt's tokens; ConfigError when empty, outside the vocabulary, or (prompt + new tokens)
    longer than --cache_len for a model with layers that keep every token."""
    prompt = encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt: must not be empty")
    if max(prompt) >= cfg.model.vocab_size:
        raise ConfigError(f"--prompt: token {max(prompt)} is outside the model's vocabulary ({cfg.model.vocab_size})")
    context = len(prompt) + args.max_new_tokens - 1  # the last new token is never fed back
    if args.cache_len is not None and context > args.cache_len and unbounded_layers(cfg):
        raise ConfigError(f"--cache_len {args.cache_len}: the context is {context} tokens (prompt "
                          f"{len(prompt)} + --max_new_tokens {args.max_new_tokens} - 1) and the model's "
                          f"{', '.join(unbounded_layers(cfg))} layers keep every token; raise --cache_len "
                          f"or lower --max_new_tokens")
    return prompt


def build_parser():
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
    add_serve_args(p)
    return p


def range_error(args):
    """The first numeric option out of its range, as one line, or None."""
    for name, ok, allowed in [("num_samples", args.num_samples >= 1, ">= 1"),
                              ("max_new_tokens", args.max_new_tokens >= 1, ">= 1"),
                              ("temperature", args.temperature >= 0, ">= 0"),
                              ("top_k", args.top_k is None or args.top_k >= 1, ">= 1"),
                              ("top_p", args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
                              ("cache_len", args.cache_len is None or args.cache_len >= 1, ">= 1")]:
        if not ok:
            return f"--{name} must be {allowed} (got {getattr(args, name)})"
    return None


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if problem := range_error(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        from train import pick_device
        args.device = pick_device(args.device, "--device")
        check_mode_args(args, p)
        args.prompt = read_prompt(args)
        model, cfg = load_model(args.ckpt, args.device)
        encode, decode = make_codec(cfg, args.tokenizer)
        if args.prompts_file:
            check_serve_args(args)
        else:
            prompt = check_prompt(args, cfg, encode)
    except (ConfigError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompts_file:
        return serve_file(args, model, encode, decode)
    return stream_samples(args, model, prompt, decode)


def stream_samples(args, model, prompt, decode):
    """Generate args.num_samples continuations of `prompt` (token ids) in one batch and print them: the first
    streams as it is decoded, the others follow it. Returns the exit status."""
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
    except KeyboardInterrupt:  # Ctrl-C: stop generating, keep what was printed
        out.write("\n")
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def add_serve_args(p):
    from engine import KV_POLICIES
    g = p.add_argument_group("many prompts (engine.py)")
    g.add_argument("--prompts_file", help="JSON lines, each an object with a `prompt` string (and optionally "
                   "`max_new_tokens`); served together")
    g.add_argument("--output", help="JSON lines out: each input object plus `completion` (default: stdout)")
    g.add_argument("--max_batch", type=int, default=8, help="requests decoded together")
    g.add_argument("--prefill_chunk", type=int, default=256, help="prompt tokens prefilled per engine step")
    g.add_argument("--block_size", type=int, default=16, help="tokens per cache block")
    g.add_argument("--kv_policy", default="full", help=f"global attention cache policy: {', '.join(KV_POLICIES)}")
    g.add_argument("--kv_budget", type=int, default=None, help="tokens kept / read per global layer (not for full)")


SERVE_ONLY = ("output", "max_batch", "prefill_chunk", "block_size", "kv_policy", "kv_budget")


def check_mode_args(args, parser):
    """Options of one mode given in the other are refused rather than silently ignored (an --output
    that is never written, samples never drawn)."""
    given = lambda name: getattr(args, name) != parser.get_default(name)
    if not args.prompts_file:
        for name in SERVE_ONLY:
            if given(name):
                raise ConfigError(f"--{name}: only with --prompts_file (one --prompt streams to stdout)")
        return
    for name in ("prompt", "prompt_file", "num_samples"):
        if given(name):
            raise ConfigError(f"--{name}: not with --prompts_file (each of its lines is one request, one completion)")


def check_serve_args(args):
    from data.tokens import check_writable
    from engine import KV_POLICIES
    if args.output:
        check_writable(args.output, "--output")
    for name in ("max_batch", "prefill_chunk", "block_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}: must be an integer >= 1 (got {getattr(args, name)})")
    if args.kv_policy not in KV_POLICIES:
        raise ConfigError(f"--kv_policy: must be one of {', '.join(KV_POLICIES)} (got {args.kv_policy!r})")
    if args.kv_policy != "full" and (args.kv_budget is None or args.kv_budget < 1):
        raise ConfigError(f"--kv_budget: an integer >= 1 is needed with --kv_policy {args.kv_policy} (got {args.kv_budget})")
    if args.kv_policy == "full" and args.kv_budget is not None:
        raise ConfigError("--kv_budget: not with --kv_policy full (it keeps every token); pick a --kv_policy")


def read_requests(path, encode, args):
    """(requests, objects) from a JSON-lines file; a bad line becomes a request with its error set."""
    import json
    from engine import Request
    reqs, objs = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = Request([], args.max_new_tokens, args.temperature, args.top_k, args.top_p, rid=f"{path} line {n}")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                obj, r.error = None, f"not valid JSON ({e.msg})"
            if obj is not None and (not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str)):
                obj, r.error = None, 'not a JSON object with a string "prompt"'
            if obj is not None:
                r.prompt = encode(obj["prompt"])
                n_new = obj.get("max_new_tokens", args.max_new_tokens)
                if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
                    r.error = f'"max_new_tokens" must be an integer >= 1 (got {n_new!r})'
                else:
                    r.max_new_tokens = n_new
            reqs.append(r)
            objs.append(obj)
    return reqs, objs


def serve_file(args, model, encode, decode):
    """Serve every request of --prompts_file; a bad request gets one line on stderr, the rest complete."""
    import json
    from tqdm import tqdm
    from data.tokens import atomic_write
    from engine import Engine, EngineError
    try:
        reqs, objs = read_requests(args.prompts_file, encode, args)
    except UnicodeDecodeError as e:
        print(f"error: --prompts_file {args.prompts_file}: not UTF-8 text (byte {e.start}: "
              f"{e.object[e.start:e.start + 1]!r})", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --prompts_file {args.prompts_file}: cannot be read ({e.strerror or e})", file=sys.stderr)
        return 2
    try:
        engine = Engine(model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, block_size=args.block_size,
                        max_len=args.cache_len, kv_policy=args.kv_policy, kv_budget=args.kv_budget, seed=args.seed)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [r for r in reqs if r.error is not None]
    bar = tqdm(total=len(reqs), desc="requests", unit="req", file=sys.stderr, disable=None)
    def done(r):
        bar.update(1)
        if r.error is not None:
            tqdm.write(f"error: {r.rid}: {r.error}", file=sys.stderr)
    for r in bad:
        done(r)
    try:
        engine.run([r for r in reqs if r.error is None], on_done=done)
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C: the finished requests' completions are still written
        interrupted = True
    bar.close()
    lines = [json.dumps({**obj, "completion": decode(r.out)}, ensure_ascii=False) + "\n"
             for r, obj in zip(reqs, objs) if r.error is None and r.done]   # after Ctrl-C: the finished ones
    if args.output:
        try:
            atomic_write(args.output, lambda f: f.writelines(lines), mode="w")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(lines)} completions to {args.output}", file=sys.stderr)
    else:
        sys.stdout.writelines(lines)
    if interrupted:
        print(f"interrupted: {len(lines)} of {len(reqs)} requests had finished and were written; the others were "
              f"not served", file=sys.stderr)
        return 130
    n_bad = sum(r.error is not None for r in reqs)
    if n_bad:
        rest = "" if n_bad == len(reqs) else "; the others completed"
        print(f"error: {n_bad} of {len(reqs)} request{'s' * (len(reqs) > 1)} failed (named above){rest}",
              file=sys.stderr)
    return 2 if n_bad else 0


def _chain(first, rest):
    yield first
    yield from rest


if __name__ == "__main__":
    sys.exit(main())
