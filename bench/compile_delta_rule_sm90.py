"""Compile every kernel of kernels/triton_delta_rule.py for sm_90 (H100/H200) without a GPU.

Catches what the interpreter lets through (types, layouts, shared memory) and prints each kernel's
register and spill (STACK bytes) use from cuobjdump. Run it WITHOUT TRITON_INTERPRET:

    python bench/compile_delta_rule_sm90.py [--dtype bf16|fp32] [--num-warps 8] [--bv 32] [--dim 128]
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.triton_delta_rule as m  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--bv", type=int, default=32)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    args = p.parse_args()
    block_k = max(16, triton.next_power_of_2(args.dim))
    constexprs = dict(H=16, K=args.dim, V=args.dim, BK=block_k, BV=args.bv,
                      DOT_PREC="ieee" if args.dtype == "fp32" else "tf32",
                      HAS_H0=True, STORE_HT=True, HAS_DHT=True, GATE_PER_HEAD=False)
    types = {n: f"*{args.dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "o_ptr", "do_ptr",
                                           "dq_ptr", "dk_ptr", "dv_ptr", "dbeta_ptr")}
    types["scale"] = "fp32"
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failed = 0
    for name in ("_chunk_cumsum_kernel", "_chunk_intra_kernel", "_chunk_solve_kernel", "_chunk_wy_kernel",
                 "_chunk_state_fwd_kernel", "_chunk_output_kernel", "_chunk_state_bwd_kernel",
                 "_chunk_bwd_main_kernel", "_chunk_bwd_intra_kernel", "_chunk_reverse_cumsum_kernel",
                 "_fused_recurrent_kernel"):
        fn = getattr(m, name).fn  # the JITFunction under the autotuner
        signature, consts = {}, {}
        for i, (arg, param) in enumerate(zip(fn.arg_names, fn.params)):
            if param.is_constexpr:
                signature[arg], consts[(i,)] = "constexpr", constexprs[arg]
            else:
                signature[arg] = types.get(arg, "*fp32" if arg.endswith("_ptr") else "i32")
        try:
            out = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                 options=dict(num_warps=args.num_warps, num_stages=2))
        except Exception as e:
            failed += 1
            print(f"{name:30s} FAILED {type(e).__name__}: {str(e)[:2000]}")
            continue
        usage = ""
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
                f.write(out.asm["cubin"])
            res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True)
            os.unlink(f.name)
            usage = " ".join(w for line in res.stdout.splitlines() if "REG" in line
                             for w in line.split() if w.startswith(("REG", "STACK")))
        print(f"{name:30s} ok  shared={out.metadata.shared:6d}  {usage}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
