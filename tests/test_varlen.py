"""Packed documents (varlen, SPEC 0.1 / 0.3): a packed forward equals running every document alone.

Documents of lengths {1, 2, 3, 63, 64, 65, 130} are laid end to end in one row (boundaries inside a
64-chunk and inside a query/key tile, documents shorter than the conv width); the packed logits and
ALL parameter gradients equal the separate runs (fp32, <= 1e-5), per mixer kind and backend; the
ops alone likewise, forward and backward; reversing the document order changes no document's
output; bad cu_seqlens are refused with one clear error.
"""
import pytest
import torch
import torch.nn.functional as F

import kernels
from tests.test_model import make_model

LENS = [1, 2, 3, 63, 64, 65, 130]
SMALL_LENS = [1, 2, 3, 58, 70]  # the interpreter's default: boundaries inside a chunk/tile, a chunk crossed
TOL = 1e-5


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def docs(lens):
    cu = cu_of(lens).tolist()
    return list(zip(cu[:-1], cu[1:]))


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------ ops

def check_op_packed_equals_separate(op, inputs, lens, ref_op=None):
    """op(*inputs, cu_seqlens) on the packed row == ref_op (default op) on every document's slice,
    forward and backward. inputs: [1, N, ...] tensors sliced in time, then per-head tensors (not sliced).
    The interpreted Triton ops take the torch op as the separate reference (kernel == reference is
    tested unpacked in test_triton_*.py), which keeps the interpreter's work to the packed run."""
    ref_op = ref_op or op
    timed = [x for x in inputs if x.dim() >= 3]
    params = [x.detach().requires_grad_() for x in inputs]
    out = op(*params, cu_seqlens=cu_of(lens))
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), params)
    sep_params = [x.detach().requires_grad_() for x in inputs]
    sep = torch.cat([ref_op(*[x[:, a:b] if x.dim() >= 3 else x for x in sep_params]) for a, b in docs(lens)], 1)
    sep_grads = torch.autograd.grad((sep * w).sum(), sep_params)
    assert len(timed) >= 3
    assert (out - sep).abs().max().item() <= TOL
    assert max_diff(grads, sep_grads) <= TOL


ATTN_CASES = {"global": dict(), "window": dict(window=5), "sinks": dict(sinks=True),
              "gqa_window_sinks": dict(window=70, sinks=True, hkv=1)}


def attn_inputs(N, sinks=False, hkv=2, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ins = [torch.randn(1, N, 4, 16, generator=g), torch.randn(1, N, hkv, 16, generator=g),
           torch.randn(1, N, hkv, 8, generator=g)]
    return ins + ([torch.randn(4, generator=g)] if sinks else []), window


def delta_inputs(N, per_channel, seed=0, K=16, V=16, H=2):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, N, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, N, H, K, generator=g), dim=-1)
    v = torch.randn(1, N, H, V, generator=g)
    gate = -F.softplus(torch.randn(1, N, H, K, generator=g) if per_channel else torch.randn(1, N, H, generator=g))
    beta = torch.sigmoid(torch.randn(1, N, H, generator=g))
    return [q, k, v, gate, beta]


def attention_op(backend, window):
    def op(q, k, v, sinks=None, cu_seqlens=None):
        return kernels.attention(q, k, v, window=window, sinks=sinks, backend=backend, cu_seqlens=cu_seqlens)
    return op


def delta_op(backend):
    def op(q, k, v, g, beta, cu_seqlens=None):
        return kernels.delta_rule(q, k, v, g, beta, backend=backend, cu_seqlens=cu_seqlens)[0]
    return op


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_op_torch(case):
    ins, window = attn_inputs(sum(LENS), **ATTN_CASES[case])
    check_op_packed_equals_separate(attention_op("torch", window), ins, LENS)


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_delta_rule_op_torch(per_channel):
    check_op_packed_equals_separate(delta_op("torch"), delta_inputs(sum(LENS), per_channel), LENS)


def test_linear_attention_op():
    def op(q, k, v, cu_seqlens=None):
        return kernels.linear_attention(q, k, v, cu_seqlens=cu_seqlens)[0]
    check_op_packed_equals_separate(op, delta_inputs(sum(LENS), True)[:3], LENS)


# ------------------------------------------------------------------------------------------ model

def mla(**kw):
    return {"kind": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
            "v_head_dim": 6, **kw}


def dsa(stage):
    return {"n_heads": 3, "head_dim": 8, "rope_dim": 4, "top_k": 5, "stage": stage}


MODELS = {
    "attn_global_gqa": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2},
    "attn_window_sinks": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1, "window": 7, "sinks": True},
    "mla": mla(q_lora_rank=12),
    "mla_dsa_warmup": mla(q_lora_rank=12, dsa=dsa("dense_warmup")),
    "mla_dsa_sparse": mla(dsa=dsa("sparse")),
    "kda": {"kind": "kda", "n_heads": 2, "head_dim": 16},
    "gdn": {"kind": "gdn", "n_heads": 2, "head_dim": 16},
    "linear": {"kind": "linear", "n_heads": 2, "head_dim": 16},
    # NSA with small blocks: documents of 63..130 tokens hold many compressed and selection blocks, and
    # n_sel = 5 leaves 2 blocks to the importance choice (block 0 and 2 local are forced)
    "nsa": {"kind": "nsa", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "cmp_block": 4, "cmp_stride": 2,
            "sel_block": 8, "n_sel": 5, "window": 6},
    "mfa": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12},
    "mfa_kr": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12, "key_reuse": True},
}


def objective(model, idx, cu_seqlens, w):
    """sum(logits * w) + every auxiliary loss as a sum over tokens (the mean times the token count)."""
    logits, _ = model(idx, cu_seqlens=cu_seqlens)
    total = (logits * w).sum()
    for block in model.blocks:
        aux = getattr(block.mixer, "aux_loss", None)
        if aux is not None:
            total = total + aux[1] * idx.shape[1]
    return logits, total


def check_model_packed_equals_separate(model, lens, seed=0, ref=None):
    """ref: a model with the same weights that runs the separate documents (default: model)."""
    ref = ref or model
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    idx = torch.randint(0, model.config.vocab_size, (1, N), generator=g)
    w = torch.randn(1, N, model.config.vocab_size, generator=g) / N
    params = [p for p in model.parameters()]
    logits, total = objective(model, idx, cu_of(lens), w)
    grads = torch.autograd.grad(total, params, allow_unused=True)
    sep_logits, sep_total = [], 0.0
    for a, b in docs(lens):
        lg, tot = objective(ref, idx[:, a:b], None, w[:, a:b])
        sep_logits.append(lg)
        sep_total = sep_total + tot
    sep_grads = torch.autograd.grad(sep_total, list(ref.parameters()), allow_unused=True)
    assert (logits - torch.cat(sep_logits, 1)).abs().max().item() <= TOL
    for p, a, b in zip(model.named_parameters(), grads, sep_grads):
        assert (a is None) == (b is None), p[0]
        if a is not None:
            assert (a - b).abs().max().item() <= TOL, p[0]
    return idx, logits


@pytest.mark.parametrize("name", list(MODELS))
def test_model_packed_equals_separate_torch(name):
    model = make_model({name: MODELS[name]}, n_layer=2, backend="torch").train()
    check_model_packed_equals_separate(model, LENS)


@pytest.mark.parametrize("name", ["attn_window_sinks", "kda", "nsa"])
def test_reversed_order_same_documents(name):
    model = make_model({name: MODELS[name]}, n_layer=2, backend="torch")
    N = sum(LENS)
    idx = torch.randint(0, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx, cu_seqlens=cu_of(LENS))[0]
        pieces = [idx[:, a:b] for a, b in docs(LENS)]
        rev = model(torch.cat(pieces[::-1], 1), cu_seqlens=cu_of(LENS[::-1]))[0]
    rev_pieces = dict(zip(range(len(LENS))[::-1], [rev[:, a:b] for a, b in docs(LENS[::-1])]))
    for i, (a, b) in enumerate(docs(LENS)):
        assert (logits[:, a:b] - rev_pieces[i]).abs().max().item() <= TOL


def test_conv_does_not_leak_shorter_than_width():
    """Documents of 1, 2, 3 tokens (conv width 4): the packed conv equals the separate one."""
    model = make_model({"kda": {**MODELS["kda"], "conv_size": 4}}, n_layer=1, backend="torch")
    check_model_packed_equals_separate(model, [1, 2, 3, 1, 5])


# ------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("cu, why", [
    ([1, 5, 10], "start at 0"), ([0, 5, 9], "end at"), ([0, 6, 5, 10], "never decrease"),
    ([0.0, 10.0], "int32"), ([[0, 10]], "1-D")])
def test_bad_cu_seqlens(cu, why):
    model = make_model({"kda": MODELS["kda"]}, n_layer=1, backend="torch")
    idx = torch.zeros(1, 10, dtype=torch.long)
    cu = torch.tensor(cu)
    with pytest.raises(ValueError, match=why):
        model(idx, cu_seqlens=cu)
    q = torch.randn(1, 10, 2, 16)
    with pytest.raises(ValueError, match=why):
        kernels.attention(q, q, q, cu_seqlens=cu)
    with pytest.raises(ValueError, match=why):
        kernels.delta_rule(q, q, q, q[..., 0].sigmoid().log(), q[..., 0].sigmoid(), cu_seqlens=cu)


def test_packed_refuses_batch_state_and_cache():
    cu = cu_of([4, 6])
    model = make_model({"kda": MODELS["kda"]}, n_layer=1, backend="torch")
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.zeros(2, 10, dtype=torch.long), cu_seqlens=cu)
    q = torch.randn(1, 10, 2, 16)
    g, beta = q[..., 0].sigmoid().log(), q[..., 0].sigmoid()
    with pytest.raises(ValueError, match="initial_state / output_final_state"):
        kernels.delta_rule(q, q, q, g, beta, output_final_state=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state / output_final_state"):
        kernels.linear_attention(q, q, q, initial_state=torch.zeros(1, 2, 16, 16), cu_seqlens=cu)
    with pytest.raises(ValueError, match="same length"):
        kernels.attention(q[:, :4], q, q, cu_seqlens=cu)
    cache = model.new_cache(1, 10)
    with pytest.raises(ValueError, match="cache=None"):
        model.blocks[0](model.wte(torch.zeros(1, 10, dtype=torch.long)), cache.layers[0], 0, cu_seqlens=cu)


# ------------------------------------------------------------------------------------------ triton (interpreted on CPU)
# The interpreter is slow: the default suite runs SMALL_LENS with few heads; LENS runs under -m slow.

SLOW = pytest.mark.slow


@pytest.mark.parametrize("case, lens", [("gqa_window_sinks", SMALL_LENS)] + [
    pytest.param(c, LENS, marks=SLOW) for c in ATTN_CASES])
def test_attention_op_triton(case, lens):
    ins, window = attn_inputs(sum(lens), **ATTN_CASES[case])
    check_op_packed_equals_separate(attention_op("triton", window), ins, lens, attention_op("torch", window))


@pytest.mark.parametrize("per_channel, lens, H", [(True, SMALL_LENS, 1), pytest.param(False, SMALL_LENS, 1, marks=SLOW),
                                                  pytest.param(True, LENS, 2, marks=SLOW),
                                                  pytest.param(False, LENS, 2, marks=SLOW)])
def test_delta_rule_op_triton(per_channel, lens, H):
    check_op_packed_equals_separate(delta_op("triton"), delta_inputs(sum(lens), per_channel, H=H), lens,
                                    delta_op("torch"))


@pytest.mark.parametrize("name, lens", [("attn_window_sinks", SMALL_LENS), ("kda", SMALL_LENS)] + [
    pytest.param(n, LENS, marks=SLOW) for n in ("attn_global_gqa", "attn_window_sinks", "kda", "gdn", "nsa", "mfa")])
def test_model_packed_equals_separate_triton(name, lens):
    """Packed on the Triton backend == separate documents on the torch backend (same weights)."""
    packed = make_model({name: MODELS[name]}, n_layer=1, backend="triton").train()
    ref = make_model({name: MODELS[name]}, n_layer=1, backend="torch").train()
    check_model_packed_equals_separate(packed, lens, ref=ref)


# ------------------------------------------------------------------------------------------ data.pack

EOT_ID = 50


def write_doc_corpus(folder, doc_lens, vocab=51, seed=0):
    """train/val shards of documents of the given lengths, each followed by EOT_ID (ids 0..49 inside)."""
    import numpy as np
    from data.tokens import write_tokens
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.append(rng.integers(0, EOT_ID, n), EOT_ID) for n in doc_lens])
    for split in ("train", "val"):
        write_tokens(folder / f"{split}_000.bin", stream, vocab, len(stream), EOT_ID)
    return stream


def test_packed_loader_rows_are_whole_documents(tmp_path):
    """Rows hold whole documents (each opened by the EOT before it), cut only at EOTs; a document
    longer than a row becomes row-sized pieces; every lane token is used once; padding is ignored."""
    from data.tokens import PackedLoader, open_split
    stream = write_doc_corpus(tmp_path, [3, 5, 40, 7, 2, 9, 1, 4, 30, 6] * 4)
    T, B = 16, 2
    loader = PackedLoader(open_split(str(tmp_path), "train"), B, T)
    lane = (len(stream) - 1) // B
    seen = [[] for _ in range(B)]
    for _ in range(6):
        x, y, cu = loader.next_batch()
        assert x.shape == y.shape == (1, B * T) and cu.dtype == torch.int32
        cu = cu.tolist()
        assert cu[0] == 0 and cu[-1] == B * T and all(a < b for a, b in zip(cu, cu[1:]))
        for r in range(B):
            xr, yr = x[0, r * T:(r + 1) * T], y[0, r * T:(r + 1) * T]
            used = int((yr >= 0).sum())
            assert torch.equal(yr[used:], torch.full((T - used,), -1))          # padding only at the end
            start = r * lane + sum(len(s) for s in seen[r])
            assert torch.equal(xr[:used], torch.from_numpy(stream[start:start + used].astype("int64")))
            assert torch.equal(yr[:used], torch.from_numpy(stream[start + 1:start + used + 1].astype("int64")))
            assert yr[used - 1] == EOT_ID or used == T                            # whole documents, or a piece
            inside = [c - r * T for c in cu if r * T < c < r * T + used]          # boundaries inside the row ...
            assert inside == [i for i in range(1, used) if xr[i] == EOT_ID]      # ... are exactly its EOTs
            seen[r].append(xr[:used].tolist())
    assert any(len(piece) == T for row in seen for piece in row)                 # a long document was cut


def test_packed_loader_state_round_trip(tmp_path):
    from data.tokens import DataError, PackedLoader, TokenLoader, open_split
    write_doc_corpus(tmp_path, [3, 5, 40, 7, 2, 9, 1, 4, 30, 6] * 20)
    shards = open_split(str(tmp_path), "train")
    a = PackedLoader(shards, 2, 16)
    for _ in range(30):                              # past the end of the shard: wraps to the next (itself)
        a.next_batch()
    state = a.state_dict()
    want = [a.next_batch() for _ in range(25)]
    b = PackedLoader(shards, 2, 16)
    b.load_state_dict(state)
    for w, got in zip(want, (b.next_batch() for _ in range(25))):
        assert all(torch.equal(p, q) for p, q in zip(w, got))
    with pytest.raises(DataError, match="packed run"):
        PackedLoader(shards, 2, 16).load_state_dict(TokenLoader(shards, 2, 16).state_dict())


def test_pack_refused_for_mqar_and_corpus_without_eot(tmp_path):
    import numpy as np
    from config import from_raw
    from data.tokens import DataError, PackedLoader, open_split, write_tokens
    from model import ConfigError
    with pytest.raises(ConfigError, match="data.pack"):
        from_raw({"data": {"kind": "mqar", "pack": True}})
    write_tokens(tmp_path / "train_000.bin", np.arange(500) % 40, 40, 500)
    with pytest.raises(DataError, match="end-of-text"):
        PackedLoader(open_split(str(tmp_path), "train"), 2, 16)


def test_train_with_pack_resumes_exactly(tmp_path):
    """data.pack end to end: train (KDA + sliding-window attention) with packed rows; an interrupted and
    resumed run equals the uninterrupted one (losses and weights)."""
    from config import from_raw
    from train import latest_checkpoint, load_checkpoint, train
    from tests.test_train import read_metrics
    write_doc_corpus(tmp_path / "data", [3, 5, 40, 7, 2, 9, 1, 4, 30, 6] * 30)

    def cfg(out):
        return from_raw({
            "model": {"vocab_size": 51, "d_model": 32, "n_layer": 2, "pattern": ["k", "a"], "backend": "torch",
                      "layers": {"k": {"kind": "kda", "n_heads": 2, "head_dim": 16},
                                 "a": {"kind": "attn", "n_heads": 2, "window": 8, "sinks": True}},
                      "mlp": {"hidden": 64}},
            "data": {"kind": "bin", "dir": str(tmp_path / "data"), "pack": True},
            "train": {"max_steps": 8, "batch_size": 2, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                      "log_interval": 2, "eval_interval": 4, "eval_batches": 1, "ckpt_interval": 4,
                      "sample_tokens": 0, "out_dir": str(out)}})
    train(cfg(tmp_path / "full"), quiet=True)
    train(cfg(tmp_path / "part"), quiet=True, stop_at=4)
    train(cfg(tmp_path / "part"), resume=True, quiet=True)
    a = [r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r]
    b = [r["loss"] for r in read_metrics(tmp_path / "part") if "loss" in r]
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (a, b)
    assert any("val_loss" in r for r in read_metrics(tmp_path / "full"))
    wa = load_checkpoint(latest_checkpoint(str(tmp_path / "full")))["model"]
    wb = load_checkpoint(latest_checkpoint(str(tmp_path / "part")))["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
