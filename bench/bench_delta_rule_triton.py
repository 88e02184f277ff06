"""Benchmark the Triton gated delta rule (kernels/triton_delta_rule.py) on CUDA.

Forward and forward+backward milliseconds, bf16 inputs, H=16, K=V=128, for B in {1, 4} and T from 2k
to 32k, against:
    torch   kernels.delta_rule(..., backend="torch")            (skipped above --torch-max-t)
    fla     fla.ops.kda.chunk_kda (per-channel gate) or
            fla.ops.gated_delta_rule.chunk_gated_delta_rule (per-head gate), if importable
    sdpa    causal F.scaled_dot_product_attention, same B, T, H, head dim

    python bench/bench_delta_rule_triton.py [--gate channel|head] [--batch 1 4] [--seqlens 2048 ...]

Without CUDA it prints a message and exits 0.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--gate", choices=["channel", "head"], default="channel",
                   help="per-channel gate g [B,T,H,K] (KDA) or per-head g [B,T,H] (GDN)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--torch-max-t", type=int, default=4096,
                   help="skip the torch backend above this sequence length (it is slow)")
    p.add_argument("--methods", nargs="+", default=["triton", "torch", "fla", "sdpa"],
                   choices=["triton", "torch", "fla", "sdpa"])
    p.add_argument("--rep", type=int, default=50, help="timing repetitions in ms (triton.testing.do_bench)")
    return p.parse_args()


def make_inputs(B, T, H, D, gate, device, dtype=torch.bfloat16):
    q = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=device, dtype=dtype)
    gate_shape = (B, T, H, D) if gate == "channel" else (B, T, H)
    g = (-F.softplus(torch.randn(gate_shape, device=device)) * 0.1).float()  # gates kept in fp32
    beta = torch.rand(B, T, H, device=device).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def delta_rule_fn(backend):
    from kernels import delta_rule

    def run(q, k, v, g, beta):
        return delta_rule(q, k, v, g, beta, backend=backend)[0]
    return run


def fla_fn(gate):
    if gate == "channel":
        from fla.ops.kda import chunk_kda

        def run(q, k, v, g, beta):
            return chunk_kda(q=q, k=k, v=v, g=g, beta=beta)[0]
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def run(q, k, v, g, beta):
            return chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta)[0]
    return run


def sdpa_fn():
    def run(q, k, v, g, beta):  # same [B,T,H,D] tensors, attention layout [B,H,T,D]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)
    return run


def time_ms(fn, inputs, rep):
    """(forward ms, forward+backward ms), or a short string saying why not."""
    from triton.testing import do_bench
    try:
        with torch.no_grad():
            fwd = do_bench(lambda: fn(*inputs), rep=rep)
        out = fn(*inputs)
        d_out = torch.randn_like(out)
        del out

        def fwd_bwd():
            torch.autograd.backward(fn(*inputs), d_out)
        both = do_bench(fwd_bwd, rep=rep, grad_to_none=inputs)
        return f"{fwd:9.2f}", f"{both:9.2f}"
    except torch.cuda.OutOfMemoryError:
        return "oom", "oom"
    except Exception as e:  # an optional baseline with another signature, an unsupported shape, ...
        return "error", type(e).__name__
    finally:
        torch.cuda.empty_cache()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_delta_rule_triton: no CUDA device; this benchmark needs a GPU. Nothing to do.")
        return 0
    methods = {}
    for name in args.methods:
        try:
            methods[name] = {"triton": lambda: delta_rule_fn("triton"), "torch": lambda: delta_rule_fn("torch"),
                             "fla": lambda: fla_fn(args.gate), "sdpa": sdpa_fn}[name]()
            if name == "torch":
                import kernels.torch_delta_rule  # noqa: F401  (fail here, not inside the timing loop)
        except ImportError as e:
            print(f"skipping {name}: {e}")
            methods.pop(name, None)
    H, D = args.heads, args.head_dim
    print(f"# {torch.cuda.get_device_name()}  bf16  H={H} K=V={D}  gate={args.gate}  (ms, lower is better)")
    print(f"{'B':>3} {'T':>6} {'method':>8} {'fwd':>9} {'fwd+bwd':>9}")
    for B in args.batch:
        for T in args.seqlens:
            inputs = make_inputs(B, T, H, D, args.gate, "cuda")
            for name, fn in methods.items():
                if name == "torch" and T > args.torch_max_t:
                    fwd, both = "skip", "skip"
                else:
                    fwd, both = time_ms(fn, inputs, args.rep)
                print(f"{B:>3} {T:>6} {name:>8} {fwd:>9} {both:>9}", flush=True)
            del inputs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
