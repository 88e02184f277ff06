"""Token files, the stdlib corpus, MQAR, and clear errors for bad data."""
import os

import numpy as np
import pytest
import torch

from config import from_raw
from data import TextData, make_dataset
from data.mqar import mqar_accuracy, mqar_batch, mqar_mix_batch
from data.stdlib import EOT, decode, encode, prepare_stdlib
from data.tokens import HEADER_BYTES, DataError, TokenFile, TokenLoader, open_split, write_tokens
from model import ConfigError


def write_corpus(folder, n=5000, vocab=100):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    write_tokens(os.path.join(folder, "train_000.bin"), rng.integers(0, vocab, n), vocab, n)
    write_tokens(os.path.join(folder, "val_000.bin"), rng.integers(0, vocab, n // 2), vocab, n)


def test_token_file_roundtrip_and_loader_position(tmp_path):
    tokens = np.arange(1000) % 300
    write_tokens(tmp_path / "train_000.bin", tokens, 300, 1000)
    f = TokenFile(str(tmp_path / "train_000.bin"))
    assert f.vocab_size == 300 and f.n_tokens == 1000 and np.array_equal(f.tokens, tokens)
    loader = TokenLoader([f], batch_size=2, seq_len=8)
    x, y = loader.next_batch()  # two lanes of (1000 - 1) // 2 = 499 tokens: rows start at 0 and 499
    positions = torch.stack([torch.arange(8), torch.arange(499, 507)])
    assert torch.equal(x, positions % 300) and torch.equal(y, (positions + 1) % 300)
    assert torch.equal(loader.next_batch()[0][:, 0], torch.tensor([8, 507 % 300]))  # each lane read in order
    state = loader.state_dict()
    x2, _ = loader.next_batch()
    loader.load_state_dict(state)
    assert torch.equal(loader.next_batch()[0], x2)


def test_loader_ranks_split_the_global_batch(tmp_path):
    write_tokens(tmp_path / "train_000.bin", np.arange(5000) % 200, 200, 5000)
    shards = open_split(str(tmp_path), "train")
    whole = TokenLoader(shards, 4, 8).next_batch()[0]
    halves = [TokenLoader(shards, 2, 8, rank=r, world=2).next_batch()[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), whole)


def test_bos_rows_start_with_end_of_text_and_keep_every_target(tmp_path):
    """data.bos: each row is [EOT, its first T - 1 targets]; the targets are exactly those of the plain
    loader (every token is predicted once), and evals' text windows start the same way."""
    write_tokens(tmp_path / "train_000.bin", np.arange(5000) % 200, 201, 5000, eot_id=200)
    shards = open_split(str(tmp_path), "train")
    plain, bos = TokenLoader(shards, 2, 8), TokenLoader(shards, 2, 8, bos=True)
    for _ in range(3):
        (x0, y0), (x, y) = plain.next_batch(), bos.next_batch()
        assert torch.equal(y, y0) and (x[:, 0] == 200).all() and torch.equal(x[:, 1:], y[:, :-1])
    write_tokens(tmp_path / "none.bin", np.arange(100), 200, 100)
    with pytest.raises(DataError, match="data.bos starts rows with the end-of-text token and this token file has none"):
        TokenLoader([TokenFile(str(tmp_path / "none.bin"))], 2, 8, bos=True)
    raw = {"model": {"vocab_size": 257, "d_model": 16, "n_layer": 1, "pattern": ["a"],
                     "layers": {"a": {"kind": "attn", "n_heads": 2}}},
           "data": {"kind": "stdlib", "bos": True}, "train": {"batch_size": 2, "seq_len": 16}}
    import evals
    x, y = evals._text_batch(from_raw(raw), 2, 16)
    assert (x[:, 0] == 256).all() and torch.equal(x[:, 1:], y[:, :-1])
    from sample import make_codec
    assert make_codec(from_raw(raw), None)[0]("ab") == [256, 97, 98]      # sampling prompts start the same way
    for data, msg in [({"kind": "mqar", "bos": True}, "data.bos: must be false for mqar"),
                      ({"kind": "stdlib", "bos": True, "pack": True}, "data.bos: must be false with data.pack")]:
        with pytest.raises(ConfigError, match=msg):
            from_raw({**raw, "data": data})


def test_uint32_for_large_vocab(tmp_path):
    write_tokens(tmp_path / "t.bin", [0, 70000, 5], 100_000, 3)
    assert TokenFile(str(tmp_path / "t.bin")).tokens.dtype == np.uint32


def test_missing_corrupt_and_truncated_files(tmp_path):
    with pytest.raises(DataError, match="token file not found"):
        TokenFile(str(tmp_path / "nope.bin"))
    (tmp_path / "junk.bin").write_bytes(b"x" * 10)
    with pytest.raises(DataError, match="shorter than its header"):
        TokenFile(str(tmp_path / "junk.bin"))
    (tmp_path / "junk2.bin").write_bytes(b"x" * (HEADER_BYTES + 10))
    with pytest.raises(DataError, match="bad magic"):
        TokenFile(str(tmp_path / "junk2.bin"))
    write_tokens(tmp_path / "cut.bin", np.arange(100), 128, 100)
    data = (tmp_path / "cut.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-7])
    with pytest.raises(DataError, match="corrupt token file"):
        TokenFile(str(tmp_path / "cut.bin"))
    with pytest.raises(DataError, match="no train_"):
        open_split(str(tmp_path / "empty"), "train")


def test_token_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(DataError, match=r"token ids must lie in \[0, 10\)"):
        write_tokens(tmp_path / "bad.bin", [1, 2, 10], 10, 3)
    write_corpus(str(tmp_path / "c"), vocab=100)
    with pytest.raises(DataError, match="beyond model.vocab_size=64"):
        TextData(str(tmp_path / "c"), 64, 2, 16)


def test_too_little_data_for_a_batch(tmp_path):
    write_corpus(str(tmp_path / "c"), n=100)
    with pytest.raises(DataError, match=r"no train shard holds one global batch \(521 tokens = .*the largest, "
                                        r"train_000.bin, has 100\)"):
        TextData(str(tmp_path / "c"), 100, 8, 64)


@pytest.mark.parametrize("pack", [False, True])
def test_shards_shorter_than_a_batch_are_skipped_and_named(tmp_path, pack):
    """A shard too short to cut into lanes (a corpus's tail, or a shard data/prepare.py closed before a long
    document) is skipped with a note, not a refusal of the whole corpus; only the shards used count for bpb,
    and a resumed loader continues on the same tokens. A val split that holds no batch is refused at once,
    before any training step."""
    folder = str(tmp_path / "c")
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    for name, n in [("train_000", 40), ("train_001", 3000), ("train_002", 100), ("train_003", 2000),
                    ("val_000", 30), ("val_001", 1000)]:
        write_tokens(os.path.join(folder, name + ".bin"), rng.integers(0, 100, n), 100, n * (2 if n < 200 else 3),
                     eot_id=99)                                     # id 99 ends documents (for data.pack)
    data = TextData(folder, 100, 2, 64, pack=pack)                 # one batch: 2 x 65 + 1 = 131 tokens
    assert [os.path.basename(s.path) for s in data.loader.shards] == ["train_001.bin", "train_003.bin"]
    assert data.notes == ["data: skipping 2 of 4 train shards, shorter than one global batch of 131 tokens "
                          "(train_000.bin, train_002.bin: 140 tokens in all)",
                          "data: skipping 1 of 2 val shards, shorter than one global batch of 131 tokens "
                          "(val_000.bin: 30 tokens in all)"]
    assert data.tokens_per_byte == pytest.approx(1 / 3)             # val_001 alone: 1,000 tokens of 3,000 bytes
    batches = [data.next_batch() for _ in range(30)]                # runs through both shards and wraps around
    state = data.state_dict()
    assert {b[0].shape for b in batches} == {(1, 128) if pack else (2, 64)}
    more = data.next_batch()
    again = TextData(folder, 100, 2, 64, pack=pack)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.next_batch(), more))
    os.remove(os.path.join(folder, "val_001.bin"))
    with pytest.raises(DataError, match=r"no val shard holds one global batch \(131 tokens"):
        TextData(folder, 100, 2, 64, pack=pack)


def test_bin_dataset_from_config(tmp_path):
    write_corpus(str(tmp_path / "c"))
    cfg = from_raw({"model": {"vocab_size": 100, "d_model": 16, "n_layer": 1, "pattern": ["a"],
                              "layers": {"a": {"kind": "attn", "n_heads": 2}}},
                    "data": {"kind": "bin", "dir": str(tmp_path / "c")}, "train": {"batch_size": 2, "seq_len": 16}})
    x, y = make_dataset(cfg).next_batch()
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_stdlib_corpus_is_prepared_once_and_byte_level(tmp_path):
    folder = prepare_stdlib(str(tmp_path / "stdlib"), quiet=True)
    train, val = open_split(folder, "train")[0], open_split(folder, "val")[0]
    assert train.vocab_size == 257 and train.eot_id == EOT
    assert train.n_tokens > 1_000_000 and 0 < val.n_tokens < train.n_tokens / 5
    mtime = os.path.getmtime(os.path.join(folder, "train_000.bin"))
    prepare_stdlib(folder, quiet=True)  # reused, not rewritten
    assert os.path.getmtime(os.path.join(folder, "train_000.bin")) == mtime
    text = decode(train.tokens[:2000].tolist())
    assert len(text) > 100
    assert decode(encode("def f(x):\n")) == "def f(x):\n"


def test_mqar_structure():
    x, y, dist = mqar_batch(4, 64, 8, 64, seed=3)
    for b in range(4):
        keys, values = x[b, 0:16:2], x[b, 1:16:2]
        assert (keys < 32).all() and (keys >= 1).all() and (values >= 32).all()
        labelled = (y[b] >= 0).nonzero().flatten()
        assert len(labelled) == 8 and (labelled >= 16).all()
        for t in labelled:  # the query is a key; its label is that key's value
            i = (keys == x[b, t]).nonzero().item()
            assert y[b, t] == values[i] and dist[b, t] == t - 2 * i
    x2, _, _ = mqar_batch(4, 64, 8, 64, seed=3)
    assert torch.equal(x, x2)
    logits = torch.nn.functional.one_hot(y.clamp(min=0), 64).float()
    assert mqar_accuracy(logits, y) == 1.0
    with pytest.raises(ValueError, match="too short"):
        mqar_batch(1, 20, 8, 64, 0)


def test_mqar_mixture_trains_on_padded_settings_and_evaluates_on_the_target(tmp_path):
    x, y = mqar_mix_batch(64, 128, [[64, 4], [128, 8]], 64, seed=[0, 1])
    short = (y[:, 64:] < 0).all(1) & ((y >= 0).sum(1) == 4)      # (64, 4) rows: 4 queries, zero tail
    long = (y >= 0).sum(1) == 8
    assert (short | long).all() and 16 < short.sum() < 48
    assert (x[short, 64:] == 0).all()
    for b in range(64):   # every labelled position is a key whose value is the label
        n = (y[b] >= 0).sum().item()
        kv = dict(zip(x[b, 0:2 * n:2].tolist(), x[b, 1:2 * n:2].tolist()))
        assert all(kv[x[b, t].item()] == y[b, t].item() for t in (y[b] >= 0).nonzero().flatten())
    with pytest.raises(ValueError, match="mixture length 256 exceeds seq_len=128"):
        mqar_mix_batch(2, 128, [[256, 8]], 64, 0)
    cfg = from_raw({"model": {"vocab_size": 64, "d_model": 16, "n_layer": 1, "pattern": ["a"],
                              "layers": {"a": {"kind": "attn", "n_heads": 2}}},
                    "data": {"kind": "mqar", "n_pairs": 8, "mqar_mix": [[64, 4]]},
                    "train": {"batch_size": 4, "seq_len": 128, "device": "cpu", "out_dir": str(tmp_path)}})
    data = make_dataset(cfg)
    _, y_train = data.next_batch()
    assert ((y_train >= 0).sum(1) == 4).all() and (y_train[:, 64:] < 0).all()    # the mixture
    _, y_val = data.make(4, [0, 10 ** 9])
    assert ((y_val >= 0).sum(1) == 8).all()                                        # the target


TINY_MODEL = {"vocab_size": 64, "d_model": 16, "n_layer": 1, "pattern": ["a"],
              "layers": {"a": {"kind": "attn", "n_heads": 2}}}


def tiny_mqar(tmp_path, data, **train):
    """make_dataset of MQAR (data: the data section's keys) for a one-layer attention model, batch 4."""
    return make_dataset(from_raw({"model": TINY_MODEL, "data": {"kind": "mqar", **data},
                                  "train": {"batch_size": 4, "device": "cpu", "out_dir": str(tmp_path), **train}}))


def test_data_seed_sets_the_batches_apart_from_train_seed(tmp_path):
    """data.seed: the generated training and val batches of that seed, whatever train.seed (which seeds the
    init); null: train.seed's batches."""
    def data_for(train_seed, data_seed):
        return tiny_mqar(tmp_path, {"n_pairs": 8, "seed": data_seed}, seq_len=64, seed=train_seed)

    crossed, same, other = data_for(0, 2), data_for(2, None), data_for(0, None)
    for _ in range(2):
        x, y = crossed.next_batch()
        assert torch.equal(x, same.next_batch()[0]) and not torch.equal(x, other.next_batch()[0])
    assert torch.equal(crossed.make(4, [crossed.seed, 10 ** 9])[0], same.make(4, [same.seed, 10 ** 9])[0])
    assert crossed.seed == same.seed == 2 and other.seed == 0


def test_mqar_mixture_evaluates_each_of_its_settings_as_a_plain_run_would(tmp_path):
    """val_acc_<length>x<pairs> under a mixture == val_acc of a run trained at that setting alone (same
    model, seed and batches); the eval's own setting is not repeated; a plain run reports val_* only."""
    from model import GPT

    def data_for(seq_len, n_pairs, mix):
        return tiny_mqar(tmp_path, {"n_pairs": n_pairs, "mqar_mix": mix}, seq_len=seq_len)

    torch.manual_seed(0)
    model = GPT(from_raw({"model": TINY_MODEL}).model).eval()
    mixed = data_for(128, 8, [[64, 4], [96, 6], [128, 8], [64, 4]]).evaluate(model, 2, "cpu")
    assert sorted(mixed) == ["val_acc", "val_acc_64x4", "val_acc_96x6", "val_loss", "val_loss_64x4", "val_loss_96x6"]
    for suffix, (length, pairs) in {"": (128, 8), "_64x4": (64, 4), "_96x6": (96, 6)}.items():
        alone = data_for(length, pairs, []).evaluate(model, 2, "cpu")
        assert sorted(alone) == ["val_acc", "val_loss"]
        assert mixed[f"val_acc{suffix}"] == alone["val_acc"] and mixed[f"val_loss{suffix}"] == alone["val_loss"]
