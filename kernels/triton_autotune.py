"""Triton's autotuner, with the configs of a new tuning key compiled side by side.

triton.autotune compiles each config the first time it benchmarks it, one after another in the calling
thread. For sm_90 our kernels take seconds to tens of seconds each to compile (ptxas; bench/compile_sm90.py
prints the time of every config) and have 4 to 24 configs, so every new shape waited minutes before its
first launch. `autotune` returns triton's Autotuner whose first launch at a tuning key compiles all the
configs it will try at once in a thread pool (triton.AsyncCompileMode; the compiler's passes and ptxas run
outside the GIL), waits for them, and then lets the autotuner benchmark and pick as before: the same
kernels and the same choice, only compiled in parallel. A config that does not compile is left to the
autotuner, which skips it as before. HYBRID_COMPILE_THREADS sets the pool's size (default: every core).
`choices()` reports, for every kernel made here, the config chosen at each tuning key and the seconds its
first launch there took (compiles and benchmarking): bench/gpu_check.py writes it into its report.
"""
import concurrent.futures
import functools
import os
import time

import triton

_pool = None
_tuners = []  # (kernel name, its Autotuner, {tuning key: seconds of its first launch}), for choices()


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """triton.autotune(configs, key, prune_configs_by, **kwargs), compiling a new tuning key's configs in
    parallel. A launch with exact fp32 dots (a PRECISION or DOT_PREC constexpr of "ieee": the fp32 inputs of
    tests and checks) runs the first config, untuned: those dots are FMA loops whose larger tiles spill
    kilobytes per thread and take ptxas up to a minute or more each, for a path that is there to be exact,
    not fast. So every list of configs starts with the one that spills least in fp32 (compile_sm90.py)."""
    own = (prune_configs_by or {}).get("early_config_prune")

    def prune(configs, named_args, **launch):
        if exact_fp32({**named_args, **launch}):
            return configs[:1]
        return own(configs, named_args, **launch) if own else configs

    def decorator(fn):
        tuner = triton.autotune(configs, key=key, prune_configs_by={**(prune_configs_by or {}),
                                                                    "early_config_prune": prune}, **kwargs)(fn)
        seconds = {}
        tuner.run = functools.partial(_run, tuner, tuner.run, seconds)
        _tuners.append((getattr(fn, "__name__", str(fn)), tuner, seconds))
        return tuner
    return decorator


def exact_fp32(args):
    """Whether a launch's arguments (by name) ask for exact fp32 dots."""
    return "ieee" in (args.get("PRECISION"), args.get("DOT_PREC"))


def tuning_key(tuner, args, kwargs):
    """What triton's Autotuner caches its choice under: the key arguments' values and every tensor's dtype."""
    named = {k: v for k, v in {**dict(zip(tuner.arg_names, args)), **kwargs}.items() if k in tuner.arg_names}
    return tuple([named[k] for k in tuner.keys if k in named]
                 + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])


def compile_configs(tuner, args, kwargs):
    """Compile every config the autotuner would try for this launch, in the pool, and wait for them. Any
    failure is left to the autotuner's own run (a config that does not compile, another AsyncCompileMode
    already active, a triton without AsyncCompileMode or with another one): the launch then compiles as
    triton does without this."""
    launch = {k: v for k, v in kwargs.items() if k != "warmup"}
    pool = _executor()
    if not hasattr(triton, "AsyncCompileMode"):   # an older triton: its autotuner compiles one by one, as ever
        return
    try:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            tuner.warmup(*args, **launch)
    except Exception:  # noqa: BLE001 -- the autotuner's run below meets any real error again, and reports it
        pass


def _run(tuner, run, seconds, *args, **kwargs):
    """The autotuner's run, after compiling the configs of a tuning key it has not seen; the first launch at
    a key (compiles, benchmarking) is timed into `seconds`."""
    if len(tuner.configs) <= 1:
        return run(*args, **kwargs)
    key = tuning_key(tuner, args, kwargs)
    if key in seconds:
        return run(*args, **kwargs)
    t0 = time.perf_counter()
    seconds[key] = None                           # seen: a launch that raises is not compiled again
    compile_configs(tuner, args, kwargs)
    out = run(*args, **kwargs)
    seconds[key] = round(time.perf_counter() - t0, 2)
    return out


def choices():
    """{kernel: [{"key", "config", "s"}]}: for every autotuned kernel made here that has run, the config its
    autotuner chose at each tuning key and the seconds the first launch there took (None: it raised)."""
    report = {}
    for name, tuner, seconds in _tuners:
        chosen = getattr(tuner, "cache", {})
        rows = [{"key": repr(key), "config": str(chosen[key]) if key in chosen else None, "s": s}
                for key, s in seconds.items()]
        if rows:
            report.setdefault(name, []).extend(rows)
    return report


def compile_threads():
    """The pool's size: HYBRID_COMPILE_THREADS, or every core."""
    value = os.environ.get("HYBRID_COMPILE_THREADS", "")
    if value and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"HYBRID_COMPILE_THREADS must be a positive integer (threads compiling Triton "
                         f"kernels), got {value!r}")
    return int(value) if value else os.cpu_count() or 1


def _executor():
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(compile_threads(), thread_name_prefix="triton-compile")
    return _pool
