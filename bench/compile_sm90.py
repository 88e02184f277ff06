"""Compile every Triton kernel for sm_90 (H100/H200) without a GPU, at every config its autotuner would try.

Catches what the interpreter lets through (types, layouts, shared memory, register spills) before a GPU
is lent. Two steps:
1. record: a subprocess under TRITON_INTERPRET=1 runs bench/gpu_check.py's op checks (every Triton op,
   forward and backward: attention with GQA, windows, sinks and packed documents, the delta rule with
   both gates, its decode step, DSA's sparse MLA and indexer, NSA's selection, paged decode) at the GPU
   run's head widths and a short length, in fp32 and fp16 (the interpreter has no bf16), plus forward and
   backward of gpu_check's 3 KDA : 1 MLA training model (4 layers of it, under autocast as it trains), and
   records each kernel launch's argument types and compile-time constants;
2. compile: each recorded launch for GPUTarget("cuda", 90) with the launch's constants and, for an
   autotuned kernel, each of its configs (fp16 launches as bf16, the GPU path's dtype; where the host
   code picks a block size by TRITON_INTERPRET, its GPU choice: gpu_meta); prints shared memory,
   registers and spills (cuobjdump, shipped with triton) per config.

Exit 1 when a kernel fails to compile at some config, or no config of a launch fits an H100/H200 block's
227 KB of shared memory (a config over it alone is only reported: the autotuner skips it on the GPU).

    python bench/compile_sm90.py --jobs 2 --out sm90.json   # every row also as JSON; time: docs/speed.md
    python bench/compile_sm90.py --only attn        # kernels whose name contains a string
"""
import argparse
import concurrent.futures
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

SHARED_LIMIT = 232448                       # bytes: the opt-in shared memory of one sm_90 block (227 KB)
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
          "bool": "i1", "int8": "i8", "uint8": "u8"}


# ------------------------------------------------------------------ 1. record (under the interpreter)

def encode(value):
    """An argument as JSON: a tensor by its pointer type, a plain value as itself."""
    import torch
    if isinstance(value, torch.Tensor):
        return {"ptr": DTYPES[str(value.dtype).replace("torch.", "")]}
    value = getattr(value, "value", value)             # tl.constexpr
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@contextlib.contextmanager
def recording(launches):
    """Under TRITON_INTERPRET=1: every kernel launch in the block adds {module, kernel, options, args} to the
    dict `launches` (keyed by its JSON, so repeats are kept once)."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "options": options,
                 "args": {k: encode(v) for k, v in named.items()}}
        launches.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def record(out_path):
    import torch
    import gpu_check
    launches = {}
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    with recording(launches):
        for dtype in (torch.float32, torch.float16):
            limit = gpu_check.LIMITS[str(dtype).replace("torch.", "")]
            rows = (gpu_check.dense_checks(cpu, False, dtype, limit, short=True)
                    + gpu_check.sparse_checks(cpu, False, dtype, limit, short=True))
            for row in rows:
                if row.get("error"):
                    print(f"record: {row['name']} ({dtype}): {row['error']}", file=sys.stderr)
        train_model_launches()
    with open(out_path, "w") as f:
        json.dump(list(launches.values()), f)


def train_model_launches():
    """gpu_check's training model (its first 4 layers: 3 KDA, 1 MLA), forward and backward as gpu_check and
    train.py run it: fp32 weights under autocast (fp16 here, bf16 there). Autocast leaves some tensors fp32
    (MLA's normed latent); a launch that mixed dtypes in a dot failed to compile on the first GPU."""
    import dataclasses
    import torch
    import gpu_check
    from model import GPT
    cfg = dataclasses.replace(gpu_check.train_model_config(False), n_layer=4, vocab_size=256)
    model = GPT(cfg)
    x = torch.randint(0, 256, (1, 65))
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()


# ------------------------------------------------------------------ 2. compile for sm_90

def gpu_meta(entry):
    """What the host code picks differently on a GPU for a kernel that is not autotuned: the recorded
    interpreter choice replaced by the GPU's (the kernels' own functions say both)."""
    from kernels import triton_attention, triton_delta_rule, triton_sparse
    args = entry["args"]
    if entry["kernel"] == "_chunk_bwd_main_kernel":
        return {"BK": triton_delta_rule.bwd_main_split_width(args["K"], interpret=False)}
    if entry["kernel"] == "_bwd_delta_kernel":
        return triton_attention.bwd_delta_meta(interpret=False)
    if entry["kernel"] == "_index_topk_kernel":
        return triton_sparse.index_topk_meta(args["KP"], interpret=False)
    return {}


def on_gpu(entry):
    """The recorded launch as the GPU would make it (gpu_meta's choices; num_warps/num_stages as options)."""
    meta = gpu_meta(entry)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    return {**entry, "args": {**entry["args"], **meta}, "options": {**entry["options"], **options}}


def is_half(entry):
    return any(isinstance(v, dict) and v["ptr"] == "fp16" for v in entry["args"].values())


def fits(row):
    """Compiled, and within one block's shared memory."""
    return "error" not in row and row["shared"] <= SHARED_LIMIT


def kernel_and_configs(entry):
    """The JITFunction of a recorded launch and the configs its autotuner tries ([None] if it has none):
    all of them, or the first for exact fp32 dots (kernels/triton_autotune.py)."""
    import triton
    from kernels.triton_autotune import exact_fp32
    obj = getattr(importlib.import_module(entry["module"]), entry["kernel"])
    if isinstance(obj, triton.runtime.Autotuner):
        return obj.fn, obj.configs[:1] if exact_fp32(entry["args"]) else obj.configs
    return obj, [None]


def signature_of(fn, entry, config):
    """ASTSource's signature and constants: the launch's arguments, the config's meta-parameters over them
    (fp16 pointers as bf16)."""
    args, half = entry["args"], is_half(entry)
    meta = dict(config.kwargs) if config is not None else {}
    signature, constants = {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if name in meta:
            value = meta[name]
        elif name in args:
            value = args[name]
        elif param.has_default:
            value = param.default
        else:
            raise KeyError(f"argument {name} was not recorded")
        if param.is_constexpr or value is None:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, dict):
            signature[name] = "*" + ("bf16" if half and value["ptr"] == "fp16" else value["ptr"])
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        else:
            signature[name] = "fp32"
    return signature, constants


def resources(cubin):
    """'REG:n STACK:m' from cuobjdump, or '' where triton ships no cuobjdump."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return " ".join(w for line in out.splitlines() if "REG" in line for w in line.split()
                    if w.startswith(("REG", "STACK")))


def compile_one(entry, i):
    """Compile a recorded launch at its kernel's i-th config: a row with shared memory and registers, or
    with the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn, configs = kernel_and_configs(entry)
    config = configs[i]
    meta = config.kwargs if config is not None else {}
    signature, constants = signature_of(fn, entry, config)
    options = {"num_warps": 4, "num_stages": 3, **entry["options"]}
    if config is not None:
        options.update(num_warps=config.num_warps, num_stages=config.num_stages)
    row = {"kernel": entry["kernel"], "dtype": "bf16" if is_half(entry) else "fp32",
           "config": {**meta, **options},
           "constants": {p.name: entry["args"].get(p.name) for p in fn.params if p.is_constexpr and p.name not in meta}}
    t0 = time.perf_counter()
    try:
        out = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                             options=options)
    except Exception as e:  # a kernel that does not compile: its row says why, the rest still compile
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)       # ~0 when triton's cache already had it
    row["shared"] = out.metadata.shared
    row["resources"] = resources(out.asm["cubin"])
    return row


def compile_all(launches, only=None, jobs=1):
    """Every launch at every config (`jobs` processes), each distinct (kernel, signature, constants, options)
    once: launches that differ only in sizes and strides compile to the same kernel. Returns the rows and a
    line per launch that failed (a config that does not compile, or none that fits)."""
    work, done = [], set()
    for entry in map(on_gpu, launches):
        if only and only not in entry["kernel"]:
            continue
        fn, configs = kernel_and_configs(entry)
        key = (entry["kernel"], repr(signature_of(fn, entry, None)), repr(entry["options"]))
        if key not in done:
            done.add(key)
            work += [(entry, i, len(configs)) for i in range(len(configs))]
    with concurrent.futures.ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        args = [w[0] for w in work], [w[1] for w in work]
        results = pool.map(compile_one, *args) if pool else map(compile_one, *args)
        rows, failed = [], []
        for (entry, i, n), row in zip(work, results):
            launch = f"{row['kernel']} {row['dtype']} {json.dumps(row['constants'], sort_keys=True)}"
            if i == 0:
                print(launch)
                mine = []                                      # this launch's rows, one per config
            status = ("FAILED " + row["error"] if "error" in row else f"shared={row['shared']:6d} {row['resources']}"
                      + f" {row['compile_s']:5.1f} s" + ("" if fits(row) else "  (over 227 KB: skipped)"))
            print(f"    {json.dumps(row['config'], sort_keys=True):62s} {status}", flush=True)
            rows.append(row)
            mine.append(row)
            if i == n - 1 and (any("error" in r for r in mine) or not any(map(fits, mine))):
                failed.append(launch)
    return rows, failed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="compile only kernels whose name contains this")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes (ptxas uses one core each)")
    p.add_argument("--out", default=None, help="write every row (kernel, dtype, config, shared, registers) as JSON")
    p.add_argument("--launches", default=None,
                   help="keep the recorded launches in this JSON file, or read them from it if it exists")
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)     # the interpreter subprocess
    args = p.parse_args(argv)
    if args.record:
        record(args.record)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: compile_sm90: run it without TRITON_INTERPRET=1 (it starts the interpreter itself)",
              file=sys.stderr)
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.launches or os.path.join(tmp, "launches.json")
        if not os.path.exists(path):
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            if subprocess.run([sys.executable, os.path.abspath(__file__), "--record", path], env=env).returncode:
                print("error: compile_sm90: recording the launches under the interpreter failed (above)",
                      file=sys.stderr)
                return 2
        with open(path) as f:
            launches = json.load(f)
    if args.only and not any(args.only in e["kernel"] for e in launches):
        print(f"error: --only {args.only}: no recorded kernel's name contains it "
              f"({', '.join(sorted({e['kernel'] for e in launches}))})", file=sys.stderr)
        return 2
    print(f"{len(launches)} distinct launches of {len({e['kernel'] for e in launches})} kernels "
          f"({time.time() - t0:.0f} s)", flush=True)
    rows, failed = compile_all(launches, args.only, args.jobs)
    print(f"compiled {len(rows)} kernel configs for sm_90 in {time.time() - t0:.0f} s; "
          f"{sum('error' in r for r in rows)} failed, "
          f"{sum(r.get('shared', 0) > SHARED_LIMIT for r in rows)} over 227 KB of shared memory")
    for dtype in ("fp32", "bf16"):   # what one core spends compiling (0 for what triton's cache already had)
        times = sorted(r.get("compile_s", 0) for r in rows if r["dtype"] == dtype)
        if times:
            print(f"  {dtype}: {len(times)} configs, {sum(times) / 60:.1f} min of compiling on one core, "
                  f"median {times[len(times) // 2]:.1f} s, slowest {times[-1]:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
