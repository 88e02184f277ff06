"""KV policies of the engine's global layers (SPEC 11): a budget that holds the whole context equals
the full cache; each policy keeps at most its budget; quest reading every page equals full; offload's
pool lives in a file and reads only the selected pages."""
import pytest
import torch

from engine import Engine, EngineError
from tests.test_engine import GLOBAL, KINDS, MLA, check_contract, requests
from tests.test_model import make_model

ROPE_SINKS = {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "sinks": True}
MODELS = {"attn": ({"g": GLOBAL, "kda": KINDS["kda"]}, ["kda", "g"]),
          "attn_sinks": ({"g": ROPE_SINKS, "w": KINDS["attn_window"]}, ["w", "g"]),
          "mla": ({"m": MLA}, ["m", "m"])}
SHAPES = [(5, 9), (37, 4), (1, 12), (20, 20)]
POLICIES = ["streaming", "h2o", "snapkv", "quest", "offload"]


def serve(model, policy, budget, shapes=SHAPES, **kw):
    engine = Engine(model, max_batch=3, prefill_chunk=8, block_size=4, kv_policy=policy, kv_budget=budget,
                    keep_logits=True, **kw)
    return engine, engine.run(requests(shapes))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_budget_holding_everything_equals_full(policy, name):
    model = make_model(MODELS[name][0], pattern=MODELS[name][1], n_layer=2)
    _, reqs = serve(model, policy, 40)  # 40 >= the longest context (37 + 4)
    check_contract(model, reqs)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
def test_evicting_policies_keep_at_most_budget(policy):
    model = make_model(*MODELS["attn"], n_layer=2)
    engine = Engine(model, max_batch=2, prefill_chunk=8, block_size=4, kv_policy=policy, kv_budget=12)
    kept = []
    real = engine._forward

    def spy(reqs, idx):
        out = real(reqs, idx)
        kept.extend(len(st["pos"]) for r in reqs if r.n_done >= len(r.prompt) for st in r.policy.values())
        return out
    engine._forward = spy
    reqs = engine.run(requests([(30, 20), (9, 25)]))
    assert all(len(r.out) == r.max_new_tokens for r in reqs)
    assert max(kept) == 12 and len(kept) > 40
    if policy == "streaming":  # the sinks stay, and a streaming cache never sees positions > budget
        assert reqs[0].policy[1]["pos"][:4].tolist() == [0, 1, 2, 3]


def test_quest_reads_fewer_pages_and_offload_lives_in_a_file():
    model = make_model(*MODELS["attn"], n_layer=2)
    engine, reqs = serve(model, "offload", 8, shapes=[(37, 6)])
    assert all(len(r.out) == 6 for r in reqs)
    store = engine.groups[None].store[1]
    assert store["k"].untyped_storage().filename is not None  # memory-mapped (the slower tier)
    # 5 decode steps (the first token comes from the prefill) x 2 kv heads x 2 pages (budget 8 / block 4)
    assert engine.policy.pages_read == 5 * 2 * 2


def test_bad_budget():
    model = make_model(*MODELS["attn"], n_layer=2)
    with pytest.raises(EngineError, match="kv_budget must be an integer >= 1 for kv_policy h2o"):
        Engine(model, kv_policy="h2o")
    with pytest.raises(EngineError, match="kv_policy must be one of"):
        Engine(model, kv_policy="lru")


def test_a_policy_on_a_model_it_cannot_apply_to_is_refused():
    """A model without a global attention layer (windowed attention, KDA, DSA's MLA) has nothing for a KV policy
    to evict or select: `--kv_policy snapkv` was accepted and changed nothing."""
    model = make_model({"w": KINDS["attn_window"], "kda": KINDS["kda"]}, pattern=["w", "kda"], n_layer=2)
    for policy in POLICIES:
        with pytest.raises(EngineError, match=rf"kv_policy {policy}: this model has no global attention layer "
                                              r"\(attn without a window, dense mla\) .*\(its layers: attn, kda\)"):
            Engine(model, kv_policy=policy, kv_budget=8)
    assert Engine(model).run(requests([(5, 3)]))[0].error is None        # kv_policy full serves it


def test_selection_errors_vanish_when_everything_is_read():
    import evals
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 40, 4, 8, generator=g), torch.randn(1, 40, 2, 8, generator=g), torch.randn(1, 40, 2, 8, generator=g)
    errs = evals.attention_selection_errors(q, k, v, 8 ** -0.5, torch.randn(4, generator=g), 48, page=4, n_last=16)
    assert max(errs.values()) < 1e-6
    errs = evals.attention_selection_errors(q, k, v, 8 ** -0.5, None, 8, page=4, n_last=16)
    assert min(errs.values()) > 1e-3 and errs["exact_topk"] <= errs["sinks+window"]


def test_kv_policies_eval_on_mqar():
    import evals
    from tests.test_evals import GLOBAL, make
    model, cfg = make(["g", "g"], {"g": GLOBAL}, seq_len=24)
    out = evals.eval_kv_policies(model, cfg, policies=("streaming", "quest"), budgets=(8, 48), n_seqs=2, block_size=4)
    rows = {(r.get("policy"), r["budget"]): r for r in out["rows"]}
    assert rows[("quest", 48)]["acc"] == rows[("streaming", 48)]["acc"] == out["acc_full"]  # nothing dropped
    assert rows[(None, 48)]["err_quest"] < 1e-6 and rows[(None, 8)]["err_quest"] > 0
    assert rows[("streaming", 8)]["cache_kB"] < out["cache_kB_full"]
