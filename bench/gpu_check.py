"""One run for the first GPU: kernel correctness, kernel speed, and a ~125M-parameter training run,
all written to one JSON file. bench/gpu_check.sh calls it; see there.

    python bench/gpu_check.py --out gpu_check.json             # on a CUDA GPU (under ~8 minutes)
    python bench/gpu_check.py --dry-run --out /tmp/check.json  # CPU: tiny shapes, Triton interpreter

Sections (each recorded in the JSON, in this order: the most wanted first):
  checks  every Triton op against its torch path on the same device, in bf16 (fp16 in --dry-run: the
          interpreter has no bf16 arithmetic), forward AND the gradients of every input: attention
          (causal, GQA, window, sinks, packed documents),
          delta_rule (per-channel and per-head gate, initial state, final state, packed documents; KDA
          also at twice the head width, where the backward splits the key columns),
          delta_rule_step, DSA's sparse_mla_attention and index_topk (the scores of the keys each
          path selected: ties may break differently), NSA's block_sparse_attention, paged decode (with
          and without a window and sinks). Error = max |a - b| / max |b|; limits: fp32 2e-3, bf16 3e-2.
          An op that raises is a failed row with its error. Each row's seconds ("s") include the
          compiles of its kernels (every autotune config; kernels/triton_autotune.py compiles them in
          parallel, HYBRID_COMPILE_THREADS threads, default every core).
  train   steps of a 3 KDA : 1 MLA model (d=768, 12 layers, ~125M parameters; tiny in --dry-run),
          bf16 autocast on CUDA (fp16 in --dry-run), fused AdamW; tokens/s over the steps after warm-up and MFU
          (cost.py's FLOPs per token over the device's dense bf16 peak).
  kernels forward+backward ms: attention (triton, SDPA flash backend, flash_attn if installed), the
          delta rule (triton, torch, flash-linear-attention if installed), and bench_sparse.py's rows
          at T=8192 (NSA selection, DSA sparse MLA, each against dense attention; the indexer's
          top-k). Not in --dry-run. Each cell is saved as it ends, with its seconds (compiles included);
          flash-linear-attention's cells come last (its first call autotunes its own kernels). A cell
          still running after --cell-limit seconds is stopped and recorded as timed out (ours: the run
          fails), and the run goes on.
  checks_fp32  the same checks in fp32 (rows added to "checks"): exact dots, whose FMA-loop kernels
          take the longest to compile, so after the speed figures.
  compile each mixer family (kda+mla, gdn+attn, nsa, dsa; small models, B=4, T=1024) on the triton
          backend under torch.compile(fullgraph=True, Inductor): a graph break or an error fails; loss
          and gradients against eager (fp32 limit), compile time, eager vs compiled tokens/s. In
          --dry-run: kda+mla only, with aot_eager.
"autotune" holds, per autotuned kernel, the config chosen at each tuning key and the seconds its first launch
there took (compiles and benchmarking): what to prune when a tuning is slow.
The JSON is rewritten after every row, so a run cut short (a machine's time limit) keeps what it measured.
Work that would start after --budget seconds (default 420) is skipped and listed under "skipped".
Exit status: 0 when every check ran and passed; 1 when a kernel is wrong or raises, a section fails, or
something was skipped for time (the JSON says which, and holds every other result); 2 without CUDA and
without --dry-run.
"""
import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

LIMITS = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 3e-2}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, Triton under the interpreter: checks the driver, not the GPU")
    p.add_argument("--train-steps", type=int, default=50)
    p.add_argument("--skip", nargs="*", default=[], choices=["checks", "kernels", "compile", "train"])
    p.add_argument("--budget", type=float, default=420,
                   help="seconds: work that would start later is skipped and named, and the run exits 1 "
                        "(default 420; every finished row is already in --out)")
    p.add_argument("--cell-limit", type=float, default=150,
                   help="seconds one kernel benchmark cell may take, its compiles and autotuning included "
                        "(default 150): a cell past it is stopped and recorded as timed out (ours: the run "
                        "fails), and the run goes on to the next")
    args = p.parse_args(argv)
    if not args.cell_limit > 0:
        p.error(f"--cell-limit must be a positive number of seconds, got {args.cell_limit:g}")
    return args


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def compare(name, fn, inputs, dtype, limit, grad=True):
    """Run fn(*inputs, backend) for triton and torch; compare the outputs and (grad) every input gradient.
    An exception is a failed row with its error line."""
    try:
        return _compare(name, fn, inputs, dtype, limit, grad)
    except Exception as e:  # one op that raises (say, a kernel that does not compile) fails, the rest still run
        return {"name": name, "dtype": str(dtype).replace("torch.", ""), "max_rel_err": float("nan"),
                "limit": limit, "ok": False, "error": error_line(e)}


def error_line(e):
    """One line: the exception's first line and, when it has more (a Triton CompilationError: the source
    position, then the source, then the cause), its last."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    text = lines[0][:300] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
    return f"{type(e).__name__}: {text}"


def _compare(name, fn, inputs, dtype, limit, grad):
    import torch
    results = {}
    for backend in ("triton", "torch"):
        leaves = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
        out = fn(*leaves, backend=backend)
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o for o in outs if o is not None]
        gen = torch.Generator(device=outs[0].device).manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in outs)
        diff = [x for x in leaves if x.requires_grad]
        grads = torch.autograd.grad(loss, diff, allow_unused=True) if loss.requires_grad else []
        results[backend] = list(outs) + [g for g in grads if g is not None]
    errs = [rel_err(a, b) for a, b in zip(results["triton"], results["torch"])]
    worst = max(errs) if errs else float("nan")
    ok = len(results["triton"]) == len(results["torch"]) and math.isfinite(worst) and worst <= limit
    return {"name": name, "dtype": str(dtype).replace("torch.", ""), "max_rel_err": worst, "limit": limit,
            "ok": ok}


def autotune_choices():
    """kernels.triton_autotune.choices(): each autotuned kernel's chosen config per tuning key and the seconds
    its first launch there took (empty under the interpreter, whose kernels run one fixed config)."""
    try:
        from kernels.triton_autotune import choices
    except ImportError:  # no triton
        return {}
    return choices()


class CellTimeout(BaseException):
    """A kernel benchmark cell ran past --cell-limit. A BaseException, so that no `except Exception` on the
    way (kernels.triton_autotune's parallel compile swallows its errors for the autotuner to meet again)
    keeps the cell running."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise CellTimeout in the main thread once `seconds` have passed (SIGALRM). Python runs the handler
    between bytecodes, so it stops the autotuner between configs, do_bench between launches, or a wait
    on the compile pool; not a single call into C that never returns. No limit off the main thread."""
    if not math.isfinite(seconds) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CellTimeout(f"timed out after {seconds:g} s (--cell-limit)")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Progress:
    """Where the run stands. Each finished row goes to --out at once, so a run cut short (a time limit, a
    crash) keeps what it measured; work that would start after --budget seconds is skipped, and named;
    a kernel benchmark cell is stopped after cell_limit seconds (--cell-limit)."""

    def __init__(self, report, out=None, budget=float("inf"), cell_limit=float("inf")):
        self.report, self.out, self.budget, self.t0 = report, out, budget, time.perf_counter()
        self.cell_limit = cell_limit
        self.skipped = []

    def elapsed(self):
        return time.perf_counter() - self.t0

    def over(self, what):
        """True once the budget is spent; `what` is then recorded as skipped."""
        if self.elapsed() <= self.budget:
            return False
        self.skipped.append(what)
        return True

    def save(self, strict=False):
        """Write the report to --out; a DataError (say, the disk is full) is raised only if strict: main's
        last write reports it and prints the report instead."""
        if self.out is not None:
            from data.tokens import DataError, atomic_write
            self.report.update(wall_s=self.elapsed(), skipped=self.skipped, autotune=autotune_choices())
            try:
                atomic_write(self.out, lambda f: json.dump(self.report, f, indent=2), mode="w")
            except DataError:
                if strict:
                    raise


def run_checks(device, dry, dtype, progress=None):
    """Every op check at one dtype, each row printed, timed (its compiles included) and added to the
    report's "checks" as it finishes."""
    import torch
    progress = progress or Progress({})
    torch.manual_seed(0)
    rows = progress.report.setdefault("checks", [])

    def check(name, fn, inputs, dtype, limit, grad=True):
        dt = str(dtype).replace("torch.", "")
        if progress.over(f"check {name} {dt}"):
            row = {"name": name, "dtype": dt, "ok": None, "skipped": "time budget"}
            print(f"  skip {name} {dt} (over the time budget)", flush=True)
        else:
            t0 = time.perf_counter()
            row = compare(name, fn, inputs, dtype, limit, grad)
            row["s"] = round(time.perf_counter() - t0, 2)
            print(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['name']:<32} {row['dtype']:<9} "
                  f"max rel err {row['max_rel_err']:.2e} (limit {row['limit']:.0e}) {row['s']:6.1f} s"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
        rows.append(row)
        progress.save()
        return row
    limit = LIMITS[str(dtype).replace("torch.", "")]
    dense_checks(device, dry, dtype, limit, check=check)
    sparse_checks(device, dry, dtype, limit, check=check)


def dense_checks(device, dry, dtype, limit, short=False, check=compare):
    """Attention (causal, GQA, window, sinks, packed documents) and the delta rule (KDA and GDN gates,
    initial and final state, packed documents, the one-token decode step). short: the GPU run's head
    width at a short length (compile_sm90.py records its launches under the interpreter). check: compare,
    or run_checks' wrapper of it. Returns the rows."""
    import torch
    import torch.nn.functional as F
    import kernels
    B, H, T, D = (1, 2, 24, 16) if dry else (1, 2, 40, 64) if short else (2, 4, 300, 64)
    cu = torch.tensor([0, T // 4, 2 * T // 3, T], device=device)       # three packed documents (B = 1)
    r = lambda *s: torch.randn(*s, device=device).to(dtype)
    rows = []
    for name, Hkv, window, sinks in (("attention causal", H, None, False), ("attention gqa", 1, None, False),
                                     ("attention window", H, 16, False), ("attention sinks", H, 16, True)):
        inputs = [r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D)]
        sink = torch.randn(H, device=device) if sinks else None
        fn = lambda q, k, v, backend: kernels.attention(q, k, v, window=window, sinks=sink, backend=backend)
        rows.append(check(name, fn, inputs, dtype, limit))
    fn = lambda q, k, v, backend: kernels.attention(q, k, v, cu_seqlens=cu, backend=backend)
    rows.append(check("attention packed", fn, [r(1, T, H, D), r(1, T, 1, D), r(1, T, 1, D)], dtype, limit))
    for per_channel in (True, False):
        def delta_inputs(B, D=D):
            q, k = (F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype) for _ in range(2))
            g = -F.softplus(torch.randn((B, T, H, D) if per_channel else (B, T, H), device=device))
            return [q, k, r(B, T, H, D), g, torch.sigmoid(torch.randn(B, T, H, device=device)).to(dtype)]
        kind = "kda" if per_channel else "gdn"
        S0 = torch.randn(B, H, D, D, device=device)
        fn = lambda q, k, v, g, beta, S0, backend: kernels.delta_rule(
            q, k, v, g, beta, initial_state=S0, output_final_state=True, backend=backend)
        rows.append(check(f"delta_rule {kind}", fn, delta_inputs(B) + [S0], dtype, limit))
        if per_channel:  # heads twice as wide (Kimi Linear's 128): the backward splits the key columns
            rows.append(check(f"delta_rule {kind} K={2 * D}", fn, delta_inputs(B, 2 * D)
                              + [torch.randn(B, H, 2 * D, 2 * D, device=device)], dtype, limit))
        fn = lambda q, k, v, g, beta, backend: kernels.delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend=backend)
        rows.append(check(f"delta_rule {kind} packed", fn, delta_inputs(1), dtype, limit))
        step = lambda q, k, v, g, beta, S0, backend: (kernels.delta_rule_step(
            q, k, v, g, beta, S := S0.detach().clone(), backend=backend), S)
        rows.append(check(f"delta_rule_step {kind}", step, [x[:, 0] for x in delta_inputs(B)] + [S0],
                            dtype, limit, grad=False))   # decode: in place, no autograd
    return rows


def sparse_checks(device, dry, dtype, limit, short=False, check=compare):
    """DSA's sparse MLA attention and indexer top-k, NSA's block-sparse selection, paged decode (short: as
    dense_checks)."""
    import torch
    import kernels
    from bench_sparse import nsa_blocks
    from kernels.torch_sparse import index_scores
    B, T, H, Hkv, D = (1, 24, 4, 2, 16) if dry else (1, 100, 16, 4, 128) if short else (2, 300, 16, 4, 128)
    d_c, d_rope, top_k, HI, dI = (16, 8, 8, 2, 8) if dry else (512, 64, 64, 4, 64)
    block, n_sel = (4, 4) if dry else (32, 5)
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=gen).to(dtype)
    rows = []
    # DSA: top_k distinct visible keys per query, its own position among them (every row has a key; early
    # queries padded with -1): NSA's block choice with blocks of one key
    idx = nsa_blocks(B, T, 1, top_k, 1, device, gen)[:, :, 0]
    Dk = d_c + d_rope
    fn = lambda q, kv, idx, backend: kernels.sparse_mla_attention(q, kv, idx, d_v=d_c, scale=Dk ** -0.5,
                                                                  backend=backend)
    rows.append(check("sparse_mla_attention (dsa)", fn, [r(B, T, H, Dk), r(B, T, Dk), idx], dtype, limit))
    # the indexer: the two paths may break near-ties differently, so compare the scores they selected
    iq, iw, ik = r(B, T, HI, dI), r(B, T, HI), r(B, T, dI)
    scores, pos = index_scores(iq, iw, ik), torch.arange(T, device=device).view(1, T, 1)

    def selected(iq, iw, ik, backend):
        sel = kernels.index_topk(iq, iw, ik, top_k, backend=backend)
        valid = (sel >= 0) & (sel <= pos)
        return scores.gather(-1, sel.clamp(0, T - 1)).masked_fill(~valid, 0), valid.float()
    rows.append(check("index_topk (dsa)", selected, [iq, iw, ik], dtype, limit, grad=False))
    blocks = nsa_blocks(B, T, Hkv, n_sel, block, device, gen)
    fn = lambda q, k, v, backend: kernels.block_sparse_attention(q, k, v, blocks, block, backend=backend)
    rows.append(check("block_sparse_attention (nsa)", fn, [r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D)],
                        dtype, limit))
    # paged decode: 3 rows of T, T // 3 and 1 keys, their blocks scattered over one pool
    lens = torch.tensor([T, T // 3, 1], device=device)
    nb = -(-T // block)
    table = torch.randperm(3 * nb, device=device, generator=gen).view(3, nb)
    pools = [r(3 * nb, block, Hkv, D), r(3 * nb, block, Hkv, D)]
    for name, window, sinks in (("paged_decode", None, None), ("paged_decode window sinks", 16,
                                                                torch.randn(H, device=device, generator=gen))):
        fn = lambda q, kp, vp, backend: kernels.paged_attention(q, kp, vp, table, lens, window=window, sinks=sinks,
                                                                backend=backend)
        rows.append(check(name, fn, [r(3, 1, H, D)] + pools, dtype, limit, grad=False))
    return rows


def time_ms(fn, inputs):
    import torch
    from triton.testing import do_bench

    def run():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out.float().sum(), [x for x in inputs if x.requires_grad])
    return do_bench(run, warmup=5, rep=40)


def run_kernels(device, progress=None, B=4, H=16, D=128, seqlens=(2048, 8192), sparse=True):
    """Forward+backward ms of the Triton kernels and their baselines, bf16; each measurement saved as it
    ends, no row started after the time budget. (The defaults are the GPU run's; a test passes tiny ones.)"""
    import torch
    import torch.nn.functional as F
    import kernels
    from torch.nn.attention import SDPBackend, sdpa_kernel
    progress = progress or Progress({})
    rows = progress.report["kernels"] = []

    def start(row):
        rows.append(row)
        return row

    def done(row):
        print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        progress.save()

    def measure(row, key, fn, inputs):
        """row[key] = fwd+bwd ms of fn, its first call's compiles and autotuning included in row[key + "_s"];
        announced before it starts and saved when it ends, so a run cut short says where it was."""
        print(f"  {row['op']} T={row['T']}: {key} ...", flush=True)
        t0 = time.perf_counter()
        try:
            with time_limit(progress.cell_limit):
                row[key] = time_ms(fn, inputs)
        except ImportError:
            row[key] = "not installed"
        except (Exception, CellTimeout) as e:  # a baseline's failure is recorded; ours fails the run (main)
            row[key] = str(e) if isinstance(e, CellTimeout) else f"failed: {error_line(e)}"
            if key in ("triton_ms", "torch_ms"):
                row["error"] = row[key]
        row[key.replace("_ms", "_s")] = round(time.perf_counter() - t0, 1)
        progress.save()

    for T in seqlens:
        if progress.over(f"kernels attention T={T}"):
            continue
        x = lambda: torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = x(), x(), x()
        row = start({"op": "attention causal", "B": B, "T": T, "H": H, "D": D})

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True)

        def flash_attn(q, k, v):
            from flash_attn import flash_attn_func
            return flash_attn_func(q, k, v, causal=True)
        measure(row, "triton_ms", lambda q, k, v: kernels.attention(q, k, v, backend="triton"), [q, k, v])
        measure(row, "sdpa_flash_ms", sdpa, [q, k, v])
        measure(row, "flash_attn_ms", flash_attn, [q, k, v])
        done(row)
    later = []                                    # (row, inputs) for flash-linear-attention, timed last
    for T in seqlens:
        if progress.over(f"kernels delta_rule T={T}"):
            continue
        q, k = (F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(torch.bfloat16).requires_grad_()
                for _ in range(2))
        v = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = (-F.softplus(torch.randn(B, T, H, D, device=device)) * 0.1).requires_grad_()
        beta = torch.rand(B, T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
        inputs = [q, k, v, g, beta]
        row = start({"op": "delta_rule kda", "B": B, "T": T, "H": H, "D": D})

        measure(row, "triton_ms", lambda *a: kernels.delta_rule(*a, backend="triton")[0], inputs)
        if T <= 2048:
            measure(row, "torch_ms", lambda *a: kernels.delta_rule(*a, backend="torch")[0], inputs)
        else:
            row["torch_ms"] = "skipped (slow)"
        later.append((row, inputs))
        done(row)
    for row in sparse_kernels(device, progress=progress) if sparse else []:
        done(start(row))

    def fla(q, k, v, g, beta):
        from fla.ops.kda import chunk_kda
        return chunk_kda(q, k, v, g, beta)[0]
    for row, inputs in later:  # last: its first call autotunes flash-linear-attention's own kernels
        if not progress.over(f"kernels delta_rule T={row['T']} fla"):
            measure(row, "fla_ms", fla, inputs)
            done(row)
    return rows


def sparse_kernels(device, seqlens=(8192,), progress=None):
    """bench_sparse.py's rows at its default (paper-sized) shapes: NSA selection and DSA's sparse MLA
    against dense attention, the indexer's top-k: yields a row per case; a kernel that raises is a row
    with "error"."""
    import torch
    from triton.testing import do_bench
    import bench_sparse
    a = bench_sparse.parse_args([])
    progress = progress or Progress({})
    for T in seqlens:
        for name, (fn, inputs) in bench_sparse.cases(a, T, device, torch.bfloat16).items():
            if progress.over(f"kernels sparse {name} T={T}"):
                continue
            row = {"op": f"sparse {name}", "T": T}
            try:
                with time_limit(progress.cell_limit):
                    with torch.no_grad():
                        row["fwd_ms"] = do_bench(fn, warmup=5, rep=40)
                    row["fwd_bwd_ms"] = do_bench(bench_sparse.fwd_bwd(fn, inputs), warmup=5, rep=40) if inputs \
                        else "forward only"
            except CellTimeout as e:  # recorded, and main fails the run on it
                row["error"] = str(e)
            except Exception as e:
                row["error"] = error_line(e)
            yield row
        torch.cuda.empty_cache()


def train_model_config(dry):
    """3 KDA : 1 MLA on the triton backend. d=768, 12 layers, vocab 32768: about 125M parameters (tiny in
    --dry-run, where the kernels run under the interpreter)."""
    from model import ModelConfig
    d, n_layer, heads, vocab = (64, 4, 2, 257) if dry else (768, 12, 12, 32768)
    hd = d // heads
    return ModelConfig.from_dict({
        "vocab_size": vocab, "d_model": d, "n_layer": n_layer, "pattern": ["kda", "kda", "kda", "mla"],
        "backend": "triton",
        "layers": {"kda": {"kind": "kda", "n_heads": heads, "head_dim": hd},
                   "mla": {"kind": "mla", "n_heads": heads, "q_lora_rank": d // 2, "kv_lora_rank": d // 3 // 16 * 16,
                           "qk_nope_dim": hd, "qk_rope_dim": hd // 2, "v_head_dim": hd}}})


def run_train(device, dry, steps):
    import torch
    import cost
    from model import GPT
    mcfg = train_model_config(dry)
    B, T = (2, 64) if dry else (8, 2048)
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    x = torch.randint(0, mcfg.vocab_size, (B, T + 1), device=device)
    warmup = min(5, max(steps - 1, 0))
    losses, t0 = [], None
    for i in range(steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16 if cuda else torch.float16):  # fp16: interpreter
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if cuda:
        torch.cuda.synchronize()
    timed = steps - warmup
    tok_s = timed * B * T / (time.perf_counter() - t0) if timed > 0 else float("nan")
    flops = cost.train_flops_per_token(mcfg, T)
    peak = cost.peak_flops(device)
    mfu = cost.mfu(flops, tok_s, 1, peak)
    row = {"params": model.num_params(), "B": B, "T": T, "steps": steps, "timed_steps": timed,
           "tokens_per_s": tok_s, "train_flops_per_token": flops, "peak_flops": peak, "mfu": mfu,
           "first_loss": losses[0], "last_loss": losses[-1], "finite": all(math.isfinite(v) for v in losses),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    print(f"  {row['params'] / 1e6:.1f}M params, B={B} T={T}: {tok_s:,.0f} tokens/s, MFU "
          f"{'n/a' if mfu is None else f'{mfu:.1%}'}, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return row


COMPILE_FAMILIES = {"kda+mla": ["kda", "mla"], "gdn+attn": ["gdn", "attn"], "nsa": ["nsa"], "dsa": ["dsa"]}


def compile_model_config(pattern, d=32, heads=2, vocab=32):
    """A small model of `pattern` on the triton backend (layer kinds: kda, gdn, mla, attn, nsa, dsa =
    MLA with DSA's sparse stage); tests/test_library_ops.py compiles the same models on CPU."""
    from model import ModelConfig
    hd, r = d // heads, d // 2
    mla = {"kind": "mla", "n_heads": heads, "q_lora_rank": r, "kv_lora_rank": r, "qk_nope_dim": hd // 2,
           "qk_rope_dim": hd // 2, "v_head_dim": hd // 2}
    layers = {"kda": {"kind": "kda", "n_heads": heads, "head_dim": hd},
              "gdn": {"kind": "gdn", "n_heads": heads, "head_dim": hd},
              "mla": {**mla, "rope": False},
              "attn": {"kind": "attn", "n_heads": heads, "n_kv_heads": heads // 2},
              "nsa": {"kind": "nsa", "n_heads": heads, "n_kv_heads": heads // 2, "head_dim": hd, "cmp_block": 4,
                      "cmp_stride": 4, "sel_block": 4, "n_sel": 3, "window": 4},
              "dsa": {**mla, "dsa": {"n_heads": heads, "head_dim": hd, "rope_dim": hd // 2, "top_k": 4,
                                     "stage": "sparse"}}}
    return ModelConfig.from_dict(dict(vocab_size=vocab, d_model=d, n_layer=len(pattern), pattern=pattern,
                                      backend="triton", layers={p: layers[p] for p in pattern},
                                      mlp={"kind": "swiglu", "hidden": 2 * d}))


def run_compile(device, dry, progress=None):
    """Each mixer family on the triton backend under torch.compile(fullgraph=True) (a graph break is an
    error): loss and every gradient against eager (fp32), compile time, and eager vs compiled training
    tokens/s. Inductor on CUDA; in --dry-run one family with aot_eager (the interpreter has no codegen)."""
    import torch
    from model import GPT
    d, heads, B, T, families = (32, 2, 1, 20, ["kda+mla"]) if dry else (256, 4, 4, 1024, list(COMPILE_FAMILIES))
    progress = progress or Progress({})
    rows = progress.report["compile"] = []
    for name in families:
        if progress.over(f"compile {name}"):
            continue
        row = {"family": name, "B": B, "T": T}
        try:
            torch.manual_seed(0)
            model = GPT(compile_model_config(COMPILE_FAMILIES[name], d, heads, vocab=256)).to(device)
            idx = torch.randint(0, 256, (B, T), device=device, generator=torch.Generator(device).manual_seed(1))

            def step(m):
                model.zero_grad(set_to_none=True)
                _, loss = m(idx, idx)
                loss.backward()
                return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            eager = step(model)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if dry else "inductor")
            t0 = time.perf_counter()
            got = step(compiled)
            row["compile_s"] = time.perf_counter() - t0
            row["max_rel_err"] = max(rel_err(a, b) for a, b in zip(got, eager))
            row["ok"] = math.isfinite(row["max_rel_err"]) and row["max_rel_err"] <= LIMITS["float32"]
            if not dry:
                for label, m in (("eager", model), ("compiled", compiled)):
                    step(m)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        step(m)
                    torch.cuda.synchronize()
                    row[f"{label}_tok_s"] = 5 * B * T / (time.perf_counter() - t0)
        except Exception as e:  # a graph break under fullgraph=True lands here too
            row.update(ok=False, error=error_line(e))
        print(f"  {'ok  ' if row['ok'] else 'FAIL'} {name:<9} " + "  ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            if k not in ("family", "ok")), flush=True)
        rows.append(row)
        progress.save()
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is first imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from data.tokens import DataError, check_writable
    try:  # before minutes of GPU work, not after
        check_writable(args.out, "--out")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("error: gpu_check: no CUDA device; run on a GPU, or pass --dry-run to check the driver on CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
              "torch": torch.__version__, "dry_run": args.dry_run}
    try:
        import triton
        from kernels.triton_autotune import compile_threads
        report["triton"], report["compile_threads"] = triton.__version__, compile_threads()
    except ImportError:
        report["triton"] = None
    except ValueError as e:  # a bad HYBRID_COMPILE_THREADS, before any work
        print(f"error: {e}", file=sys.stderr)
        return 2
    progress = Progress(report, args.out, args.budget, args.cell_limit)
    failed = []

    def section(name, title, work):
        """One section into the report (and returned; the checks add their rows to report["checks"]
        themselves); an exception fails the run, the others still run; none starts after the time budget."""
        if name.removesuffix("_fp32") in args.skip or progress.over(name):
            return None
        print(title, flush=True)
        t0 = time.perf_counter()
        try:
            result = work()
            if result is not None:
                report[name] = result
            return result
        except Exception as e:
            report[name] = {"error": error_line(e)}
            failed.append(f"{name}: {report[name]['error']}")
            traceback.print_exc()  # the whole story in the log; the line in the JSON
            print(f"  FAIL {report[name]['error']}", flush=True)
        finally:
            report.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
            progress.save()

    # most wanted first: the GPU path's correctness (bf16), the training run's tokens/s and MFU, kernel
    # speed; then the exact fp32 checks (their FMA-loop kernels are slow to compile) and torch.compile
    half = torch.float16 if args.dry_run else torch.bfloat16    # the interpreter has no bf16 arithmetic
    section("checks", f"checks ({str(half)[6:]}): Triton ops vs torch paths",
            lambda: run_checks(device, args.dry_run, half, progress))
    row = section("train", "train: 3 KDA : 1 MLA",
                  lambda: run_train(device, args.dry_run, 3 if args.dry_run else args.train_steps))
    if row is not None and not row["finite"]:
        failed.append("train: non-finite loss")
    if not args.dry_run:
        rows = section("kernels", "kernels: forward+backward ms (bf16)", lambda: run_kernels(device, progress))
        failed += [f"{r['op']} T={r['T']}: {r['error']}" for r in rows or [] if "error" in r]
    section("checks_fp32", "checks (float32): Triton ops vs torch paths",
            lambda: run_checks(device, args.dry_run, torch.float32, progress))
    failed += [f"{r['name']} {r['dtype']}" for r in report.get("checks", []) if r["ok"] is False]
    rows = section("compile", "compile: torch.compile(fullgraph=True) vs eager, triton backend",
                   lambda: run_compile(device, args.dry_run, progress))
    failed += [f"compile {r['family']}" + (f": {r['error']}" if "error" in r else "") for r in rows or []
               if not r["ok"]]
    report["failed"] = failed
    report["ok"] = not failed and not progress.skipped
    try:
        progress.save(strict=True)
    except DataError as e:  # the report still reaches the terminal
        print(json.dumps(report, indent=2))
        print(f"error: {e}; the report is printed above", file=sys.stderr)
        return 2
    print(f"wrote {args.out} in {report['wall_s']:.0f} s: " + ("FAILED: " + "; ".join(failed) if failed else
                                                              "all checks passed" if not progress.skipped else
                                                              "no check failed"))
    if progress.skipped:
        print(f"INCOMPLETE: over the {args.budget:g} s budget (--budget), skipped: " + "; ".join(progress.skipped))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
