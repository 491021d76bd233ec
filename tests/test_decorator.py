"""@dsa_dcp.sparse_attention: a user's function becomes a sparse attention node."""

import math

import pytest
import torch

import dsa_dcp
from dsa_dcp.ops import SPARSE_ATTENTION_OPS


def dense_sparse_attention(q_nope, q_pe, kv, topk, sm_scale):
    """A plain-torch implementation of the contract, written independently of the kernels."""
    dc = q_nope.shape[-1]
    valid = topk >= 0
    rows = kv[topk.clamp(min=0).long()].float()  # [B, K, Dc + Dr]
    scores = torch.einsum("bhc,bkc->bhk", q_nope.float(), rows[..., :dc]) + torch.einsum(
        "bhr,bkr->bhk", q_pe.float(), rows[..., dc:]
    )
    scores = (scores * sm_scale).masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
    return torch.einsum("bhk,bkc->bhc", p, rows[..., :dc]).to(q_nope.dtype), lse


@dsa_dcp.sparse_attention(lse_base="2", empty_lse="+inf")
def base2_attention(q_nope, q_pe, kv, topk, sm_scale):
    """Like FlashMLA/FlashInfer adapters: base-2 LSE and +inf for empty rows."""
    out, lse = dense_sparse_attention(q_nope, q_pe, kv, topk, sm_scale)
    lse = torch.where(torch.isfinite(lse), lse / math.log(2.0), math.inf)
    return out, lse


@dsa_dcp.sparse_attention(empty_lse="nan")
def nan_marked_attention(q_nope, q_pe, kv, topk, sm_scale):
    """The dense softmax (NaN from NaN inputs, as torch gives it), rows with no slot marked by a
    NaN LSE and a NaN out."""
    from dsa_dcp.kernels import sparse_mla_reference

    out, lse = sparse_mla_reference(q_nope, q_pe, kv, topk, sm_scale)
    no_slot = (topk < 0).all(dim=-1)
    return out.masked_fill(no_slot[:, None, None], math.nan), lse.masked_fill(no_slot[:, None], math.nan)


@dsa_dcp.sparse_attention(lse_base="2", empty_lse="+inf")
def inf_marked_attention(q_nope, q_pe, kv, topk, sm_scale):
    """Base-2 LSE, ``+inf`` on rows with no slot, every other row the dense softmax as it is."""
    from dsa_dcp.kernels import sparse_mla_reference

    out, lse = sparse_mla_reference(q_nope, q_pe, kv, topk, sm_scale)
    no_slot = (topk < 0).all(dim=-1)
    return out, torch.where(no_slot[:, None], math.inf, lse / math.log(2.0))


@dsa_dcp.sparse_attention
def wrong_shape_attention(q_nope, q_pe, kv, topk, sm_scale):
    out, lse = dense_sparse_attention(q_nope, q_pe, kv, topk, sm_scale)
    return out[:, :1], lse


@dsa_dcp.sparse_attention
def single_output_attention(q_nope, q_pe, kv, topk, sm_scale):
    return dense_sparse_attention(q_nope, q_pe, kv, topk, sm_scale)[0]


def _inputs(seed, b=5, h=3, dc=8, dr=4, s=40, k=6):
    g = torch.Generator().manual_seed(seed)
    q_nope, q_pe = torch.randn(b, h, dc, generator=g), torch.randn(b, h, dr, generator=g)
    kv = torch.randn(s, dc + dr, generator=g)
    topk = torch.randperm(s, generator=g)[: b * k].view(b, k).int()
    topk[torch.rand(b, k, generator=g) < 0.3] = -1
    topk[0] = -1  # a row with no valid slot
    return q_nope, q_pe, kv, topk


def test_decorated_function_is_a_sparse_attention_op():
    assert base2_attention.op in SPARSE_ATTENTION_OPS
    assert SPARSE_ATTENTION_OPS[base2_attention.op].lse_base == "2"


@pytest.mark.parametrize("seed", [0, 1])
def test_decorated_op_normalizes_to_natural_log_and_empty_rows(seed):
    q_nope, q_pe, kv, topk = _inputs(seed)
    out, lse = base2_attention(q_nope, q_pe, kv, topk, 0.3)
    ref_out, ref_lse = dense_sparse_attention(q_nope.double(), q_pe.double(), kv.double(), topk, 0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.all(lse[0] == -math.inf)
    torch.testing.assert_close(lse[1:], ref_lse[1:].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-5)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("fn", [nan_marked_attention, inf_marked_attention], ids=["nan-mark", "inf-mark"])
def test_only_rows_without_a_slot_are_empty_and_nan_stays_nan(fn):
    """The declared mark empties the rows with no slot; a NaN (or +inf) on a row that has one is
    a result, kept as it is, never taken for the mark: else a DCP merge would drop it."""
    from dsa_dcp.kernels import sparse_mla_reference

    q_nope, q_pe, kv, topk = _inputs(4)
    kv[topk[2, topk[2] >= 0][0]] = math.nan  # a NaN in a KV row row 2 names
    kv[topk[3, topk[3] >= 0][0], -1] = math.inf  # +inf in the rope part of a row row 3 names
    q_pe[3] = q_pe[3].abs()  # ... met by a positive query: a +inf score on every head
    out, lse = fn(q_nope, q_pe, kv, topk, 0.3)
    ref_out, ref_lse = sparse_mla_reference(q_nope.double(), q_pe.double(), kv.double(), topk, 0.3,
                                            compute_dtype=torch.float64)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.all(lse[0] == -math.inf), "no slot: empty"
    assert out[2].isnan().all() and lse[2].isnan().all(), "NaN from the KV stays NaN"
    assert out[3].isnan().all() and torch.isposinf(lse[3]).all(), "+inf from the KV stays +inf"
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_minus_inf_lse_is_empty_and_nothing_else_is():
    from dsa_dcp.ops import normalize_attention_result

    nan, inf = math.nan, math.inf
    topk = torch.tensor([[3, -1], [-1, -1], [3, 4], [5, -1]])
    lse = torch.tensor([[-inf, 1.0], [nan, 2.0], [nan, inf], [1.0, 2.0]])
    out = torch.full((4, 2, 3), nan)
    out[3] = 1.0
    got_out, got_lse = normalize_attention_result(out, lse, topk, "e")
    assert torch.equal(got_lse[:2], torch.tensor([[-inf, 1.0], [-inf, -inf]]))
    assert (got_out[0, 0] == 0).all() and got_out[0, 1].isnan().all() and (got_out[1] == 0).all()
    assert got_lse[2, 0].isnan() and torch.isposinf(got_lse[2, 1]) and got_out[2].isnan().all()
    assert torch.equal(got_out[3], out[3]) and torch.equal(got_lse[3], lse[3])


def test_decorated_op_is_one_node_in_the_compiled_graph_and_matches_eager():
    def layer(q_nope, q_pe, kv, topk):
        out, lse = base2_attention(q_nope, q_pe, kv, topk, 0.3)
        return out.sum(-1) + lse.clamp(min=-1e4)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="dsa_dcp", fullgraph=True)
    args = _inputs(2)
    torch.testing.assert_close(compiled(*args), layer(*args))
    graph = dsa_dcp.backend_report().graph_before
    assert graph.count("torch.ops.dsa_dcp.user_base2_attention") == 1
    assert dsa_dcp.backend_report().summary["sparse_attention_nodes"] == 1


@pytest.mark.parametrize(
    "fn, message",
    [
        (wrong_shape_attention, r"out must have shape \[B, H, Dc\] = \[5, 3, 8\], got \[5, 1, 8\]"),
        (single_output_attention, r"must return \(out, lse\), two tensors; got one tensor"),
    ],
)
def test_contract_violation_fails_at_compile_time(fn, message):
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a, 0.3), backend="dsa_dcp", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(*_inputs(3))


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match=r"lse_base must be one of \('e', '2'\)"):
        dsa_dcp.sparse_attention(lse_base="10")(dense_sparse_attention)
    with pytest.raises(ValueError, match=r"empty_lse must be one of"):
        dsa_dcp.sparse_attention(empty_lse="zero")(dense_sparse_attention)
