"""The sharded index cache's kernels: ``index_scores(..., shard=(N, r, I))`` (the op
``index_scores_sharded``) and ``topk_candidates``, Triton against the torch reference and against the
replicated cache's scores.

A rank's shard holds the keys of the slots it owns at their local rows; its scores must be the
replicated cache's, bit for bit, at the candidates it owns (the same arithmetic on the same tiles)
and ``-inf`` at every other. On CPU the kernels run under the Triton interpreter at tiny shapes.
"""

import pytest
import torch

from triton_env import (  # noqa: F401 (interpreter_or_fresh_process: an autouse fixture)
    DEVICE,
    fresh_interpreter_test,
    interpreter_or_fresh_process,
    on_device as _dev,
)

from dsa_dcp.kernels import index_scores as scores_mod
from dsa_dcp.kernels import topk_agree as agree_mod
from dsa_dcp.kernels import topk_select as select_mod
from dsa_dcp.slots import local_cache_rows, local_row, owner


test_in_fresh_interpreter = fresh_interpreter_test(__file__)


def _step(gen, T=5, R=3, max_pages=6, page=4, pages_total=40):
    page_table = torch.randperm(pages_total, generator=gen)[: R * max_pages].view(R, max_pages).to(torch.int32)
    page_table[1, 2] = -1
    req_ids = torch.tensor([1, 1, 0, 2, -1][:T])
    C = max_pages * page
    positions = torch.tensor([9, 13, C + 5, 21, 3][:T])
    return page_table, req_ids, positions, page


def _shard(cache, n, rank, interleave):
    """Rank ``rank``'s cache: the rows of the slots it owns, at their local rows (zeros elsewhere)."""
    slots = torch.arange(cache.shape[0])
    mine = owner(slots, n, interleave) == rank
    local = torch.zeros((local_cache_rows(cache.shape[0], n, interleave), cache.shape[1]), dtype=cache.dtype)
    local[local_row(slots[mine], n, interleave)] = cache[mine]
    return local


def _rank_keys(cache, scale, n, rank, interleave):
    """Rank ``rank``'s index keys and per-row scales (``None`` when ``scale`` is)."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    local = _shard(cache.view(torch.uint8) if fp8 else cache, n, rank, interleave)
    local = local.view(torch.float8_e4m3fn) if fp8 else local
    return local, (_shard(scale[:, None], n, rank, interleave)[:, 0].contiguous() if scale is not None else None)


@pytest.mark.parametrize("keys", ["fp32", "bf16", "fp8-row"])
@pytest.mark.parametrize("n, interleave", [(2, 1), (3, 2)])
def test_sharded_scores_are_the_replicated_scores_of_owned_candidates(keys, n, interleave):
    gen = torch.Generator().manual_seed(n * 7 + interleave + len(keys))
    page_table, req_ids, positions, page = _step(gen)
    T, Hi, Di, S = req_ids.shape[0], 3, 20, 40 * page
    q, w = torch.randn((T, Hi, Di), generator=gen), torch.randn((T, Hi), generator=gen)
    real = torch.randn((S, Di), generator=gen)
    scale = None
    if keys == "bf16":
        cache = real.bfloat16()
    elif keys == "fp8-row":
        scale = (real.abs().amax(dim=1) / 448.0).float()
        cache = (real / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        cache = real
    args = (page_table, req_ids, positions, page)
    whole_ref = scores_mod.index_scores_reference(*_dev(q, w, cache, scale, *args))
    whole_tri = scores_mod.index_scores_triton(*_dev(q, w, cache, scale, *args), block_c=16, span=32)
    cand = scores_mod.candidate_slots(page_table, req_ids, page)
    for rank in range(n):
        local, local_scale = _rank_keys(cache, scale, n, rank, interleave)
        shard = (n, rank, interleave)
        ref = scores_mod.index_scores_reference(*_dev(q, w, local, local_scale, *args), shard=shard).cpu()
        tri = scores_mod.index_scores_triton(*_dev(q, w, local, local_scale, *args), block_c=16, span=32, shard=shard).cpu()
        owned = (cand >= 0) & (owner(cand.clamp(min=0), n, interleave) == rank)
        for got, whole in ((ref, whole_ref.cpu()), (tri, whole_tri.cpu())):
            assert torch.isneginf(got[~owned]).all()
            assert torch.equal(got[owned], whole[owned])  # -inf where the whole cache has -inf too
        assert torch.isfinite(ref[owned]).any()


@pytest.mark.parametrize("keys", ["bf16", "fp8-row"])
@pytest.mark.parametrize("n, interleave", [(2, 1), (4, 1), (2, 16)])
def test_sharded_scores_at_the_defaults_are_the_replicated_scores(keys, n, interleave):
    """Each cache at the launcher's defaults (no ``block_c``): owned scores equal bit for bit. FP8
    keys with E4M3 queries, as the models run them; the GPU runs model-sized pages."""
    gen = torch.Generator().manual_seed(n * 5 + interleave + len(keys))
    page, Hi, Di, R, pages = (64, 32, 128, 4, 64) if DEVICE == "cuda" else (16, 4, 32, 3, 6)
    pages_total = R * pages + 3
    page_table = torch.randperm(pages_total, generator=gen)[: R * pages].view(R, pages).to(torch.int32)
    page_table[1, 2] = -1
    req_ids = torch.tensor([1, 0, 2, 0, 1, -1])
    C = pages * page
    positions = torch.tensor([C - 1, C // 2, C + 5, C - 1, 7, 3])
    T, S = req_ids.shape[0], pages_total * page
    q, w = torch.randn((T, Hi, Di), generator=gen).bfloat16(), torch.randn((T, Hi), generator=gen) * Hi**-0.5
    real = torch.randn((S, Di), generator=gen)
    scale = None
    if keys == "fp8-row":
        scale = (real.abs().amax(dim=1) / 448.0).float()
        cache = (real / scale[:, None]).to(torch.float8_e4m3fn)
        q_scale = q.float().abs().amax(dim=2, keepdim=True) / 448.0
        q, w = (q.float() / q_scale).to(torch.float8_e4m3fn), w * q_scale[..., 0]
    else:
        cache = real.bfloat16()
    args = (page_table, req_ids, positions, page)
    whole = scores_mod.index_scores_triton(*_dev(q, w, cache, scale, *args)).cpu()
    cand = scores_mod.candidate_slots(page_table, req_ids, page)
    for rank in range(n):
        local, local_scale = _rank_keys(cache, scale, n, rank, interleave)
        got = scores_mod.index_scores_triton(*_dev(q, w, local, local_scale, *args), shard=(n, rank, interleave)).cpu()
        owned = (cand >= 0) & (owner(cand.clamp(min=0), n, interleave) == rank)
        assert torch.isneginf(got[~owned]).all()
        assert torch.isfinite(got[owned]).sum() > 8
        assert torch.equal(got[owned], whole[owned])


def test_sharded_scores_refuse_a_bad_shard():
    gen = torch.Generator().manual_seed(0)
    page_table, req_ids, positions, page = _step(gen)
    q, w, cache = torch.randn(5, 2, 16), torch.randn(5, 2), torch.randn(80, 16)
    for fn in (scores_mod.index_scores_reference, scores_mod.index_scores_triton):
        with pytest.raises(ValueError, match=r"index_scores_sharded: rank must be in \[0, 2\), got 2"):
            fn(*_dev(q, w, cache, None, page_table, req_ids, positions), page, shard=(2, 2, 1))


@pytest.mark.parametrize("k", [1, 5, 24, 30])
def test_topk_candidates_triton_matches_reference(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.randint(-3, 4, (6, 24), generator=gen).float()  # many ties: the tie rule decides
    scores[torch.rand(scores.shape, generator=gen) < 0.2] = float("-inf")
    scores[0, 3] = float("nan")
    ref = agree_mod.topk_candidates_reference(scores, k)
    tri = agree_mod.topk_candidates_triton(*_dev(scores), k).cpu()
    assert torch.equal(tri, ref)
    pos = select_mod.topk_select_reference(scores, k)
    assert torch.equal(ref[..., 1], pos)
    sent = ref[..., 0].contiguous().view(torch.float32)
    want = torch.where(pos >= 0, scores.gather(1, pos.clamp(min=0).long()), torch.tensor(float("-inf")))
    assert torch.equal(sent.isnan(), want.isnan()) and torch.equal(sent[~sent.isnan()], want[~want.isnan()])
