"""What a user meets on the command line: one `error: ...` line and exit code 2 for bad input (nothing
written, nothing lost), README statements that hold, Ctrl-C / disk-full / truncated-checkpoint safety."""
import errno
import gc
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import cost
import evals
import plot
import sample
import train as train_mod
from config import ROOT, from_raw, load_config, split_args
from data import prepare as prepare_mod
from data.tokens import write_tokens
from model import GPT, ConfigError


def tiny_raw(out_dir, **train_kw):
    return {"model": {"vocab_size": 32, "d_model": 32, "n_layer": 1, "pattern": ["g"],
                      "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 64}},
            "data": {"kind": "mqar", "n_pairs": 4 if train_kw.get("seq_len", 32) < 512 else 8},
            "train": {"max_steps": 3, "batch_size": 4, "seq_len": 32, "warmup_steps": 1, "log_interval": 1,
                      "eval_interval": 1000, "eval_batches": 1, "ckpt_interval": 1, "out_dir": str(out_dir),
                      **train_kw}}


def write_yaml(path, raw):
    path.write_text(json.dumps(raw))  # JSON is YAML
    return str(path)


def snapshot(folder):
    """{relative path: bytes} of every file under folder (what 'nothing written or lost' compares)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def one_error_line(capsys, rc, match, code=2, stdout=""):
    """The CLI returned `code`, printed nothing on stdout (or what a started run reports: `stdout`
    a regex) and exactly one `error: ...` line on stderr."""
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if not line.startswith("train:")]  # tqdm's bar
    assert rc == code, (rc, out, err)
    assert re.fullmatch(stdout, out, re.S) if stdout else out == "", out
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


def save_ckpt(folder, raw, step=1, seed=0):
    os.makedirs(folder, exist_ok=True)
    cfg = from_raw(raw)
    torch.manual_seed(seed)
    train_mod.save_checkpoint(os.path.join(folder, f"ckpt_{step}.pt"),
                              {"model": GPT(cfg.model).state_dict(), "config": cfg.raw, "step": step})
    return str(folder)


# ----------------------------------------------------------------------------------------------
# README statements


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_train_commands_parse_and_validate():
    """Every `python train.py ...` line of the README builds a valid config (nothing is trained);
    configs/x.yaml is the README's placeholder for "your config"."""
    cmds = [line.split("#")[0].replace("configs/x.yaml", "configs/default.yaml")
            for line in readme().splitlines() if line.strip().startswith("python train.py")]
    assert len(cmds) >= 4
    for cmd in cmds:
        argv = shlex.split(cmd)[2:]
        path, overrides, rest = split_args(argv)
        assert all(a == "--resume" or a.startswith("--resume=") or a == "--overwrite" for a in rest), cmd
        load_config(os.path.join(ROOT, path) if path else None, overrides)


def test_readme_points_only_at_files_in_the_repository():
    text = readme()
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):  # markdown links and images
        assert os.path.exists(os.path.join(ROOT, target)), target
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for cited in ("docs/SPEC.md", "configs/swa_sinks.yaml", "plot.py"):
        assert cited in tracked or os.path.exists(os.path.join(ROOT, cited)), cited


def heading_anchor(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(text):
    """The anchors of every markdown heading of text."""
    return {heading_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_section_links_resolve():
    """Every (#anchor) link in the README names one of its headings."""
    text = readme()
    anchors = heading_anchors(text)
    assert heading_anchor("MQAR at T = 256 (`sweeps/mqar256.yaml`)") == "mqar-at-t--256-sweepsmqar256yaml"
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 8
    assert [a for a in links if a not in anchors] == []


def test_docs_links_resolve():
    """Every link in docs/*.md names a file of the repository, and an #anchor one of that file's headings."""
    docs = os.path.join(ROOT, "docs")
    links = []
    for name in sorted(os.listdir(docs)):
        if name.endswith(".md"):
            links += [(name, target) for target in re.findall(r"\]\(([^)]+)\)", open(os.path.join(docs, name)).read())]
    assert ("speed.md", "../README.md#speed") in links
    for name, target in links:
        path, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(docs, path or name))
        assert os.path.exists(path), (name, target)
        assert not anchor or anchor in heading_anchors(open(path).read()), (name, target)


def test_slow_marker_selects_tests():
    """`pytest -m slow` (README) selects tests: some carry the mark (else pytest exits 5)."""
    folder = os.path.join(ROOT, "tests")
    marked = [f for f in os.listdir(folder) if f.endswith(".py") and "@pytest.mark.slow" in open(os.path.join(folder, f)).read()]
    assert marked


def test_train_threads_setting(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(train_mod, "_train", lambda *a, **k: {})
    train_mod.train(from_raw(tiny_raw(tmp_path, threads=1)), quiet=True)
    assert calls == [1]
    with pytest.raises(ConfigError, match="train.threads: must be an integer >= 0"):
        from_raw(tiny_raw(tmp_path, threads=-1))


# ----------------------------------------------------------------------------------------------
# train.py: config, out_dir, resume, signals


def test_yaml_syntax_error_names_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1\ntrain: {}\n")
    one_error_line(capsys, train_mod.main([str(bad)]), r"bad.yaml: not valid YAML at line 3, column 6: .*"
                                                       r"flow sequence at line 2, column 12")
    assert os.listdir(tmp_path) == ["bad.yaml"]


def test_override_with_a_space_hints_at_equals(capsys):
    one_error_line(capsys, train_mod.main(["--train.max_steps", "10"]),
                   r"--train.max_steps: an override needs '=' \(no space\): --train.max_steps=10$")


@pytest.mark.parametrize("where", ["file", "under_file", "read_only"])
def test_out_dir_that_cannot_be_written(tmp_path, capsys, monkeypatch, where):
    (tmp_path / "afile").write_text("keep me")
    out = {"file": tmp_path / "afile", "under_file": tmp_path / "afile" / "run",
           "read_only": tmp_path / "ro" / "run"}[where]
    if where == "read_only":
        (tmp_path / "ro").mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path / "ro") else real(p, mode))
    before = snapshot(tmp_path)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(out))
    before["c.yaml"] = (tmp_path / "c.yaml").read_bytes()
    msg = "is not writable" if where == "read_only" else "afile is a file, not a folder"
    one_error_line(capsys, train_mod.main([cfg]), rf"train.out_dir: .*{msg}")
    assert snapshot(tmp_path) == before


def test_fresh_run_over_another_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(run))
    assert train_mod.main([cfg]) == 0
    capsys.readouterr()
    before = snapshot(run)
    one_error_line(capsys, train_mod.main([cfg, "--train.seed=2"]),
                   r"run already holds the checkpoints of another run \(latest ckpt_3.pt\); continue it with "
                   r"--resume, start over with --overwrite")
    assert snapshot(run) == before
    assert train_mod.main([cfg, "--overwrite", "--train.max_steps=2"]) == 0  # starts over: no rows of the old run
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and sorted(os.listdir(run)) == [
        "ckpt_1.pt", "ckpt_2.pt", "metrics.jsonl"]


def test_disk_full_while_checkpointing(tmp_path, capsys, monkeypatch):
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if "ckpt_2" in getattr(f, "name", ""):
            f.write(b"x" * 100)  # a partly written temporary file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    run = tmp_path / "run"
    one_error_line(capsys, train_mod.main([write_yaml(tmp_path / "c.yaml", tiny_raw(run))]),
                   r"ckpt_2.pt: could not be written \(No space left on device\); the temporary file was removed",
                   stdout=r"model: .*")  # the start-up report of the run
    assert sorted(os.listdir(run)) == ["ckpt_1.pt", "metrics.jsonl"]  # no .tmp left, the old one intact
    assert train_mod.load_checkpoint(str(run / "ckpt_1.pt"))["step"] == 1


def test_truncated_latest_checkpoint_offers_the_intact_one(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(run))
    assert train_mod.main([cfg]) == 0
    capsys.readouterr()
    data = (run / "ckpt_3.pt").read_bytes()
    (run / "ckpt_3.pt").write_bytes(data[:len(data) // 2])
    before = snapshot(run)
    one_error_line(capsys, train_mod.main([cfg, "--resume", "--train.max_steps=4"]),
                   rf"ckpt_3.pt: not a readable checkpoint .*; the earlier {re.escape(str(run))}/ckpt_2.pt is "
                   rf"intact: resume from it with --resume={re.escape(str(run))}/ckpt_2.pt")
    assert snapshot(run) == before
    assert train_mod.main([cfg, f"--resume={run}/ckpt_2.pt"]) == 0


def train_cmd(tmp_path, **kw):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(tmp_path / "run", max_steps=100000, ckpt_interval=100000,
                                                    log_interval=1, **kw))
    return [sys.executable, os.path.join(ROOT, "train.py"), cfg]


def wait_for_steps(p, run, n=2, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    raise AssertionError("training did not start")


def interrupt_during_step(monkeypatch, calls):
    """SIGINT to this process at the given next_batch() calls (the loop is then inside a step)."""
    real = train_mod.make_dataset

    def make_dataset(*a, **kw):
        data = real(*a, **kw)
        nb, n = data.next_batch, [0]

        def next_batch():
            n[0] += 1
            if n[0] in calls:
                os.kill(os.getpid(), signal.SIGINT)
            return nb()
        data.next_batch = next_batch
        return data
    monkeypatch.setattr(train_mod, "make_dataset", make_dataset)


def test_ctrl_c_in_process(tmp_path, capsys, monkeypatch):
    """One Ctrl-C: the step finishes, a checkpoint is saved, exit 0. Two in one step (grad_accum 2,
    one per micro-batch): abort at once, one line, exit 130, no temporary file."""
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a job started with `&`
    interrupt_during_step(monkeypatch, {5})  # step 3 of grad_accum 2
    cfg = write_yaml(tmp_path / "c.yaml", tiny_raw(run, max_steps=50, ckpt_interval=100, grad_accum=2))
    assert train_mod.main([cfg]) == 0
    assert "stopped by a signal after step 3; checkpoint saved" in capsys.readouterr().out
    assert sorted(os.listdir(run)) == ["ckpt_3.pt", "metrics.jsonl"]
    monkeypatch.undo()  # the next hook wraps the real make_dataset, not the first hook
    interrupt_during_step(monkeypatch, {7, 8})  # both micro-batches of step 4
    one_error_line(capsys, train_mod.main([cfg, "--resume"]),
                   r"^error: interrupted by a second Ctrl-C; the last checkpoint saved is intact \(--resume\)$",
                   code=130, stdout=r"model: .*")
    assert sorted(os.listdir(run)) == ["ckpt_3.pt", "metrics.jsonl"]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


@pytest.mark.slow
def test_ctrl_c_saves_and_stops_a_second_aborts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    run = tmp_path / "run"
    p = subprocess.Popen(train_cmd(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_steps(p, run)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "Traceback" not in err and "stopped by a signal after step" in err + out
    step = max(json.loads(line)["step"] for line in open(run / "metrics.jsonl"))
    assert os.listdir(run) == ["metrics.jsonl", f"ckpt_{step}.pt"] or sorted(os.listdir(run)) == sorted(
        ["metrics.jsonl", f"ckpt_{step}.pt"])
    # a second Ctrl-C during the step that finishes after the first: abort at once, one line, exit 130
    (run / f"ckpt_{step}.pt").unlink()
    (run / "metrics.jsonl").unlink()
    # steps of 2-3 s on an idle 2-core CPU, so both signals land in one (at 64 x 512 a step took 0.2 s there: the
    # second signal came after the first had stopped the run, and killed it with -2)
    p = subprocess.Popen(train_cmd(tmp_path, batch_size=256, seq_len=1024), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    wait_for_steps(p, run, n=1)
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)  # two separate deliveries (Python merges signals that arrive before its handler runs)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert lines == ["error: interrupted by a second Ctrl-C; the last checkpoint saved is intact (--resume)"], err
    assert "Traceback" not in err and not [f for f in os.listdir(run) if ".tmp" in f]


@pytest.mark.slow
def test_torchrun_config_error_is_reported_once_and_last(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "train.py"), "--train.max_steps=0", "--train.device=cpu"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    line = "error: train.max_steps: must be an integer >= 1 (got 0)"
    assert r.returncode != 0
    assert r.stderr.splitlines().count(line) == 1, r.stderr  # rank 0 alone prints it
    summary = r.stderr[r.stderr.rindex("Root Cause"):]  # the launcher's summary, at the very end, shows it
    assert f"traceback : {line}" in summary and "rank      : 0" in summary, summary
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# The end-of-training sample: the corpus's own tokenizer


class StubEncoding:
    """A 300-token 'tiktoken' encoding: token i prints as <i>."""
    name, n_vocab = "stub300", 300

    def encode(self, text, allowed_special=()):
        return [ord(c) % 300 for c in text]

    def decode(self, tokens):
        return "".join(f"<{t}>" for t in tokens)


def text_corpus(folder, tokenizer):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 2000)):
        write_tokens(os.path.join(folder, f"{split}_000.bin"), rng.integers(0, 300, n), 300, n)
    if tokenizer:
        (folder / "manifest.json").write_text(json.dumps({"tokenizer": tokenizer}))


def text_raw(out_dir, corpus):
    raw = tiny_raw(out_dir, max_steps=2, sample_tokens=4, eval_interval=2)
    raw["model"]["vocab_size"] = 300
    raw["data"] = {"kind": "bin", "dir": str(corpus)}
    return raw


def test_sample_uses_the_corpus_tokenizer(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_mod, "get_encoding", lambda name: StubEncoding() if name == "stub300" else None)
    text_corpus(tmp_path / "corpus", "stub300")
    assert train_mod.main([write_yaml(tmp_path / "c.yaml", text_raw(tmp_path / "run", tmp_path / "corpus"))]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sample:\n(<\d+>){8}\n", out), out  # "The " + 4 tokens, decoded by the stub
    # no manifest: no byte-decoded garbage, a line saying why
    text_corpus(tmp_path / "bare", None)
    assert train_mod.main([write_yaml(tmp_path / "d.yaml", text_raw(tmp_path / "run2", tmp_path / "bare"))]) == 0
    out = capsys.readouterr().out
    assert "\nsample:" not in out and re.search(r"no sample: .*bare/manifest.json .* names no tokenizer", out)


def test_train_frees_its_model_before_the_process_group_goes(tmp_path):
    """train() frees the run's model, which its reference cycles keep after _train returns, before it destroys
    the process group. Left to interpreter exit, the FSDP model's mesh took its gloo group down there, and rank 1
    aborted ("terminate called without an active exception"): test_fsdp_run_prints_the_sample failed so in 3 of
    58 runs beside a busy core (and once in a `pytest -m slow`), in 0 of 40 with the model freed first. With the
    collector off, as it may happen not to have run: no model of the run is left."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is GPT}
    gc.disable()
    try:
        train_mod.train(from_raw(tiny_raw(tmp_path, max_steps=2)), quiet=True)
        left = [o for o in gc.get_objects() if type(o) is GPT and id(o) not in before]
    finally:
        gc.enable()
    assert not left


@pytest.mark.slow
def test_fsdp_run_prints_the_sample(tmp_path):
    text_corpus(tmp_path / "corpus", "bytes")
    raw = text_raw(tmp_path / "run", tmp_path / "corpus")
    raw["model"]["vocab_size"], raw["train"]["parallel"] = 300, "fsdp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "train.py"), write_yaml(tmp_path / "c.yaml", raw), "--train.device=cpu"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("\nsample:\nThe ") == 1, r.stdout


# ----------------------------------------------------------------------------------------------
# data/prepare.py: offline tiktoken, --tokenizer bytes


def test_prepare_offline_tiktoken_is_one_line(tmp_path, capsys, monkeypatch):
    import tiktoken.load
    import tiktoken.registry

    def no_network(url):
        raise ConnectionError(f"no network: {url}")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    (tmp_path / "a.txt").write_text("hello")
    rc = prepare_mod.main(["--files", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "r50k_base"])
    one_error_line(capsys, rc, r"--tokenizer r50k_base: the encoding file could not be downloaded "
                               r"\(ConnectionError\); .*TIKTOKEN_CACHE_DIR.*or use --tokenizer bytes")
    assert not (tmp_path / "out").exists()


def test_prepare_bytes_needs_no_download(tmp_path, capsys, monkeypatch):
    import tiktoken.load
    monkeypatch.setattr(tiktoken.load, "read_file", lambda url: pytest.fail("downloaded"))
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    out = tmp_path / "out"
    assert prepare_mod.main(["--files", str(tmp_path / "*.txt"), "--out", str(out), "--tokenizer", "bytes",
                             "--val_tokens", "100", "--workers", "1"]) == 0
    from data.tokens import TokenFile
    val = TokenFile(str(out / "val_000.bin"))
    assert val.vocab_size == 257 and val.eot_id == 256
    assert bytes(int(t) for t in val.tokens[:12]) == b"def f0(x):\n "
    assert json.loads((out / "manifest.json").read_text())["tokenizer"] == "bytes"


# ----------------------------------------------------------------------------------------------
# sample.py


GLOBAL_RAW = {"model": {"vocab_size": 257, "d_model": 32, "n_layer": 1, "pattern": ["g"],
                        "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 64}},
              "data": {"kind": "stdlib"}, "train": {"seq_len": 32}}


@pytest.fixture
def text_ckpt(tmp_path):
    return save_ckpt(tmp_path / "text", GLOBAL_RAW)


def test_sample_non_utf8_prompt(tmp_path, text_ckpt, capsys):
    one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--prompt", "caf\udce9"]), r"--prompt: not UTF-8")
    (tmp_path / "p.txt").write_bytes(b"caf\xe9 au lait")
    one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--prompt_file", str(tmp_path / "p.txt")]),
                   r"--prompt_file .*p.txt: not UTF-8 text \(byte 3")


def test_sample_cuda_without_cuda(text_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--device", "cuda"]),
                   r"--device: cuda asked for but CUDA is not available; use cpu or auto")
    one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--device", "tpu"]), r"--device: one of auto, cpu")


def test_sample_checks_the_whole_context_before_printing(text_ckpt, capsys):
    one_error_line(capsys, sample.main(["--ckpt", text_ckpt, "--prompt", "abc", "--max_new_tokens", "20",
                                        "--cache_len", "10"]),
                   r"--cache_len 10: the context is 22 tokens \(prompt 3 \+ --max_new_tokens 20 - 1\) and the "
                   r"model's attn layers keep every token")
    assert sample.main(["--ckpt", text_ckpt, "--prompt", "abc", "--max_new_tokens", "8", "--cache_len", "10"]) == 0


# ----------------------------------------------------------------------------------------------
# Windowed-only models: the window is honoured whatever max_len the cache was made for


def test_windowed_model_decodes_past_max_len():
    cfg = from_raw({"model": {"vocab_size": 61, "d_model": 32, "n_layer": 2, "pattern": ["w"],
                              "layers": {"w": {"kind": "attn", "n_heads": 2, "window": 16, "sinks": True}},
                              "mlp": {"hidden": 64}}}).model
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    x = torch.randint(0, 61, (2, 40))
    ref = model(x)[0]
    for chunks in ([3] * 13 + [1], [5, 1, 1, 20, 13]):
        cache, got, pos = model.new_cache(2, 8), [], 0  # made for 8 tokens, window 16, 40 tokens fed
        for c in chunks:
            got.append(model.step(x[:, pos:pos + c], cache))
            pos += c
        assert (torch.cat(got, 1) - ref).abs().max() < 1e-4


# ----------------------------------------------------------------------------------------------
# evals.py


MQAR_RAW = {"model": {"vocab_size": 32, "d_model": 32, "n_layer": 1, "pattern": ["g"],
                      "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 64}},
            "data": {"kind": "mqar", "n_pairs": 4}, "train": {"seq_len": 32}}


@pytest.mark.parametrize("argv,match", [
    (["val", "--n_batches", "0"], r"evals.val.n_batches: must be >= 1 \(got 0\)"),
    (["needle", "--n_trials", "0"], r"evals.needle.n_trials: must be >= 1 \(got 0\)"),
    (["needle", "--depths", "0.5,2"], r"evals.needle.depths: must be in \[0, 1\] \(each\)"),
    (["streaming", "--budget", "0"], r"evals.streaming.budget: must be >= 1 \(got 0\)"),
    (["streaming", "--budget", "3"], r"evals.streaming.budget: must be larger than n_sinks=4 \(got 3\)"),
    (["length", "--factor", "0"], r"evals.length.factor: must be >= 1 .*\(got 0\)"),
    (["mqar", "--n_batches", "-1"], r"evals.mqar.n_batches: must be >= 1 \(got -1\)"),
])
def test_eval_options_are_validated_up_front(tmp_path, capsys, argv, match):
    ckpt = save_ckpt(tmp_path / "m", MQAR_RAW)
    before = snapshot(tmp_path)
    one_error_line(capsys, evals.main(argv + ["--ckpt", ckpt]), match)
    assert snapshot(tmp_path) == before


def test_eval_mqar_on_a_text_checkpoint(text_ckpt, capsys):
    one_error_line(capsys, evals.main(["mqar", "--ckpt", text_ckpt]),
                   r"evals.mqar: the checkpoint was trained on data.kind stdlib, not mqar")


def test_eval_streaming_names_the_layer_kinds_it_supports(tmp_path, capsys):
    raw = {**MQAR_RAW, "model": {**MQAR_RAW["model"], "layers": {"g": {
        "kind": "mla", "n_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8,
        "v_head_dim": 8}}}}
    one_error_line(capsys, evals.main(["streaming", "--ckpt", save_ckpt(tmp_path / "mla", raw)]),
                   r"evicts only from global softmax attention layers \(kind attn without a window\); this "
                   r"model has MLA layers, which it does not support")


def test_eval_help_lines_are_whole_sentences(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per subcommand
    with pytest.raises(SystemExit):
        evals.main(["--help"])
    out = capsys.readouterr().out
    for name, fn in evals.EVALS.items():
        line = re.search(rf"^\s+{name}\s+(.*)$", out, re.M).group(1)
        assert line.endswith("."), line
        assert " ".join(fn.__doc__.split()).startswith(line[:-1]), line


def test_sweep_eval_values_are_checked(tmp_path):
    import ablate
    (tmp_path / "s.yaml").write_text(json.dumps({"base": os.path.join(ROOT, "configs", "default.yaml"),
                                                 "variants": {"a": {}}, "evals": {"mqar": {"n_batches": 0}}}))
    with pytest.raises(ablate.SweepError, match=r"s.yaml: evals.mqar.n_batches: must be >= 1 \(got 0\)"):
        ablate.load_sweep(str(tmp_path / "s.yaml"))


# ----------------------------------------------------------------------------------------------
# cost.py, plot.py


def test_cost_without_a_config_and_bad_ctx(capsys):
    assert cost.main([]) == 0
    assert capsys.readouterr().out.startswith("configs/default.yaml: ")
    one_error_line(capsys, cost.main(["--ctx", "-5"]), r"--ctx: must be >= 1 \(got -5\)")
    one_error_line(capsys, cost.main(["--model.n_layer", "4"]), r"an override needs '='")


def test_cost_into_a_pipe_closed_early():
    """`python cost.py | head -1`: the first line, then no BrokenPipeError traceback."""
    r = subprocess.run(f"{sys.executable} {os.path.join(ROOT, 'cost.py')} | head -1", shell=True,
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.startswith("configs/default.yaml: ") and r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_plot_one_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "val_loss": 2.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert plot.main([str(run)]) == 0
    png = (run / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    capsys.readouterr()
    one_error_line(capsys, plot.main([str(tmp_path / "nothing")]), r"nothing: no metrics.jsonl rows")
    assert not (tmp_path / "nothing").exists()


def test_plot_draws_an_mqar_mixtures_settings_beside_val_acc(monkeypatch):
    drawn = {}
    monkeypatch.setattr(plot, "save_png", lambda fig, path: drawn.update(fig=fig))
    rows = [{"step": 1, "loss": 3.0}, {"step": 100, "val_loss": 2.7, "val_acc": 0.1, "val_acc_128x8": 0.5,
                                        "val_acc_64x4": 0.9, "val_loss_64x4": 0.3}]
    plot.loss_curves({"run": rows}, "unused.png")
    right = drawn["fig"].axes[1]
    assert [line.get_label() for line in right.get_lines()] == ["run", "run 64/4", "run 128/8"]
    assert [line.get_ydata()[0] for line in right.get_lines()] == [0.1, 0.9, 0.5]
