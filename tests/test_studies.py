"""studies/: the MQAR accuracy-vs-length and attention-sink scripts on a tiny trained sweep."""
import math
import os
import re

import torch

import ablate
from studies import attention_sinks, mqar_length
from test_ablate import GRID, SWEEP, write_sweep


def test_studies_on_a_tiny_sweep(tmp_path, capsys):
    sweep = ablate.load_sweep(write_sweep(tmp_path, GRID.replace("seeds: [0, 1]", "seeds: [0]")))
    ablate.run_sweep(sweep, log=lambda m: None)                   # attn at 2 lrs, stopped at step 6
    png = str(tmp_path / "len.png")
    assert mqar_length.main([sweep["path"], "--lengths", "12", "24", "48", "--n_batches", "1", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| variant | best lr | seeds | T = 12 | T = 24 (train) | T = 48 |" in out and "| attn | 0.00" in out
    assert os.path.getsize(png) > 1000
    assert mqar_length.main([sweep["path"], "--lengths", "24", "--n_batches", "1", "--only", "attn"]) == 0
    assert "| attn | 0.00" in capsys.readouterr().out
    assert mqar_length.main([sweep["path"], "--lengths", "24", "--n_batches", "1", "--n_pairs", "2"]) == 0
    assert "| attn | " in capsys.readouterr().out
    assert mqar_length.main([sweep["path"], "--lengths", "24", "--n_pairs", "500"]) == 2   # more than the vocab holds
    assert capsys.readouterr().err.startswith("error: mqar: n_pairs=500 needs a vocab of at least")
    assert mqar_length.main([sweep["path"], "--only", "attn,nope"]) == 2      # a name not in the sweep
    assert capsys.readouterr().err.startswith("error: --only nope: not a variant of this sweep (")
    assert mqar_length.main([sweep["path"], sweep["path"], "--lengths", "24", "--n_batches", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: variant attn is in more than one sweep")
    run = ablate.run_dir(sweep, "attn", 0, 1e-3)
    png = str(tmp_path / "sinks.png")
    assert attention_sinks.main([run, "--budgets", "6", "8", "--factor", "1", "--n_seqs", "2", "--skip", "4", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| step | key 0, layer 0 | key 0, layer 1 | strongest head, layer 0 |" in out and "heads > 0.3 (by layer) |" in out and "| 6 |" in out and "| 6 |" in out and "| 8 |" in out and "window only" in out
    assert os.path.getsize(png) > 1000
    assert attention_sinks.main([run, "--budgets", "6", "--factor", "1", "--n_seqs", "2", "--sink_heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| cost of evicting | sinks for the top heads only, window for the rest | share of the cost they win back |" in out
    assert attention_sinks.won_back(5.0, 3.0, 4.0) == "50%" and attention_sinks.won_back(3.0, 3.0, 3.0) == "-"
    assert attention_sinks.cost(4.4, 4.0) == "+10%" and attention_sinks.cost(3.99, 4.0) == "0%" and attention_sinks.cost(3.4, 4.0) == "-15%"
    assert attention_sinks.main([run, "--sink_heads", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: evals.streaming.sink_heads: must be >= 0")
    assert attention_sinks.main([str(tmp_path)]) == 2              # no checkpoint: one line
    assert capsys.readouterr().err.startswith("error: ")


def test_curriculum_table_follows_each_chain(tmp_path, capsys):
    import evals
    from sample import load_model
    from studies import curriculum
    from test_ablate import CURRICULUM
    path = write_sweep(tmp_path, CURRICULUM)            # attn at T=24 / 3 pairs, then `long` at 48 / 6; `other`
    sweep = ablate.load_sweep(path)
    ablate.run_sweep(sweep, log=lambda m: None)
    assert curriculum.chains(sweep) == [["attn", "long"], ["other"]]
    png = str(tmp_path / "cur.png")
    assert curriculum.main([path, "--zero_shot", "1", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| chain | T=24 / 3 pairs | T=48 / 6 pairs |" in out
    row = next(line for line in out.splitlines() if line.startswith("| attn |"))
    first, second = row.strip(" |").split(" | ")[1:3]
    assert re.fullmatch(r"\d / 2: \d\.\d{3} \(12\), \d\.\d{3} \(12\)", first)
    assert re.fullmatch(r"\d / 2: \d\.\d{3} \(6\), \d\.\d{3} \(6\); before: \d\.\d{3}, \d\.\d{3}", second)
    # "before" is the earlier stage's last checkpoint scored on the stage's own setting
    model, _ = load_model(ablate.run_dir(sweep, "attn", 1))
    cfg = ablate.config_for(sweep, "long", 1)
    acc = evals.run_eval("mqar", model, cfg, {"seq_len": 48, "n_pairs": 6, "n_batches": 1})["acc"]
    assert second.endswith(f", {acc:.3f}")
    assert os.path.getsize(png) > 1000
    assert curriculum.main([path, "--chains", "attn", "--labels", "a"]) == 0
    assert "| a | " in capsys.readouterr().out
    assert curriculum.main([path, "--chains", "attn", "--labels", "a", "b"]) == 2
    assert capsys.readouterr().err.startswith("error: --labels: must name each chain of --chains")
    assert curriculum.main([path, "--chains", "long"]) == 2          # not a first stage: one line
    err = capsys.readouterr().err
    assert err.startswith("error: --chains long: not a first stage") and len(err.strip().splitlines()) == 1


def _tiny(pattern, layers):
    from config import from_raw
    from model import GPT
    cfg = from_raw({"model": {"vocab_size": 40, "d_model": 32, "n_layer": len(pattern), "pattern": pattern,
                              "layers": layers, "mlp": {"hidden": 64}},
                    "data": {"kind": "mqar", "n_pairs": 4}, "train": {"seq_len": 32, "batch_size": 4}})
    torch.manual_seed(0)
    return GPT(cfg.model).eval(), cfg


RECALL_LAYERS = {"a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "sinks": True},
                 "w": {"kind": "attn", "n_heads": 2, "window": 5}, "l": {"kind": "linear", "n_heads": 2},
                 "g": {"kind": "gdn", "n_heads": 2}, "k": {"kind": "kda", "n_heads": 2}}


def test_effective_attention_reproduces_every_op():
    """M from the op rerun on v = identity gives the op's output as M v (softmax with GQA, sinks and a
    window; linear attention; the gated delta rule with a per-head and a per-channel gate)."""
    import kernels
    from studies import recall_heads
    model, _ = _tiny(["a", "w", "l", "g", "k"], RECALL_LAYERS)
    x = torch.randint(1, 40, (2, 24))
    calls = recall_heads.capture_ops(model, x)
    assert [(layer, name) for layer, name, _, _ in calls] == [
        (0, "attention"), (1, "attention"), (2, "linear_attention"), (3, "delta_rule"), (4, "delta_rule")]
    for layer, name, args, kwargs in calls:
        o = getattr(kernels, name)(*args, **kwargs)
        o = o[0] if isinstance(o, tuple) else o                               # [B, T, Hq, V]
        M = recall_heads.effective_attention(name, args, kwargs)              # [B, Hq, T, T]
        v = args[2].repeat_interleave(o.shape[2] // args[2].shape[2], dim=2)  # grouped v heads
        assert M.shape == (2, o.shape[2], 24, 24)
        torch.testing.assert_close(torch.einsum("bhts,bshv->bthv", M, v), o, rtol=1e-5, atol=1e-5)
        assert M.triu(1).abs().max() == 0                                     # causal
    assert kernels.attention.__name__ == "attention"                          # the ops are restored


def test_head_stats_find_a_planted_recall():
    from data.mqar import mqar_batch
    from studies.recall_heads import head_stats
    P, T, K = 8, 40, 8
    x, y, _ = mqar_batch(4, T, P, 40, seed=0)
    M = torch.rand(4, 2, T, T) * 0.1
    keys = torch.randn(4, T, 2, K)
    keys[:, 3:2 * P + 3:2, 0] = torch.eye(P)                 # head 0: orthogonal keys where pair i lives
    for b, t in zip(*(y >= 0).nonzero(as_tuple=True)):
        i = (x[b, :2 * P:2] == x[b, t]).nonzero()[0, 0]
        M[b, 0, t, 2 * i + 3] = 1.0                          # head 0 reads pair i at 2i + 3
    s = head_stats(M, keys, x, y, P, reach=4)
    assert s[0]["at"] == 3 and s[0]["hit"] == 1.0 and s[0]["rank"] == 0 and s[0]["overlap"] == 0.0 and s[0]["contrast"] > 10
    assert s[1]["hit"] < 0.5 and 2 < s[1]["rank"] < 5 and 0.5 < s[1]["contrast"] < 2 and 0.05 < s[1]["overlap"] < 0.3   # noise; random keys ~1/K
    for b, t in zip(*(y >= 0).nonzero(as_tuple=True)):      # head 0 now puts one other pair first
        i = (x[b, :2 * P:2] == x[b, t]).nonzero()[0, 0]
        M[b, 0, t, 2 * ((i + 1) % P) + 3] = 2.0
    s = head_stats(M, keys, x, y, P, reach=4)
    assert s[0]["hit"] == 0.0 and s[0]["rank"] == 1.0


def test_recall_heads_cli(tmp_path, capsys):
    from studies import recall_heads
    from train import save_checkpoint
    model, cfg = _tiny(["k", "a"], RECALL_LAYERS)
    save_checkpoint(str(tmp_path / "ckpt_1.pt"), {"model": model.state_dict(), "config": cfg.raw, "step": 1})
    assert recall_heads.main([str(tmp_path), "--n_seqs", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tmp_path} |")]
    assert [r.split(" | ")[2] for r in rows] == ["0.0 (kda)", "0.1 (kda)", "1.0 (attn)", "1.1 (attn)", "1.2 (attn)", "1.3 (attn)"]
    assert all(r.split(" | ")[1] == "T=32 / 4 pairs" for r in rows)
    assert recall_heads.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_dsa_stages_resumes_dense_and_tabulates(tmp_path, capsys):
    """Each sparse run starts from the dense run's checkpoint at the switch (its rows up to there are
    dense's), runs to the end in the sparse stage, and the table compares it with dense per seed."""
    from plot import read_metrics
    from studies import dsa_stages
    tiny = ["--model.d_model=32", "--model.n_layer=2", "--model.layers.mla.n_heads=2", "--train.seq_len=32",
            "--train.batch_size=2", "--train.eval_interval=2", "--train.eval_batches=1", "--train.log_interval=1"]
    args = ["--root", str(tmp_path), "--seeds", "1", "2", "--steps", "4", "--switch", "2", "--top_ks", "8",
            "--out", str(tmp_path / "dsa.png")] + [f"--set={o}" for o in tiny]
    assert dsa_stages.main(args) == 0
    out = capsys.readouterr().out
    for seed in (1, 2):
        dense, sparse = (read_metrics(str(tmp_path / f"s{seed}" / n)) for n in ("dense", "k8"))
        assert [r for r in sparse if r["step"] <= 2] == [r for r in dense if r["step"] <= 2]
        assert [r["step"] for r in sparse if "val_loss" in r] == [2, 4]
        late = [r for r in sparse if r["step"] > 2 and "indexer_kl" in r]
        assert late and all(r["indexer_kl"] > 0 for r in late)
        d4, s4 = ({r["step"]: r["val_loss"] for r in rows if "val_loss" in r}[4] for rows in (dense, sparse))
        assert f"{s4 - d4:+.4f}" in out                            # its difference to dense at the end
    rows = [line for line in out.splitlines() if line.startswith("| DSA top_k 8 |")]
    assert len(rows) == 1 and os.path.getsize(tmp_path / "dsa.png") > 0
    # finished runs are read, not retrained; unfinished ones are named in one line
    assert dsa_stages.main(args[:-len(tiny)] + ["--report_only"]) == 0
    assert dsa_stages.main(["--root", str(tmp_path / "none"), "--report_only"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: ")


def plant_seed_results(sweep, planted, first_seed=0):
    """A finished run per (variant, lr) and seed: result.json with val_acc `acc` (step 10 if acc > 0.5, else
    30 + seed) and metrics.jsonl with val_acc at step 5 (0.6 + 0.1 seed for attn at 3e-3, else 0.2) and 10."""
    import json
    for (variant, lr), accs in planted.items():
        for seed, acc in enumerate(accs, first_seed):
            d = ablate.run_dir(sweep, variant, seed, lr)
            os.makedirs(d)
            with open(os.path.join(d, "result.json"), "w") as f:
                json.dump({"variant": variant, "seed": seed, "lr": lr,
                           "final": {"step": 10 if acc > 0.5 else 30 + seed, "val_acc": acc}}, f)
            early = 0.6 + 0.1 * seed if (variant, lr) == ("attn", 3e-3) else 0.2   # val_acc at step 5
            with open(os.path.join(d, "metrics.jsonl"), "w") as f:
                for row in ({"step": 5, "loss": 1.0}, {"step": 5, "val_acc": early}, {"step": 10, "val_acc": acc}):
                    f.write(json.dumps(row) + "\n")


def test_seed_stats_intervals_and_permutation_p(tmp_path, capsys):
    """Planted per-seed results: the variant table (mean, bootstrap interval around it, median, count of
    solved seeds) at each variant's best lr, and the pairs' permutation p: 2 / C(6, 3) = 0.1 for three
    seeds that all beat three others (the smallest two-sided p there is), 1 for identical groups."""
    from studies import seed_stats
    body = SWEEP.replace("seeds: [0]", "seeds: [0, 1, 2]\nlrs: [1.0e-3, 3.0e-3]\nselect: val_acc").replace(
        "  hybrid: {model.pattern: [kda, attn]}\n", "  twin: {}\n  low: {}\n")
    sweep = ablate.load_sweep(write_sweep(tmp_path, body))
    plant_seed_results(sweep, {("attn", 1e-3): [0.9, 0.95, 1.0], ("attn", 3e-3): [0.1, 0.2, 0.3],
                               ("twin", 1e-3): [0.9, 0.95, 1.0], ("low", 1e-3): [0.1, 0.2, 0.3]})
    assert seed_stats.main([sweep["path"], "--solved", "0.92"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"\| attn \| 3 \| 0\.001 \| 0\.950 \[(\S+), (\S+)\] \| 0\.050 \| 0\.950 \| 0\.900 - 1\.000 \| 2 / 3 \|", out)
    assert row and 0.9 <= float(row[1]) < 0.95 < float(row[2]) <= 1.0, out
    assert "| low | 3 | 0.001 | 0.200 [" in out and "| 0 / 3 |" in out
    assert re.search(r"\| attn - twin \| \+0\.000 \[\S+, \S+\] \| 1\.000 \|", out)
    assert re.search(r"\| attn - low \| \+0\.750 \[\+0\.6\d\d, \+0\.8\d\d\] \| 0\.100 \|", out)
    assert seed_stats.permutation_p([1.0] * 10, [0.0] * 10) == 2 / math.comb(20, 10)          # exact
    assert seed_stats.permutation_p(list(range(12)), list(range(12, 24))) < 1e-3            # sampled
    # tables print p to three decimals, and below 0.001 to two significant figures, never as 0.000
    assert [seed_stats.format_p(p) for p in (0.1, 0.008, 0.001)] == ["0.100", "0.008", "0.001"]
    assert seed_stats.format_p(2 / math.comb(16, 8)) == "0.00016"
    assert seed_stats.format_p(2 / math.comb(18, 9)) == "4.1e-05"
    # another number of the final record, at the best lr of the selection metric (1e-3 for attn)
    assert seed_stats.main([sweep["path"], "--only", "attn,low", "--metric", "step", "--solved", "31"]) == 0
    out = capsys.readouterr().out
    assert "| attn | 3 | 0.001 | 10.000 [10.000, 10.000] |" in out and "| low | 3 | 0.001 | 31.000 [" in out
    # lower is better for steps: --solved counts the seeds that stopped by step 31 (low: 30 and 31, not 32)
    assert "seeds <= 31 |" in out and re.search(r"\| attn \| 3 \| .* \| 3 / 3 \|", out)
    assert re.search(r"\| low \| 3 \| .* \| 2 / 3 \|", out), out
    assert re.search(r"\| attn - low \| -21\.000 \[-22\.000, -20\.000\] \| 0\.100 \|", out), out
    # --at_step: the metric at a training step (the last eval at or before it), each variant at its best lr by
    # it: attn's lr 3e-3 runs learn faster (0.6, 0.7, 0.8 at step 5) and end worse
    assert seed_stats.main([sweep["path"], "--only", "attn,low", "--at_step", "7"]) == 0
    out = capsys.readouterr().out
    assert "| attn | 3 | 0.003 | 0.700 [" in out and "| low | 3 | 0.001 | 0.200 [" in out, out
    assert seed_stats.main([sweep["path"], "--at_step", "4"]) == 2
    assert capsys.readouterr().err.strip().endswith("logged no val_acc at or before step 4")
    assert seed_stats.main([sweep["path"], "--at_step", "5", "--metric", "step"]) == 2
    assert "give it or --metric, not both" in capsys.readouterr().err
    assert seed_stats.main([sweep["path"], "--metric", "val_lost"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --metric val_lost: not a number of the runs' final "
                                               "records (they have: step, val_acc)")
    assert seed_stats.main([sweep["path"], "--only", "attn,nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --only nope: not a variant of this sweep (")


def test_seed_stats_pools_sweeps(tmp_path, capsys):
    """Two sweeps of the same runs on other seeds: each variant at its best lr in each sweep (1e-3 in the
    first, 3e-3, the only one, in the held-out batch), its seeds pooled; 5 seeds all above 5 others give the
    smallest p, 2 / C(10, 5). A seed in both sweeps, or a variant in neither, is one line. A sweep given as
    path@label keeps its variants apart, as variant@label."""
    from studies import seed_stats
    body = SWEEP.replace("  hybrid: {model.pattern: [kda, attn]}\n", "  low: {}\n  twin: {}\n")
    first = ablate.load_sweep(write_sweep(tmp_path, body.replace(
        "seeds: [0]", "seeds: [0, 1, 2]\nlrs: [1.0e-3, 3.0e-3]\nselect: val_acc")))
    plant_seed_results(first, {("attn", 1e-3): [0.9, 0.95, 1.0], ("attn", 3e-3): [0.1, 0.2, 0.3],
                               ("low", 1e-3): [0.1, 0.2, 0.3], ("twin", 1e-3): [0.5, 0.5, 0.5]})
    os.makedirs(tmp_path / "held_out")
    held_out = ablate.load_sweep(write_sweep(tmp_path / "held_out", body.replace(
        "seeds: [0]", "seeds: [3, 4]\nlrs: [3.0e-3]\nselect: val_acc").replace("  twin: {}\n", "")))
    plant_seed_results(held_out, {("attn", 3e-3): [0.8, 0.85], ("low", 3e-3): [0.4, 0.5]}, first_seed=3)
    assert seed_stats.main([first["path"], held_out["path"]]) == 0
    out = capsys.readouterr().out
    assert "| attn | 5 | 0.001 / 0.003 | 0.900 [" in out and "| low | 5 | 0.001 / 0.003 | 0.300 [" in out, out
    assert "| twin | 3 | 0.001 | 0.500 [" in out
    assert "| attn - low | +0.600 [" in out and f"| {2 / math.comb(10, 5):.3f} |" in out
    assert seed_stats.main([first["path"], held_out["path"], "--only", "attn"]) == 0
    assert "| attn | 5 |" in capsys.readouterr().out
    assert seed_stats.main([first["path"], first["path"]]) == 2
    assert capsys.readouterr().err.strip() == (f"error: attn seed 0 is in {first['path']} and {first['path']}: "
                                               "pooled sweeps need distinct seeds")
    assert seed_stats.main([first["path"], held_out["path"], "--only", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --only nope: not a variant of these sweeps (attn, low, twin)")
    # path@label: the labelled sweep's variants are variant@label, compared with (not pooled into) the others
    args = [first["path"], held_out["path"], held_out["path"] + "@3e-3", "--only", "attn,low@3e-3,attn@3e-3"]
    assert seed_stats.main(args) == 0
    out = capsys.readouterr().out
    assert "| attn | 5 | 0.001 / 0.003 | 0.900 [" in out and "| attn@3e-3 | 2 | 0.003 | 0.825 [" in out, out
    assert "| low@3e-3 | 2 | 0.003 | 0.450 [" in out and "| low@3e-3 - attn@3e-3 | -0.375 [" in out, out
    assert "| attn - attn@3e-3 | +0.075 [" in out and "| low" not in out.replace("| low@", "")
    variant_rows = out.split("\n\n")[0].splitlines()[2:]
    assert [row.split(" | ")[0] for row in variant_rows] == ["| attn", "| low@3e-3", "| attn@3e-3"], out  # --only's order
    assert seed_stats.main([first["path"] + "@", "--only", "attn"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {first['path']}@: a sweep is 'path' or 'path@label' (a "
                                               "label without '/' or ',')")
    assert seed_stats.main([first["path"] + "@a", "--only", "attn"]) == 2
    assert capsys.readouterr().err.startswith("error: --only attn: not a variant of this sweep (attn@a, low@a,")


def test_seed_stats_shows_lr_points_in_their_variants_row(tmp_path, capsys):
    """An lr point (lr_of) shows in its variant's row: named alone at its own lr, named with its variant at
    the better of the two; the sweep given again with a label compares one lr with the other. The rows come
    in --only's order."""
    import json
    from studies import seed_stats
    body = SWEEP.replace("seeds: [0]", "seeds: [0, 1, 2]\nselect: val_acc").replace(
        "  hybrid: {model.pattern: [kda, attn]}\n", "  attn_lr3e3: {lr_of: attn, train.lr: 3.0e-3}\n  low: {}\n")
    sweep = ablate.load_sweep(write_sweep(tmp_path, body))
    planted = {("attn", 1e-3): [0.9, 0.95, 1.0], ("attn_lr3e3", 3e-3): [0.1, 0.2, 0.3], ("low", 1e-3): [0.4, 0.5, 0.6]}
    for (variant, lr), accs in planted.items():
        for seed, acc in enumerate(accs):
            folder = ablate.run_dir(sweep, variant, seed)
            os.makedirs(folder)
            with open(os.path.join(folder, "result.json"), "w") as f:
                json.dump({"variant": variant, "seed": seed, "lr": lr, "final": {"step": 10, "val_acc": acc}}, f)

    def rows(*args):   # (variant, lr, mean) of each row of the variant table
        assert seed_stats.main(list(args)) == 0
        table = capsys.readouterr().out.split("\n\n")[0].splitlines()[2:]
        return [(c[0][2:], c[2], c[3].split()[0]) for c in (row.split(" | ") for row in table)]
    path = sweep["path"]
    assert rows(path, "--only", "low,attn_lr3e3") == [("low", "0.001", "0.500"), ("attn", "0.003", "0.200")]
    assert rows(path, "--only", "attn") == [("attn", "0.001", "0.950")]
    assert rows(path, "--only", "low,attn_lr3e3,attn") == [("low", "0.001", "0.500"), ("attn", "0.001", "0.950")]
    assert rows(path, path + "@hi", "--only", "attn_lr3e3@hi,attn") == [("attn@hi", "0.003", "0.200"),
                                                                        ("attn", "0.001", "0.950")]


def test_sink_eviction_splits_the_cost_by_layer_and_head(tmp_path, capsys):
    """Each head's share W_o^h o_h sums to the layer's output; layer 0's input is the same under both caches
    (moved by 0); with one layer, evicting in that layer only is evicting everywhere."""
    from config import from_raw
    from model import GPT
    from studies import sink_eviction
    from train import save_checkpoint
    torch.manual_seed(0)
    for n_layer in (1, 2):
        cfg = from_raw({"model": {"vocab_size": 257, "d_model": 32, "n_layer": n_layer, "pattern": ["g"],
                                  "layers": {"g": {"kind": "attn", "n_heads": 4}}, "mlp": {"hidden": 64}},
                        "data": {"kind": "stdlib", "bos": True}, "train": {"seq_len": 16, "batch_size": 2}})
        model = GPT(cfg.model).eval()
        o = torch.randn(2, 5, 32)
        torch.testing.assert_close(sink_eviction.head_outputs(model.blocks[0].mixer, o).sum(2),
                                   model.blocks[0].mixer.wo(o), rtol=1e-5, atol=1e-5)
        run = tmp_path / f"l{n_layer}"
        run.mkdir()
        save_checkpoint(str(run / "ckpt_3.pt"), {"model": model.state_dict(), "config": cfg.raw, "step": 3})
        r = sink_eviction.study(str(run), budget=6, n_sinks=2, factor=2, n_seqs=2, top=2)
        assert r["step"] == 3 and r["layers"][0][2] == 0.0 and r["layers"][0][3] > 0 and r["layers"][0][1] > 0
        assert len(r["layers"]) == n_layer and len(r["heads"]) == 2 and len(r["ratio"]) == len(r["value"]) == 4
        if n_layer == 1:
            assert math.isclose(r["layers"][0][4], r["ppl_window"], rel_tol=1e-5)
    save_checkpoint(str(run / "ckpt_5.pt"), {"model": model.state_dict(), "config": cfg.raw, "step": 5})
    assert sink_eviction.main([str(run), "--budget", "6", "--n_sinks", "2", "--factor", "2", "--n_seqs", "2",
                               "--over_training"]) == 0
    out = capsys.readouterr().out
    steps = [line.split(" | ")[0] for line in out.splitlines() if re.match(r"\| \d+ \| \d+ \| \d+ \| ", line)]
    assert steps == ["| 3", "| 5"]                                 # one row per checkpoint, in order
    assert "| layer | residual norm entering it, position 0 / others | residual entering it moved by |" in out and "| 1 | " in out
    assert sink_eviction.main([str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_mix_order_finds_the_first_step_each_setting_reaches_each_threshold(tmp_path, capsys):
    """Planted mixture evals: thresholds as accuracies and as multiples of 1 / pairs, the target column
    last, a setting that never gets there marked -, a run without one of the settings left blank."""
    import json
    from studies import mix_order
    runs = {"a": [{"step": 20, "val_acc": 0.03, "val_acc_64x4": 0.25, "val_acc_128x8": 0.12},
                  {"step": 40, "val_acc": 0.07, "val_acc_64x4": 0.6, "val_acc_128x8": 0.3},
                  {"step": 60, "val_acc": 0.95, "val_acc_64x4": 0.99, "val_acc_128x8": 0.97}],
            "b": [{"step": 100, "loss": 3.0}, {"step": 100, "val_acc": 0.07, "val_acc_128x8": 0.3}]}
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mix_order.main([str(tmp_path / "a"), str(tmp_path / "b"), "--at", "2x", "0.5", "0.96"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "| run | 64 / 4 | 128 / 8 | 512 / 32 |"
    assert out[3] == "| a | 40 / 40 / 60 | 40 / 60 / 60 | 40 / 60 / - |"    # 2x at 512/32: 0.0625
    assert out[4] == "| b |  | 100 / - / - | 100 / - / - |"
    assert mix_order.main([str(tmp_path / "nothing")]) == 2
    assert "no eval rows in metrics.jsonl" in capsys.readouterr().err
    assert mix_order.main([str(tmp_path / "a"), "--target", "512"]) == 2
    assert "--target: <length>x<pairs>" in capsys.readouterr().err


def test_trained_length_groups_variants_by_pattern_and_length(tmp_path, capsys):
    """Variants that differ in train.seq_len form one series per layer pattern: each variant at its best lr
    (attn at 24: 1e-3 by the end, 3e-3 by step 5), per length the mean ± std of its seeds, and each pair of
    series' difference with its permutation p (three seeds all above three others: 2 / C(6, 3) = 0.1); a
    variant in two sweeps pools its seeds."""
    import json
    from studies import seed_stats, trained_length
    body = SWEEP.replace("seeds: [0]", "seeds: [0, 1, 2]\nlrs: [1.0e-3, 3.0e-3]\nselect: val_acc").replace(
        "  attn: {}\n  hybrid: {model.pattern: [kda, attn]}\n",
        "  attn: {}\n  attn_48: {train.seq_len: 48}\n  hybrid: {model.pattern: [kda, attn]}\n"
        "  hybrid_48: {model.pattern: [kda, attn], train.seq_len: 48}\n  twin: {}\n")
    sweep = ablate.load_sweep(write_sweep(tmp_path, body))
    plant_seed_results(sweep, {("attn", 1e-3): [0.9, 0.95, 1.0], ("attn", 3e-3): [0.1, 0.2, 0.3],
                               ("attn_48", 1e-3): [0.5, 0.6, 0.7], ("hybrid", 1e-3): [0.1, 0.2, 0.3],
                               ("hybrid_48", 1e-3): [0.6, 0.7, 0.8], ("twin", 1e-3): [0.5, 0.5, 0.5]})
    png = str(tmp_path / "len.png")
    assert trained_length.main([sweep["path"], "--only", "attn,attn_48,hybrid,hybrid_48", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| series | T = 24 | T = 48 |" in out
    assert "| attn | 0.950 ± 0.050 (3) | 0.600 ± 0.100 (3) |" in out, out
    assert "| kda+attn | 0.200 ± 0.100 (3) | 0.700 ± 0.100 (3) |" in out, out
    assert "| attn - kda+attn | +0.750, p 0.100 | -0.100, p 0.500 |" in out, out
    assert seed_stats.permutation_p([0.5, 0.6, 0.7], [0.6, 0.7, 0.8]) == 0.5
    values, sources, metric = trained_length.by_length([sweep], ["attn", "attn_48"])   # each seed's value under its seed
    assert values == {"attn": {24: {0: 0.9, 1: 0.95, 2: 1.0}, 48: {0: 0.5, 1: 0.6, 2: 0.7}}} and metric[0] == "val_acc"
    assert sources == {"attn": {24: ("attn", "0.001", []), 48: ("attn_48", "0.001", [])}}
    assert os.path.getsize(png) > 1000
    # --ymin starts the accuracy axis higher, never above a plotted seed (hybrid's lowest at T = 24: 0.1)
    assert trained_length.main([sweep["path"], "--only", "attn,attn_48", "--out", png, "--ymin", "0.5"]) == 0
    capsys.readouterr()
    assert trained_length.main([sweep["path"], "--only", "attn,hybrid", "--out", png, "--ymin", "0.2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("error: --ymin 0.2: the axis must start between 0 and the lowest "
                                         "value plotted, 0.100 (and below 1)")
    # at a training step, each variant at its best lr there (attn at 24: 3e-3's 0.6, 0.7, 0.8 at step 5)
    assert trained_length.main([sweep["path"], "--only", "attn,hybrid", "--at_step", "5"]) == 0
    assert "| attn | 0.700 ± 0.100 (3) |" in capsys.readouterr().out
    # two variants of one pattern at one length cannot share a cell; nothing chosen is one line too
    assert trained_length.main([sweep["path"], "--only", "attn,twin"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: two variants train attn at T = 24 (twin in {sweep['path']} "
                                               "is the second): pick one with --only, or the better of them with "
                                               "--best_lr")
    assert trained_length.main([sweep["path"], "--only", "attn,nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --only nope: not a variant of this sweep (attn, attn_48, ")
    # a variant in two sweeps pools its seeds (seeds 3 and 4 held out, at their own best lr); a seed twice is one line
    os.makedirs(tmp_path / "held_out")
    held_out = ablate.load_sweep(write_sweep(tmp_path / "held_out", SWEEP.replace(
        "seeds: [0]", "seeds: [3, 4]\nlrs: [3.0e-3]\nselect: val_acc")))
    plant_seed_results(held_out, {("attn", 3e-3): [0.8, 0.85]}, first_seed=3)
    values, _, _ = trained_length.by_length([sweep, held_out], ["attn", "attn_48"])
    assert values == {"attn": {24: {0: 0.9, 1: 0.95, 2: 1.0, 3: 0.8, 4: 0.85}, 48: {0: 0.5, 1: 0.6, 2: 0.7}}}
    assert trained_length.main([sweep["path"], held_out["path"], "--only", "attn,hybrid"]) == 0
    assert "| attn | 0.900 ± 0.079 (5) |" in capsys.readouterr().out
    assert trained_length.main([sweep["path"], sweep["path"], "--only", "attn"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: attn seed 0 is in {sweep['path']} and {sweep['path']}: "
                                               "pooled sweeps need distinct seeds")
    # path@label keeps a sweep's variants apart; --best_lr keeps the better mean over the seeds both have
    # (attn@late: seeds 3, 4 only, none common, 0.825 < 0.95 on all; attn@b: seeds 0, 1 at 0.99 > 0.925)
    os.makedirs(tmp_path / "b")
    other_lr = ablate.load_sweep(write_sweep(tmp_path / "b", SWEEP.replace(
        "seeds: [0]", "seeds: [0, 1]\nlrs: [3.0e-3]\nselect: val_acc")))
    plant_seed_results(other_lr, {("attn", 3e-3): [0.99, 0.99]})
    assert trained_length.main([sweep["path"], held_out["path"] + "@late", "--only", "attn,attn@late"]) == 2
    assert "--best_lr" in capsys.readouterr().err
    assert trained_length.main([sweep["path"], held_out["path"] + "@late", "--only", "attn,attn@late",
                                "--best_lr"]) == 0
    out = capsys.readouterr().out
    assert "| attn | 0.950 ± 0.050 (3) |" in out and "| attn | attn (lr 0.001), over attn@late |" in out, out
    values, sources, _ = trained_length.by_length([sweep, other_lr], ["attn", "attn@b"], labels=["", "b"],
                                                  best_lr=True)
    assert values == {"attn": {24: {0: 0.99, 1: 0.99}}}
    assert sources == {"attn": {24: ("attn@b", "0.003", ["attn"])}}
    # sweeps that select by different metrics cannot share a table
    os.makedirs(tmp_path / "by_loss")
    by_loss = ablate.load_sweep(write_sweep(tmp_path / "by_loss",
                                            SWEEP.replace("seeds: [0]", "seeds: [5]\nselect: val_loss")))
    plant_seed_results(by_loss, {("attn", None): [0.8]}, first_seed=5)
    done = os.path.join(ablate.run_dir(by_loss, "attn", 5), "result.json")
    with open(done) as f:
        result = json.load(f)
    result["final"]["val_loss"] = 1.0
    with open(done, "w") as f:
        json.dump(result, f)
    assert trained_length.main([sweep["path"], by_loss["path"], "--only", "attn"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {by_loss['path']} compares val_loss and {sweep['path']} "
                                               "val_acc: pool sweeps of one metric (their select:, or seed_stats.py's "
                                               "--metric)")
