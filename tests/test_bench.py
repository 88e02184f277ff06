"""The bench/ drivers run end to end on tiny shapes (their figures are printed, not asserted)."""
import argparse
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_nanogpt  # noqa: E402


def test_nanogpt_baseline_learns_and_bench_reports_every_kind():
    torch.manual_seed(0)
    model = bench_nanogpt.NanoGPT(vocab=17, d=32, n_layer=1, n_heads=2, max_len=16)
    opt = bench_nanogpt.nano_optimizer(model, 1e-2)
    x = torch.randint(0, 17, (4, 16))
    losses = [bench_nanogpt.train_step(model, opt, x, x.roll(-1, 1)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    rates = bench_nanogpt.main(["--kinds", "attn", "attn_nope", "kda", "--d", "32", "--heads", "2", "--layers", "1",
                                "--T", "16", "--B", "2", "--steps", "1", "--repeat", "1", "--vocab", "17"])
    assert set(rates) == {"nanogpt", "attn", "attn_nope", "kda"} and all(r > 0 for r in rates.values())


def test_median_interval_is_the_binomial_order_statistics():
    """The interval the benches print around a ratio: x_(k), x_(n+1-k) with the largest k whose coverage
    1 - 2 P(Bin(n, 1/2) < k) is >= 95% (n = 15: k = 4, 1 - 2 * 576 / 2**15); the range below 6 values."""
    med, low, high, cover = bench_nanogpt.median_interval([15 - i for i in range(15)])   # 15 .. 1, unsorted
    assert (med, low, high) == (8, 4, 12) and cover == pytest.approx(1 - 2 * 576 / 2 ** 15)
    assert bench_nanogpt.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0, 1 - 2 / 2 ** 5)
    assert bench_nanogpt.median_interval(range(100))[1:3] == (39, 60)                   # x_(40), x_(61)
    assert bench_nanogpt.ratio_text([2.0, 3.0, 4.0], [1.0, 1.0, 2.0], "b") == " 2.00x b [2.00, 3.00]"


def test_bench_model_counts_activations_not_parameters():
    """What a training step keeps for backward is affine in the batch: the activations grow with it and
    a constant part (the concatenated q|k|v and gate|up weights, built per step) does not; parameters,
    which would add all their bytes to that constant, are not counted."""
    import bench_model
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict({"vocab_size": 16, "d_model": 16, "n_layer": 2, "pattern": ["a", "k"],
                                       "layers": {"a": {"kind": "attn", "n_heads": 2}, "k": {"kind": "kda", "n_heads": 2}}}))
    two, four, six = (bench_model.saved_activation_bytes(model, torch.randint(0, 16, (b, 8))) for b in (2, 4, 6))
    assert four - two == six - four > 0
    constant = 2 * two - four
    assert 0 < constant < sum(p.nbytes for p in model.parameters())


def test_bench_layers_times_every_part_and_the_op_each_layer_calls(capsys):
    """bench_layers.py times each kind's layer, the kernels op it calls (on the inputs layer 0 gave it) and
    the baseline's parts; a bad kind is one line."""
    import bench_layers
    from model import GPT
    ms = bench_layers.main(["--kinds", "attn", "kda", "linear", "--d", "32", "--heads", "2", "--layers", "1",
                            "--T", "16", "--B", "2", "--steps", "1", "--repeat", "1", "--vocab", "17"])
    assert set(ms) == {"nanoGPT attention", "nanoGPT MLP (4d GELU)", "nanoGPT LayerNorm", "attn layer",
                       "attn: its attention op", "kda layer", "kda: its delta_rule op", "linear layer",
                       "linear: its linear_attention op", "SwiGLU MLP", "RMSNorm"}
    assert all(t > 0 for t in ms.values()) and "kda layer less the op" in capsys.readouterr().out
    args = type("Shape", (), {"d": 32, "heads": 2, "layers": 1, "T": 16, "B": 2, "vocab": 17})
    name, op, op_args, kwargs = bench_layers.first_op(GPT(bench_layers.hybrid_config("kda", args)), args)
    assert name == "delta_rule" and op is bench_layers.kernels.delta_rule and op_args[0].shape == (2, 16, 2, 16)
    assert op(*op_args, **kwargs)[0].shape == (2, 16, 2, 16)
    assert bench_layers.main(["--kinds", "foo"]) == 2
    assert "unknown kind 'foo'" in capsys.readouterr().err


def test_bench_revisions_steps_both_trees_and_refuses_unknown_revisions():
    """bench_revisions.py builds the same model in a worker per tree (HEAD from git archive, and this
    working tree), interleaves their steps and reports HEAD/now; an unknown revision is one clear line."""
    import bench_revisions
    ratios = bench_revisions.main(["--against", "HEAD", "--kinds", "attn", "kda", "--d", "16", "--heads", "2",
                                   "--layers", "1", "--T", "16", "--B", "2", "--steps", "1", "--repeat", "1",
                                   "--vocab", "17"])
    assert set(ratios) == {"attn", "kda"} and all(0 < r < float("inf") for r in ratios.values())
    with pytest.raises(SystemExit, match="git does not know revision 'no-such-rev'"):
        bench_revisions.main(["--against", "no-such-rev"])
    with pytest.raises(SystemExit, match="unknown kind 'foo'"):
        bench_revisions.main(["--against", "HEAD", "--kinds", "foo"])


def run_gpu_check(tmp_path, *args):
    import json
    import gpu_check
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--dry-run", "--out", str(out), *args])
    return rc, json.loads(out.read_text())


def test_gpu_check_fails_loudly_on_a_wrong_kernel(tmp_path, monkeypatch):
    """Triton ops that disagree with their torch paths, or raise: exit status 1, the JSON names each,
    and the other checks and the training still run. (The Triton functions are replaced by torch ones
    here, some of them wrong, so no interpreter runs.)"""
    import kernels.triton_attention as ta
    import kernels.triton_delta_rule as td
    import kernels.triton_paged as tp
    import kernels.triton_sparse as ts
    import kernels.torch_sparse as sp
    from kernels.torch_attention import attention_torch
    from kernels.torch_delta_rule import delta_rule_step_torch, delta_rule_torch

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")
    monkeypatch.setattr(ta, "attention_triton", lambda q, k, v, **kw: attention_torch(q, k, v, **kw) * 1.1)
    monkeypatch.setattr(td, "delta_rule_triton", delta_rule_torch)
    monkeypatch.setattr(td, "delta_rule_step_triton", delta_rule_step_torch)
    monkeypatch.setattr(ts, "sparse_mla_attention_triton", sp.sparse_mla_attention_torch)
    monkeypatch.setattr(ts, "index_topk_triton", lambda *a: sp.index_topk_torch(*a).flip(-1))   # worst first
    monkeypatch.setattr(ts, "block_sparse_attention_triton", sp.block_sparse_attention_torch)
    monkeypatch.setattr(tp, "paged_decode_triton", broken)
    rc, report = run_gpu_check(tmp_path, "--skip", "compile")
    assert rc == 1 and report["ok"] is False
    wrong = ("attention", "index_topk", "paged_decode")
    assert all(r["ok"] != r["name"].startswith(wrong) for r in report["checks"]) and len(report["checks"]) == 34
    assert "attention causal float32" in report["failed"] and "index_topk (dsa) float16" in report["failed"]
    assert len(report["failed"]) == 2 * (5 + 1 + 2)
    paged = [r for r in report["checks"] if r["name"].startswith("paged_decode")]
    assert all(r["error"] == "RuntimeError: out of resources: shared memory" for r in paged)
    assert report["train"]["finite"] and report["train"]["params"] > 0


def test_gpu_check_saves_every_row_and_skips_loudly_past_its_budget(tmp_path, monkeypatch):
    """A run cut short keeps what it measured: the JSON is rewritten after every check row. Past --budget
    (here: a clock that reads the number of rows done), the remaining checks and sections are skipped,
    named in the JSON and the last line, and the run exits 1 though no kernel failed."""
    import json
    import gpu_check
    out = tmp_path / "check.json"
    seen = []

    def fake_compare(name, fn, inputs, dtype, limit, grad):   # no kernel runs: the driver's logic only
        seen.append(len(json.loads(out.read_text())["checks"]) if out.exists() else 0)
        return {"name": name, "dtype": str(dtype).replace("torch.", ""), "max_rel_err": 0.0, "limit": limit,
                "ok": True}
    monkeypatch.setattr(gpu_check, "_compare", fake_compare)
    monkeypatch.setattr(gpu_check.Progress, "elapsed", lambda self: len(self.report.get("checks", [])))
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--budget", "4.5"])
    report = json.loads(out.read_text())
    assert seen == [0, 1, 2, 3, 4]                            # each row on disk before the next one ran
    assert rc == 1 and report["ok"] is False and report["failed"] == []
    ran = [r for r in report["checks"] if "skipped" not in r]
    assert len(ran) == 5 and len(report["checks"]) == 17 and all(r["ok"] and r["s"] >= 0 for r in ran)
    assert report["skipped"][0] == "check delta_rule kda float16" and len(report["skipped"]) == 12 + 3
    assert report["skipped"][-3:] == ["train", "checks_fp32", "compile"] and "train" not in report


def test_gpu_check_compile_fails_on_a_graph_break(tmp_path, monkeypatch):
    """A kernel call that breaks the graph fails the compile section by name (fullgraph=True), with
    torch's error line in the JSON."""
    import kernels.triton_delta_rule as td
    from kernels.torch_delta_rule import delta_rule_torch

    def breaks(*args, **kwargs):
        torch._dynamo.graph_break()
        return delta_rule_torch(*args, **kwargs)
    monkeypatch.setattr(td, "delta_rule_triton", breaks)
    rc, report = run_gpu_check(tmp_path, "--skip", "checks", "train")
    assert rc == 1 and report["failed"][0].startswith("compile kda+mla: ")
    assert "graph" in report["compile"][0]["error"].lower() and report["compile"][0]["ok"] is False


@pytest.mark.slow
def test_gpu_check_dry_run_passes(tmp_path):
    """The whole driver on CPU under the Triton interpreter (about 2 minutes on 1 thread)."""
    rc, report = run_gpu_check(tmp_path)
    assert rc == 0 and report["ok"] and len(report["checks"]) == 34
    assert [r["family"] for r in report["compile"]] == ["kda+mla"] and report["compile"][0]["max_rel_err"] < 1e-5


def test_qwen3next_bench_builds_the_same_model_and_runs():
    """Both sides have the same parameter count at the benchmark's layout (the converter's config), and
    the benchmark trains and decodes on a tiny shape."""
    import bench_qwen3next
    out = bench_qwen3next.main(["--d", "64", "--heads", "1", "--kv_heads", "1", "--hidden", "32", "--T", "16",
                                "--B", "1", "--steps", "1", "--repeat", "1", "--prompt", "4", "--new", "2"])
    assert all(v > 0 for v in out.values())
    ns = type("A", (), dict(vocab=257, d=64, layers=4, heads=1, kv_heads=1, hidden=32))
    mc = bench_qwen3next.our_config(ns)
    ours, theirs = bench_qwen3next.GPT(mc), bench_qwen3next.their_model(mc)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.slow
def test_compile_bench_runs():
    import bench_compile
    out = bench_compile.main(["--models", "linear", "--d", "32", "--heads", "2", "--layers", "1", "--T", "16",
                              "--B", "2", "--steps", "1", "--repeat", "1", "--vocab", "17"])
    assert out["linear"]["graph_breaks"] == 0 and out["linear"]["compiled"] > 0


@pytest.mark.slow
def test_nanogpt_bench_compiles_every_model(capsys):
    """--compile: the baseline and each kind train compiled, side by side, and say how long each compile took."""
    rates = bench_nanogpt.main(["--kinds", "attn", "--d", "32", "--heads", "2", "--layers", "1", "--T", "16",
                                "--B", "2", "--steps", "1", "--repeat", "1", "--vocab", "17", "--compile"])
    out = capsys.readouterr().out
    assert set(rates) == {"nanogpt", "attn"} and all(r > 0 for r in rates.values())
    assert "nanogpt: compiled in" in out and "attn: compiled in" in out and "torch.compile (inductor)" in out


def test_compile_sm90_compiles_recorded_launches_and_fails_loudly(tmp_path):
    """Launches recorded under the interpreter compile for sm_90 without a GPU (ptxas ships with triton):
    the paged decode kernel with and without sinks (with sinks it read a plain-float global, which only
    the interpreter accepts), each with its shared memory and registers; a launch whose block size
    tl.arange refuses makes the run exit 1 with its error, after the others."""
    import json
    import subprocess
    import compile_sm90
    import kernels
    torch.manual_seed(0)
    H, Hkv, D, bs = 2, 1, 16, 4
    table, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([7, 3])
    pools = [torch.randn(4, bs, Hkv, D) for _ in range(2)]
    launches = {}
    with compile_sm90.recording(launches):
        for sinks in (None, torch.randn(H)):
            kernels.paged_attention(torch.randn(2, 1, H, D), *pools, table, lens, sinks=sinks, backend="triton")
    launches = list(launches.values())
    assert [e["kernel"] for e in launches] == ["_paged_decode_kernel"] * 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(compile_sm90.__file__), "compile_sm90.py")

    def run(entries):
        path = tmp_path / "launches.json"
        path.write_text(json.dumps(entries))
        res = subprocess.run([sys.executable, script, "--launches", str(path), "--out", str(tmp_path / "rows.json")],
                             env=env, capture_output=True, text=True, timeout=600)
        return res.returncode, res.stdout, json.loads((tmp_path / "rows.json").read_text())
    rc, out, rows = run(launches)
    assert rc == 0, out
    assert [r["constants"]["HAS_SINKS"] for r in rows] == [False, True]
    assert all(0 < r["shared"] <= compile_sm90.SHARED_LIMIT and "REG:" in r["resources"] for r in rows), rows
    broken = json.loads(json.dumps(launches[1]))
    broken["args"]["BLOCK_DK"] = 24                       # tl.arange needs a power of two
    rc, out, rows = run([broken, launches[0]])
    assert rc == 1 and "error" in rows[0] and "shared" in rows[1], out
    assert "FAILED: _paged_decode_kernel fp32" in out and "power of 2" in out, out


def test_gpu_check_kernel_benchmarks_keep_each_measurement(tmp_path, monkeypatch):
    """The kernel benchmarks (run for real at tiny shapes here, with a stand-in clock): each measurement is
    on disk before the next one starts, so a run cut short says where it was; a baseline that is missing
    (flash-attn) or raises (a stand-in flash-linear-attention) is a note in its cell, not a failure; our
    own op raising marks the row, which fails the run."""
    import json
    import types
    import gpu_check
    import kernels.triton_delta_rule as td
    out = tmp_path / "k.json"
    progress = gpu_check.Progress({}, str(out))
    cells = []

    def fake_time_ms(fn, inputs):
        cells.append(sum(k.endswith("_ms") for r in json.loads(out.read_text())["kernels"] for k in r)
                     if out.exists() else 0)
        fn(*inputs)
        return 1.0
    monkeypatch.setattr(gpu_check, "time_ms", fake_time_ms)

    def raises(message):
        def fn(*args, **kwargs):
            raise RuntimeError(message)
        return fn
    monkeypatch.setattr(td, "delta_rule_triton", raises("bad"))
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", types.SimpleNamespace(chunk_kda=raises("no sm_90 here")))
    rows = gpu_check.run_kernels(torch.device("cpu"), progress, B=1, H=2, D=16, seqlens=(32,), sparse=False)
    assert cells == [0, 1, 2, 3, 4, 5]                 # 3 cells per row, each saved before the next ran
    attn, delta = json.loads(out.read_text())["kernels"]
    assert attn["triton_ms"] == attn["sdpa_flash_ms"] == 1.0 and attn["flash_attn_ms"] == "not installed"
    assert delta["triton_ms"] == delta["error"] == "failed: RuntimeError: bad" and delta["torch_ms"] == 1.0
    assert delta["fla_ms"] == "failed: RuntimeError: no sm_90 here" and "error" not in attn
    assert rows == [attn, delta] and all(r[k] >= 0 for r in rows for k in r if k.endswith("_s"))


def test_gpu_check_stops_a_cell_past_its_limit_and_goes_on(tmp_path, monkeypatch):
    """A benchmark cell that does not finish (a stand-in that loops, as an autotuner compiling for minutes
    does) is stopped at --cell-limit and recorded as timed out; the next cells still run. Ours timing out
    marks the row (the run fails); a baseline timing out is a note in its cell."""
    import json
    import gpu_check
    out = tmp_path / "k.json"
    progress = gpu_check.Progress({}, str(out), cell_limit=0.3)
    calls = []

    def fake_time_ms(fn, inputs):
        calls.append(len(calls))
        if len(calls) == 1:                          # ours: as the parallel compile, swallows Exceptions
            try:
                while True:
                    time.sleep(0.01)
            except Exception:                        # noqa: BLE001 -- what the stop must get through
                pass
        if len(calls) in (1, 2):                     # attention: ours, then SDPA do not finish in time
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 3:
                time.sleep(0.01)
        return 1.0
    monkeypatch.setattr(gpu_check, "time_ms", fake_time_ms)
    t0 = time.perf_counter()
    rows = gpu_check.run_kernels(torch.device("cpu"), progress, B=1, H=2, D=16, seqlens=(32,), sparse=False)
    assert time.perf_counter() - t0 < 3
    attn, delta = json.loads(out.read_text())["kernels"]
    assert attn["triton_ms"] == attn["error"] == "timed out after 0.3 s (--cell-limit)"
    assert attn["sdpa_flash_ms"] == "timed out after 0.3 s (--cell-limit)" and 0.3 <= attn["sdpa_flash_s"] < 2
    assert delta["triton_ms"] == delta["torch_ms"] == 1.0 and "error" not in delta
    assert attn["flash_attn_ms"] == delta["fla_ms"] == 1.0 and len(calls) == 6 and rows == [attn, delta]
    assert gpu_check.parse_args(["--cell-limit", "60"]).cell_limit == 60
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--cell-limit", "0"])


def test_bench_attention_table_runs_every_case_and_checks_triton(capsys):
    """bench_attention.py's GPU table, run on CPU tensors (Triton interpreter, fp32, a wall-clock timer in place
    of triton's do_bench): every case gets its contenders, the triton row its output and gradient errors."""
    import bench_attention
    args = bench_attention.parse_args(["--hdims", "16", "--seqlens", "24", "--tokens", "48", "--model-dim", "32",
                                       "--kv-heads", "1", "--windows", "8", "32", "--dtype", "fp32"])

    def timer(fn, grad_to_none):
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    rows = bench_attention.run_table(args, "cpu", timer)
    assert [(r["case"], r["impl"]) for r in rows] == [("causal", "triton"), ("causal", "sdpa"), ("window 8", "triton"),
                                                      ("window 8", "sdpa(mask)"), ("sinks", "triton"), ("sinks", "sdpa")]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fb_ms"] > 0
        if r["impl"] == "triton":
            assert float(r["diff_o"]) < 1e-4 and float(r["diff_g"]) < 1e-4, r
    assert "window 8" in capsys.readouterr().out


def test_bench_linear_width_runs(capsys):
    """bench_linear_width.py prints a row per (rows, width) with F.linear's and model.linear's rates."""
    import bench_linear_width
    bench_linear_width.main(["--rows", "1024", "--k", "32", "--widths", "257", "--repeat", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1024")]
    assert len(rows) == 1 and rows[0].split()[1] == "257"


def test_qwen3next_shape_config_is_the_benchmark_model():
    """bench/qwen3next_shape.yaml (for bench_revisions.py) is the model bench_qwen3next.py builds by default."""
    import bench_qwen3next
    from config import load_config
    cfg = load_config(os.path.join(os.path.dirname(bench_qwen3next.__file__), "qwen3next_shape.yaml"))
    args = argparse.Namespace(d=256, layers=4, heads=4, kv_heads=2, hidden=683, vocab=257)  # its defaults
    assert cfg.model == bench_qwen3next.our_config(args)
    assert (cfg.train.batch_size, cfg.train.seq_len) == (8, 256)
