"""The Triton kernels as torch.library ops (hybrid::*): torch.library.opcheck on every registration
(schema, fake/meta impl against the real one, registered autograd, AOT dispatch), on CPU tensors under
the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), and a whole model on the triton
backend compiled with fullgraph=True (no graph break) equal to eager. Shapes are tiny: the interpreter
is slow.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import kernels
from kernels import triton_attention, triton_delta_rule, triton_paged, triton_sparse  # noqa: F401 (registers)
from model import GPT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from gpu_check import compile_model_config  # noqa: E402

OPS = torch.ops.hybrid


def check(op, args, test_utils=None):
    result = opcheck(op, args) if test_utils is None else opcheck(op, args, test_utils=test_utils)
    assert all(v == "SUCCESS" for v in result.values()), result


def randn(*shape, grad=True, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))
    return x.requires_grad_(grad)


@pytest.mark.parametrize("packed", [False, True])
def test_attention_ops(packed):
    q, k, v, sinks = randn(1, 24, 4, 16), randn(1, 24, 2, 16), randn(1, 24, 2, 8), randn(4)
    cu = torch.tensor([0, 9, 24]) if packed else None
    docs = triton_attention._doc_bounds(cu, 24)
    window = None if packed else 7
    check(OPS.attn_fwd.default, (q, k, v, sinks, window, 0.3, *docs))
    o, lse2 = OPS.attn_fwd(q, k, v, sinks, window, 0.3, *docs)
    plain = [x.detach() for x in (q, k, v, sinks, o, lse2)]
    check(OPS.attn_bwd.default, (torch.randn_like(o), *plain[:3], *plain[4:], plain[3], window, 0.3, *docs))


FAST = ("test_schema", "test_faketensor")  # the interpreted delta rule is slow: its full opcheck is marked slow


def test_delta_rule_ops_fake():
    delta_rule_ops(False, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_delta_rule_ops(packed):
    delta_rule_ops(packed)


def delta_rule_ops(packed, test_utils=None):
    B, T, H, K, V = 1, 20, 2, 16, 8
    q, k = (F.normalize(randn(B, T, H, K, grad=False, seed=s), dim=-1).requires_grad_() for s in (1, 2))
    v, beta = randn(B, T, H, V), torch.rand(B, T, H).requires_grad_()
    g = (-0.1 * torch.rand(B, T, H, K)).requires_grad_()
    h0 = None if packed else randn(B, H, K, V)
    doc = triton_delta_rule._doc_rows(torch.tensor([0, 7, T]), 64) if packed else None
    args = (q, k, v, g, beta, 0.25, h0, not packed, doc)
    check(OPS.delta_rule_fwd.default, args, test_utils)
    o, hT, *saved = OPS.delta_rule_fwd(*args)
    d_final = None if packed else torch.randn_like(hT)
    check(OPS.delta_rule_bwd.default, (q.detach(), k.detach(), v.detach(), beta.detach(), torch.float32, 0.25,
                                       [s.detach() for s in saved], torch.randn_like(o), d_final, doc), test_utils)


def test_delta_rule_step_op():
    B, T, H, K, V = 2, 3, 2, 16, 8
    q, k = (F.normalize(randn(B, T, H, K, grad=False, seed=s), dim=-1) for s in (1, 2))
    v, beta, g = randn(B, T, H, V, grad=False), torch.rand(B, T, H), -0.1 * torch.rand(B, T, H)
    check(OPS.fused_recurrent_delta_rule.default, (q, k, v, g, beta, randn(B, H, K, V, grad=False), 0.25))


def test_sparse_ops():
    B, T, S, H, dv, dr = 1, 6, 10, 2, 16, 8
    q, kv = randn(B, T, H, dv + dr), randn(B, S, dv + dr)
    idx = torch.randint(-1, S, (B, T, 5), generator=torch.Generator().manual_seed(0))
    check(OPS.sparse_mla_fwd.default, (q, kv, idx, dv, 0.2))
    o, lse2 = OPS.sparse_mla_fwd(q, kv, idx, dv, 0.2)
    check(OPS.sparse_mla_bwd.default, (torch.randn_like(o), q.detach(), kv.detach(), idx, o.detach(), lse2, dv, 0.2))
    check(OPS.index_topk.default, (randn(B, T, 2, 16, grad=False), randn(B, T, 2, grad=False),
                                   randn(B, S, 16, grad=False), 4))
    qn, kn, vn = randn(B, T, 4, 16), randn(B, S, 2, 16), randn(B, S, 2, 8)
    bi = torch.tensor([0, 1, -1]).expand(B, T, 2, 3).contiguous()
    check(OPS.block_sparse_fwd.default, (qn, kn, vn, bi, 4, 0.25))
    o, lse2 = OPS.block_sparse_fwd(qn, kn, vn, bi, 4, 0.25)
    check(OPS.block_sparse_bwd.default, (torch.randn_like(o), qn.detach(), kn.detach(), vn.detach(), bi,
                                         o.detach(), lse2, 4, 0.25))


def test_paged_decode_op():
    B, Hq, Hkv, bs, D = 2, 4, 2, 4, 16
    pool_k, pool_v = randn(6, bs, Hkv, D, grad=False), randn(6, bs, Hkv, D, grad=False)
    table = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    lens = torch.tensor([9, 5], dtype=torch.int32)
    check(OPS.paged_decode.default, (randn(B, 1, Hq, D, grad=False), pool_k, pool_v, table, lens, 13,
                                     randn(Hq, grad=False), 0.25))


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [["kda", "mla"], ["gdn", "attn"], ["nsa"], ["dsa"]])
def test_triton_model_compiles_fullgraph(pattern):
    """A hybrid model on the triton backend compiles with fullgraph=True (no graph break: every kernel is
    one registered op) and its loss and gradients equal eager's. aot_eager: the graph capture, fake
    impls and registered autograd are what is tested, not Inductor's code generation."""
    cfg = compile_model_config(pattern)            # d 32, 2 heads, vocab 32: the GPU check's models, smaller
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(m):
        model.zero_grad(set_to_none=True)
        _, loss = m(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(compiled)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, ge in zip(grads, eager_grads):
        torch.testing.assert_close(g, ge, rtol=1e-5, atol=1e-6)
