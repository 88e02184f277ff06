"""studies/: the MQAR accuracy-vs-length and attention-sink scripts on a tiny trained sweep."""
import os

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
