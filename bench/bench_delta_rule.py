"""Benchmark the delta-rule op: forward + backward time and peak memory.

Compares, at the same [B, T, H, D] shape:
  chunked   kernels.delta_rule (per-channel gate, KDA) with the chosen backend
  loop      the token-by-token recurrence in PyTorch (autograd through T steps)
  softmax   kernels.attention, causal, global (the cost a delta-rule layer replaces)

Peak memory is the most extra memory held at any point of forward + backward, inputs excluded:
on CUDA from torch.cuda.max_memory_allocated; on CPU from the allocation events of
torch.profiler(profile_memory=True) (running total of allocs and frees, its maximum).
Times are the median of --repeat runs without the profiler.

    python bench/bench_delta_rule.py                       # B=1 H=4 K=V=64, T in 512 2048 8192
    python bench/bench_delta_rule.py --loop-max-T 2048     # skip the slow loop at longer T
    python bench/bench_delta_rule.py --T 2048 --against main --threads 1 [--gate head]
        # the torch path against kernels/torch_delta_rule.py as it is at git revision `main`, side by
        # side in this process with interleaved repeats (time ratio and peak-memory ratio; the time ratio
        # is the median of the per-repeat ratios, with bench_nanogpt.median_interval's interval for it)
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# bind the dispatch functions now: importing a kernels submodule later re-binds kernels.<name> to it
from kernels import attention as softmax_attention  # noqa: E402
from kernels import delta_rule as delta_rule_op  # noqa: E402
from bench_nanogpt import ratio_text  # noqa: E402


def loop_delta_rule(q, k, v, g, beta, scale):
    """Token-by-token gated delta rule (SPEC 4); the baseline."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    outs = []
    for t in range(T):
        decay = torch.exp(g[:, t].float())                       # [B,H,K], or [B,H] for a per-head gate
        S = S * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        read = torch.einsum("bhk,bhkv->bhv", k[:, t].float(), S)
        write = beta[:, t, :, None].float() * (v[:, t].float() - read)
        S = S + k[:, t, :, :, None].float() * write[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].float() * scale, S))
    return torch.stack(outs, dim=1).to(q.dtype)


def make_inputs(B, T, H, K, V, device, dtype, gate="channel"):
    """gate: "channel" (KDA, g [B,T,H,K]) or "head" (GDN, g [B,T,H])."""
    q = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    v = torch.randn(B, T, H, V, device=device)
    g = -F.softplus(torch.randn(B, T, H, *([K] if gate == "channel" else []), device=device) - 2)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device))
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(fn, inputs):
    for x in inputs:
        x.grad = None
    o = fn(*inputs)
    o.float().square().sum().backward()


def time_ms(fn, inputs, device, repeat):
    fwd_bwd(fn, inputs)                                           # warm-up
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fwd_bwd(fn, inputs)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mb(fn, inputs, device):
    for x in inputs:
        x.grad = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(fn, inputs)
        sync(device)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fwd_bwd(fn, inputs)
    try:   # the raw allocation events are not a public API: fall back to what autograd saves
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
    except AttributeError:
        return saved_mb(fn, inputs)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak / 2**20


def saved_mb(fn, inputs):
    """MB of the distinct storages autograd saves for backward (a lower bound on the peak)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = fn(*inputs)
    o.float().sum().backward()
    return sum(storages.values()) / 2**20


def load_at_revision(rev):
    """kernels/torch_delta_rule.py as it is at git revision `rev`, imported as a standalone module."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "show", f"{rev}:kernels/torch_delta_rule.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"torch_delta_rule_at_{rev.replace('/', '_')}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("delta_rule_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against(args, scale, device, dtype):
    """This checkout's torch path against the one at --against, interleaved repeats, one process."""
    from kernels.torch_delta_rule import delta_rule_torch
    before = load_at_revision(args.against).delta_rule_torch
    fns = {"now": lambda *x: delta_rule_torch(*x, scale=scale)[0],
           args.against: lambda *x: before(*x, scale=scale)[0]}
    print(f"torch path now vs at {args.against}: B={args.B} H={args.H} K={args.K} V={args.V} {args.dtype} gate={args.gate} "
          f"on {device} (threads={torch.get_num_threads()}), forward+backward, median of {args.repeat} interleaved")
    for T in args.T:
        inputs = make_inputs(args.B, T, args.H, args.K, args.V, device, dtype, args.gate)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fwd_bwd(fn, inputs)                                   # warm-up
        for _ in range(args.repeat):
            for name, fn in fns.items():
                times[name].append(time_ms(fn, inputs, device, 1))
        ms = {name: statistics.median(t) for name, t in times.items()}
        mb = {name: peak_mb(fn, inputs, device) for name, fn in fns.items()}
        print(f"T={T}: " + "  ".join(f"{n} {ms[n]:.1f} ms {mb[n]:.1f} MB" for n in fns)
              + f"  | time {ratio_text(times[args.against], times['now'], f'({args.against}/now)')}, "
              f"peak memory {mb[args.against] / mb['now']:.2f}x", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64, help="key/query head dim")
    p.add_argument("--V", type=int, default=64, help="value head dim")
    p.add_argument("--gate", default="channel", choices=["channel", "head"],
                   help="decay gate: per key channel (KDA) or one per head (GDN)")
    p.add_argument("--backend", default=None, choices=["torch", "triton"], help="delta-rule backend (default: by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=3, help="timed runs per entry (median)")
    p.add_argument("--loop-max-T", type=int, default=None, help="skip the token loop above this T")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--against", default=None, metavar="REV",
                   help="compare the torch path with kernels/torch_delta_rule.py at this git revision")
    args = p.parse_args()
    for name, value in vars(args).items():  # every size: an integer >= 1 (0 or less was a traceback)
        if any(isinstance(v, int) and not isinstance(v, bool) and v < 1 for v in (value if isinstance(value, list) else [value])):
            print(f"error: --{name.replace('_', '-')}: must be integers >= 1 (got {value})", file=sys.stderr)
            sys.exit(2)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    scale = args.K ** -0.5
    chunked = lambda q, k, v, g, beta: delta_rule_op(q, k, v, g, beta, scale=scale, backend=args.backend)[0]
    if args.against:
        return against(args, scale, device, dtype)
    looped = lambda q, k, v, g, beta: loop_delta_rule(q, k, v, g, beta, scale)
    softmax = lambda q, k, v, g, beta: softmax_attention(q, k, v, scale=scale)
    print(f"B={args.B} H={args.H} K={args.K} V={args.V} {args.dtype} gate={args.gate} on {device} "
          f"(threads={torch.get_num_threads()}), forward+backward, time = median of {args.repeat}")
    cols = ["T", "chunked ms", "chunked MB", "loop ms", "loop MB", "loop/chunked", "softmax ms", "softmax MB"]
    print(" | ".join(f"{c:>12}" for c in cols))
    for T in args.T:
        inputs = make_inputs(args.B, T, args.H, args.K, args.V, device, dtype, args.gate)
        row = [T]
        for name, fn in (("chunked", chunked), ("loop", looped), ("softmax", softmax)):
            if name == "loop" and args.loop_max_T is not None and T > args.loop_max_T:
                row += [None, None]
            else:
                ms = time_ms(fn, inputs, device, args.repeat)
                mb = None if args.no_memory else peak_mb(fn, inputs, device)
                row += [ms, mb]
            if name == "loop":
                row.append(None if row[3] is None else row[3] / row[1])
        fmt = lambda x: f"{'-':>12}" if x is None else (f"{x:>12d}" if isinstance(x, int) else f"{x:>12.1f}")
        print(" | ".join(fmt(x) for x in row), flush=True)


if __name__ == "__main__":
    main()
