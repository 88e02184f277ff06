"""Benchmark the Triton attention kernels against PyTorch SDPA (and flash-attn when installed).

    python bench/bench_attention.py                    # full table on a CUDA GPU
    python bench/bench_attention.py --hdims 128 --seqlens 4096 --cases causal

For each head dim D (H = model_dim / D heads) and sequence length T (batch B = tokens / T, so the
token count is fixed) it times forward and forward+backward, reports ms and TFLOP/s, and prints the
max abs difference of the output (and of dq/dk/dv) against a reference:
    causal          triton vs SDPA(is_causal) vs flash_attn(causal)
    window W        triton vs SDPA with a dense boolean mask vs flash_attn(window_size=(W-1, 0))
    sinks           triton with learned sinks (timing baseline: SDPA causal, which has no sinks)
FLOPs count only the visible (query, key) pairs: fwd = 2 * pairs * (Dk + Dv) per head; the
backward is counted as 2.5x the forward (the flash-attention convention), fwd+bwd = 3.5x.

Without CUDA it says so and runs a tiny correctness smoke check under the Triton interpreter.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hdims", type=int, nargs="+", default=[64, 128], help="head dims (Dk = Dv)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="sequence lengths T (= S, causal self-attention)")
    p.add_argument("--tokens", type=int, default=16384, help="B * T, fixed across sequence lengths")
    p.add_argument("--model-dim", type=int, default=2048, help="H = model_dim / hdim")
    p.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA); 0 = same as query heads")
    p.add_argument("--windows", type=int, nargs="*", default=[128, 1024], help="sliding-window sizes W")
    p.add_argument("--cases", nargs="+", default=["causal", "window", "sinks"],
                   choices=["causal", "window", "sinks"], help="which rows to run")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--no-check", action="store_true", help="skip the correctness columns")
    p.add_argument("--check-grads-max-T", type=int, default=4096,
                   help="compare gradients only up to this T (the references materialise more memory)")
    p.add_argument("--warmup", type=int, default=25, help="ms of warmup per timing")
    p.add_argument("--rep", type=int, default=100, help="ms of repetitions per timing")
    return p.parse_args(argv)


def visible_pairs(T, S, window):
    """Number of (query, key) pairs a causal (windowed) attention computes, per batch and head."""
    offset = S - T
    pos = torch.arange(offset, S, dtype=torch.float64)
    seen = pos + 1 if window is None else torch.clamp(pos + 1, max=window)
    return float(seen.sum())


def smoke_check_on_cpu():
    print("CUDA is not available: nothing to benchmark. Running a tiny correctness smoke check under "
          "the Triton interpreter (TRITON_INTERPRET=1) instead.")
    os.environ["TRITON_INTERPRET"] = "1"          # must be set before triton is first imported
    from kernels import attention
    torch.manual_seed(0)
    B, T, S, Hq, Hkv, Dk, Dv = 1, 40, 56, 4, 2, 48, 32
    for window, with_sinks in [(None, False), (16, True)]:
        q = torch.randn(B, T, Hq, Dk, requires_grad=True)
        k = torch.randn(B, S, Hkv, Dk, requires_grad=True)
        v = torch.randn(B, S, Hkv, Dv, requires_grad=True)
        sinks = torch.randn(Hq, requires_grad=True) if with_sinks else None
        do = torch.randn(B, T, Hq, Dv)
        inputs = [q, k, v] + ([sinks] if with_sinks else [])
        results = {}
        for backend in ("triton", "torch"):
            o = attention(q, k, v, window=window, sinks=sinks, backend=backend)
            results[backend] = [o] + list(torch.autograd.grad(o, inputs, do))
        diff = max((a - b).abs().max().item() for a, b in zip(results["triton"], results["torch"]))
        print(f"  window={window} sinks={with_sinks}: max abs diff (o and grads) triton vs torch = {diff:.2e}")
        assert diff < 1e-4, "smoke check failed"
    print("ok")


def table_cases(args, T):
    """[(row name, window or None, with learned sinks)] at sequence length T."""
    cases = []
    if "causal" in args.cases:
        cases.append(("causal", None, False))
    if "window" in args.cases:
        cases += [(f"window {w}", w, False) for w in args.windows if w < T]
    if "sinks" in args.cases:
        cases.append(("sinks", None, True))
    return cases


def contenders(x, window, with_sinks, flash_attn_func):
    """{impl: (fn, its inputs)} for one row; x holds q, k, v [B, T, H(kv), D] and sinks [H]."""
    import torch.nn.functional as F
    from kernels import attention
    q, k, v, sinks = x["q"], x["k"], x["v"], x["sinks"]
    qkv, gqa = [q, k, v], q.shape[2] != k.shape[2]
    heads = lambda t: t.transpose(1, 2)                            # noqa: E731  [B, T, H, D] <-> [B, H, T, D]
    s = sinks if with_sinks else None
    impls = {"triton": (lambda: attention(q, k, v, window=window, sinks=s, backend="triton"),
                        qkv + ([sinks] if with_sinks else []))}
    if window is None:
        impls["sdpa"] = (lambda: heads(F.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True, enable_gqa=gqa)), qkv)
    else:
        i = torch.arange(q.shape[1], device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        impls["sdpa(mask)"] = (lambda: heads(F.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), attn_mask=mask, enable_gqa=gqa)), qkv)
    if flash_attn_func is not None and q.dtype != torch.float32 and not with_sinks:
        left = -1 if window is None else window - 1
        impls["flash_attn"] = (lambda: flash_attn_func(q, k, v, causal=True, window_size=(left, 0)), qkv)
    return impls


def outputs_and_grads(fn, inputs, do, with_grads):
    for x in inputs:
        x.grad = None
    o = fn()
    if not with_grads:
        return o.detach(), None
    o.backward(do)
    return o.detach(), [x.grad.clone() for x in inputs]


def check_row(impls, x, window, with_sinks, with_grads):
    """(max |o| diff, max |grad| diff or "-") of triton against the reference of this row: the torch backend
    when it has sinks, SDPA otherwise."""
    from kernels import attention
    max_diff = lambda a, b: (a.float() - b.float()).abs().max().item()   # noqa: E731
    fn, inputs = impls["triton"]
    if with_sinks:
        ref_fn = lambda: attention(x["q"], x["k"], x["v"], window=window, sinks=x["sinks"], backend="torch")  # noqa: E731
    else:
        ref_fn = impls["sdpa" if window is None else "sdpa(mask)"][0]
    o_tri, g_tri = outputs_and_grads(fn, inputs, x["do"], with_grads)
    o_ref, g_ref = outputs_and_grads(ref_fn, inputs, x["do"], with_grads)
    diff_g = f"{max(max_diff(a, b) for a, b in zip(g_tri, g_ref)):.2e}" if with_grads else "-"
    return f"{max_diff(o_tri, o_ref):.2e}", diff_g


def time_fwd_and_fwd_bwd(timer, fn, inputs, do, no_backward):
    """(forward ms, forward + backward ms or nan); timer(fn, grad_to_none) -> ms."""
    fwd = timer(fn, None)
    if no_backward:
        return fwd, float("nan")
    return fwd, timer(lambda: fn().backward(do), inputs)


def run_table(args, device, timer, flash_attn_func=None):
    """Print the table; returns its rows as dicts (case, D, T, impl, fwd_ms, fb_ms, diff_o, diff_g)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    header = (f"{'case':<12}{'D':>5}{'B':>4}{'T':>7}{'H':>4}  {'impl':<12}{'fwd ms':>9}{'TFLOP/s':>9}"
              f"{'f+b ms':>9}{'TFLOP/s':>9}  {'max|do|':>9}{'max|dgrad|':>11}")
    print(header)
    print("-" * len(header))
    rows = []
    for D in args.hdims:
        H = args.model_dim // D
        Hkv = args.kv_heads or H
        for T in args.seqlens:
            B = max(1, args.tokens // T)
            gen = torch.Generator(device=device).manual_seed(0)
            randn = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=gen)  # noqa: E731
            x = {"q": randn(B, T, H, D).requires_grad_(), "k": randn(B, T, Hkv, D).requires_grad_(),
                 "v": randn(B, T, Hkv, D).requires_grad_(),
                 "sinks": torch.randn(H, device=device, generator=gen).requires_grad_(), "do": randn(B, T, H, D)}
            for name, window, with_sinks in table_cases(args, T):
                flops_fwd = 2.0 * B * H * visible_pairs(T, T, window) * (D + D)
                impls = contenders(x, window, with_sinks, flash_attn_func)
                diff_o = diff_g = "-"
                if not args.no_check:
                    with_grads = not args.no_backward and T <= args.check_grads_max_T
                    diff_o, diff_g = check_row(impls, x, window, with_sinks, with_grads)
                for impl, (fn, impl_inputs) in impls.items():
                    try:
                        fwd_ms, fb_ms = time_fwd_and_fwd_bwd(timer, fn, impl_inputs, x["do"], args.no_backward)
                    except (RuntimeError, torch.OutOfMemoryError) as e:   # e.g. a dense mask too big
                        print(f"{name:<12}{D:>5}{B:>4}{T:>7}{H:>4}  {impl:<12}  failed: {str(e).splitlines()[0][:60]}")
                        if device == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    tf, tf_fb = flops_fwd / fwd_ms * 1e-9, 3.5 * flops_fwd / fb_ms * 1e-9
                    check = f"{diff_o:>9}{diff_g:>11}" if impl == "triton" else ""
                    print(f"{name:<12}{D:>5}{B:>4}{T:>7}{H:>4}  {impl:<12}{fwd_ms:>9.3f}{tf:>9.1f}"
                          f"{fb_ms:>9.3f}{tf_fb:>9.1f}  {check}", flush=True)
                    rows.append({"case": name, "D": D, "T": T, "impl": impl, "fwd_ms": fwd_ms, "fb_ms": fb_ms,
                                 "diff_o": diff_o if impl == "triton" else None,
                                 "diff_g": diff_g if impl == "triton" else None})
            del x
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        smoke_check_on_cpu()
        return
    from triton.testing import do_bench
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  tokens per batch: {args.tokens}  "
          f"flash_attn: {'yes' if flash_attn_func else 'not installed'}")
    timer = lambda fn, grad_to_none: do_bench(fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none)  # noqa: E731
    run_table(args, "cuda", timer, flash_attn_func)


if __name__ == "__main__":
    main()
