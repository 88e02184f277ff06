"""studies/: the MQAR accuracy-vs-length and attention-sink scripts on a tiny trained sweep."""
import os
import re

import ablate
from studies import attention_sinks, mqar_length
from test_ablate import GRID, write_sweep


def test_studies_on_a_tiny_sweep(tmp_path, capsys):
    sweep = ablate.load_sweep(write_sweep(tmp_path, GRID.replace("seeds: [0, 1]", "seeds: [0]")))
    ablate.run_sweep(sweep, log=lambda m: None)                   # attn at 2 lrs, stopped at step 6
    png = str(tmp_path / "len.png")
    assert mqar_length.main([sweep["path"], "--lengths", "12", "24", "48", "--n_batches", "1", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| variant | best lr | seeds | T = 12 | T = 24 (train) | T = 48 |" in out and "| attn | 0.00" in out
    assert os.path.getsize(png) > 1000
    run = ablate.run_dir(sweep, "attn", 0, 1e-3)
    png = str(tmp_path / "sinks.png")
    assert attention_sinks.main([run, "--budgets", "6", "8", "--factor", "1", "--n_seqs", "2", "--skip", "4", "--out", png]) == 0
    out = capsys.readouterr().out
    assert "| step | key 0, layer 0 | key 0, layer 1 | strongest head, layer 0 |" in out and "heads > 0.3 |" in out and "| 6 |" in out and "| 6 |" in out and "| 8 |" in out and "window only" in out
    assert os.path.getsize(png) > 1000
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
