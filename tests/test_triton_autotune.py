"""kernels.triton_autotune: the first launch at a tuning key compiles every config in the thread pool, and the
autotuner then benchmarks and launches the kernels compiled there. Checked without a GPU: a stand-in driver
says sm_90, and triton's compiler (with its ptxas) runs for real; nothing is launched."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import json, sys, threading
    import torch, triton, triton.compiler, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    sys.path.insert(0, sys.argv[1])

    compiled, benched = [], []
    class StandIn:  # what the JIT asks of a driver before it launches
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_benchmarker(self):
            def bench(fn, quantiles):   # the launch inside is a warmup (the kwarg passes through): no kernel runs
                benched.append(1)
                try:
                    fn()
                except Exception:
                    return [float("inf")] * 3
                return [1.0, 1.0, 1.0]
            return bench
    driver.set_active(StandIn())
    compile = triton.compiler.compile
    def recording_compile(src, *args, **kwargs):
        compiled.append((src.constants, threading.current_thread().name))
        return compile(src, *args, **kwargs)
    triton.compiler.compile = recording_compile

    from kernels.triton_autotune import autotune
    @autotune([triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 2), (128, 4), (24, 4), (256, 8))],
              key=["n"])
    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)      # BLOCK 24: not a power of two, does not compile
        tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)

    x, y = torch.zeros(4096), torch.zeros(4096)
    out = {}
    for step, n in (("first", 1000), ("same key", 1000), ("new key", 4096)):
        compiled.clear(); benched.clear()
        double.run(x, y, n, grid=(1,), warmup=True)           # warmup: everything a launch does but the launch
        out[step] = {"compiled": sorted([list(c.values())[0], t.split("_")[0]] for c, t in compiled),
                     "benched": len(benched), "best": double.best_config.kwargs["BLOCK"]}

    @autotune([triton.Config({"BLOCK": b}) for b in (64, 128, 256)], key=["n"])
    @triton.jit
    def copy(x, y, n, PRECISION: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)
    for precision, n in (("ieee", 1000), ("tf32", 1001)):   # ours pick tf32 for bf16 tensors: a new tuning key
        compiled.clear(); benched.clear()
        copy.run(x, y, n, grid=(1,), warmup=True, PRECISION=precision)
        out[precision] = {"compiled": sorted(list(c.values())[1] for c, t in compiled), "benched": len(benched)}
    from kernels.triton_autotune import choices
    out["choices"] = choices()
    print(json.dumps(out))
''')


def test_first_launch_compiles_every_config_in_the_pool(tmp_path):
    """...and a launch with exact fp32 dots takes the first config without tuning."""
    import json
    script = tmp_path / "autotune_check.py"          # triton.jit reads the kernel's source from a file
    script.write_text(SCRIPT)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "HYBRID_COMPILE_THREADS": "2",
           "TRITON_CACHE_DIR": str(tmp_path / "triton_cache")}      # compiled here, not found in a cache
    res = subprocess.run([sys.executable, str(script), ROOT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    pool = [[b, "triton-compile"] for b in (24, 64, 128, 256)]
    # every config compiled once, all in the pool; the one that fails is compiled again by the autotuner
    # (in the calling thread), which skips it as triton does; the launch finds its kernel compiled
    assert out["first"]["compiled"] == sorted(pool + [[24, "MainThread"]]), out
    assert out["first"]["benched"] == 4 and out["first"]["best"] == 64, out
    # the same key again: nothing compiled, nothing benchmarked (triton's own choice cache)
    assert out["same key"] == {"compiled": [], "benched": 0, "best": 64}, out
    # a new key (n divisible by 16: a new specialization) compiles the configs in the pool again
    assert out["new key"]["compiled"] == sorted(pool + [[24, "MainThread"]]), out
    # exact fp32 dots: the first config only (triton 3.9 does not time a lone config; 3.6 times it once)
    assert out["ieee"]["compiled"] == [64] and out["ieee"]["benched"] <= 1, out
    assert out["tf32"] == {"compiled": [64, 128, 256], "benched": 3}, out
    # choices(): per kernel, each tuning key's chosen config and the seconds of its first launch
    double, copy = out["choices"]["double"], out["choices"]["copy"]
    assert [r["key"] for r in double] == ["(1000, 'torch.float32', 'torch.float32')",
                                          "(4096, 'torch.float32', 'torch.float32')"], out
    assert all(r["config"].startswith("BLOCK: 64") and r["s"] > 0 for r in double + copy) and len(copy) == 2, out


def test_bad_thread_count_is_one_clear_error():
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "HYBRID_COMPILE_THREADS": "many"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kernels import triton_autotune as t\n"
            "try:\n    t._executor()\nexcept ValueError as e:\n    print(e)")
    res = subprocess.run([sys.executable, "-c", code, ROOT], env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == ("HYBRID_COMPILE_THREADS must be a positive integer (threads compiling Triton "
                                  "kernels), got 'many'"), res.stdout + res.stderr
