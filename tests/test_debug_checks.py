"""``debug_checks``: the ranks compare their top-k rows entry by entry, and their step inputs (gloo ranks).

Regression: a position-weighted sum of the row could not tell rank 0's ``[5, 7, ...]`` from rank
1's ``[7, 6, ...]`` (both 25 + the same rest); the rows themselves are compared now.
"""

import pytest
import torch
import torch.distributed as dist

import dsa_dcp
from dsa_dcp.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)

S, B, K = 24, 3, 5
ROW = torch.tensor([[1, 2, 3, 4, -1], [9, 8, -1, -1, -1], [0, 0, 10, 11, 12]])  # row 2's head is replaced

# rank 1's row 2 differs from rank 0's, each pair in a way a cheap summary misses
DIFFERENT = {
    "linear_sum": ([5, 7], [7, 6]),  # equal position-weighted sums: 1*(5+2) + 2*(7+2) = 1*(7+2) + 2*(6+2)
    "permutation": ([5, 7], [7, 5]),  # equal plain sums
    "missing_slot": ([5, 7], [5, -1]),
}


def _topk(rank, case):
    topk = ROW.clone()
    if case in DIFFERENT:
        topk[2, :2] = torch.tensor(DIFFERENT[case][min(rank, 1)])
    if case == "range_on_one_rank" and rank == 1:
        topk[1, 3] = S  # one past the pool, on rank 1 only
    if case == "rows_on_one_rank" and rank == 1:
        topk = topk[:2]  # a step of another shape on rank 1: the header tells, before the rows travel
    return topk


def _check_rank(rank, world, cases):
    from dsa_dcp.debug_checks import check_step

    group = dist.group.WORLD.group_name
    results = {}
    for position, case in enumerate(cases):
        try:
            check_step(_topk(rank, case), position, 3, S, world, group)
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            results[case] = f"{type(e).__name__}: {e}"
        else:
            results[case] = "ok"
    return results


def test_different_top_k_rows_are_caught_whatever_their_sums():
    cases = [*DIFFERENT, "range_on_one_rank", "same", "rows_on_one_rank", "same"]
    results = run_on_ranks(_check_rank, 2, cases, timeout=120)
    for case in DIFFERENT:
        ours, theirs = DIFFERENT[case]
        col = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        for r in results:
            assert r[case].startswith("DCPRuntimeCheckError: layer 3: row 2: ranks [1] computed a different top-k "
                                      f"than rank 0 (first at position {col}: rank 1 has slot {theirs[col]}, rank 0 "
                                      f"has {ours[col]})"), r[case]
    # a slot out of range on one rank: both ranks raise (no rank is left waiting in a collective)
    for r in results:
        assert r["range_on_one_rank"] == ("DCPRuntimeCheckError: layer 3: row 1 holds top-k slot 24 at position 3, "
                                          "outside [-1, 24) (on ranks [1])")
        assert r["same"] == "ok"  # the last case: the checks pair again after the shapes differed
        assert r["rows_on_one_rank"] == ("DCPRuntimeCheckError: layer 3: the ranks of the DCP group ran a step of "
                                         "different shapes: graph position 5 checks a different number of entries "
                                         "on each (rank 0: 15, rank 1: 10); every rank must be fed the same step "
                                         "inputs (docs/validation.md, 'Every rank feeds the same step inputs')")


def _compiled_rank(rank, world):
    torch._dynamo.reset()
    cache = dsa_dcp.allocate_kv_cache(S, 12, dcp_size=world)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(B, 4, 8, generator=g), torch.randn(B, 4, 4, generator=g), cache, _topk(rank, "linear_sum"))

    def attend(q_nope, q_pe, kv, topk):
        return torch.ops.dsa_dcp.sparse_mla.default(q_nope, q_pe, kv, topk, 0.5)[0]

    compiled = torch.compile(attend, backend="dsa_dcp", fullgraph=True,
                             options={"dcp_size": world, "merge": "ag", "debug_checks": True, "lowering": "fx"})
    try:
        compiled(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_top_k_given_differently_to_a_compiled_step_is_a_step_input_that_differs():
    """A top-k the step is given is a step input: the step-input check names it and its first differing
    entry (rank 1's row 2 starts [7, 6], rank 0's [5, 7]: equal position-weighted sums), on both ranks,
    before any collective."""
    for r in run_on_ranks(_compiled_rank, 2, timeout=120):
        assert r == ("DCPRuntimeCheckError: the ranks of the DCP group were given different step inputs: L['topk'] "
                     "differs on ranks [1] from rank 0's (first at index (2, 0): rank 1 has 7, rank 0 has 5). Every "
                     "rank of a DCP group must be fed the same inputs every step (the group runs one model: sample "
                     "each token once and broadcast it); docs/validation.md, 'Every rank feeds the same step "
                     "inputs'"), r


def _index_cache_rank(rank, world):
    """One decode step of DSAModel over a context longer than the top-k, the same inputs on every rank,
    compiled once (the default options) and run twice: first as built (``"ok"``), then with rank 1's
    replicated index keys made to differ from rank 0's (a cache that went wrong on one rank; the caches
    are data of the step, not part of its graph)."""
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.runner import decode_step_inputs

    torch._dynamo.reset()
    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    inputs, num_slots = decode_step_inputs(cfg, 2, 3 * cfg.index_topk, "cpu")
    model = DSAModel(cfg, num_slots, dcp_size=world, seed=3)
    step = torch.compile(model, backend="dsa_dcp", fullgraph=True, options={"dcp_size": world, "debug_checks": True})
    results = {}
    for corrupt in (False, True):
        if corrupt and rank == 1:
            for cache in model.index_caches().values():
                cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(5)))
        try:
            with torch.no_grad():
                step(*inputs)
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            results[corrupt] = f"{type(e).__name__}: {e}"
        else:
            results[corrupt] = "ok"
    return results


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_top_k_that_differs_inside_a_compiled_step_is_caught_at_its_layer():
    """The same step inputs, a replicated index cache that differs on rank 1: the step-input check passes
    (caches are not step inputs) and the top-k check of layer 0 names the row, on both ranks; with the
    caches alike, the same compiled step runs."""
    for r in run_on_ranks(_index_cache_rank, 2, timeout=120):
        assert r[False] == "ok", r[False]
        assert r[True].startswith("DCPRuntimeCheckError: layer 0: row 0: ranks [1] computed a different top-k than "
                                  "rank 0 (first at position "), r[True]
        assert "is the indexer or its key cache different on some rank?" in r[True]


def test_the_step_inputs_are_the_steps_arguments_not_its_weights_buffers_or_caches():
    """What the step-input check digests for DSAModel: its five arguments; not the weights, the rope
    buffers (a rank's own state) or the KV and index caches (split over the group, or written by the step)."""
    from dsa_dcp.inspection.targets import fake_group
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.runner import decode_step_inputs

    torch._dynamo.reset()
    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    inputs, num_slots = decode_step_inputs(cfg, 2, 5, "cpu")
    with fake_group(2), torch.no_grad():
        model = DSAModel(cfg, num_slots, dcp_size=2)
        # the FX lowering: the step_inputs pass runs before lowering (the default one, Inductor, with
        # debug_checks: test_a_top_k_that_differs_inside_a_compiled_step_is_caught_at_its_layer)
        torch.compile(model, backend="dsa_dcp", options={"dcp_size": 2, "debug_checks": True, "lowering": "fx"},
                      fullgraph=True)(*inputs)
    checked = dsa_dcp.backend_report().stats()["step_inputs"]["step_inputs_checked"]
    assert sorted(checked) == sorted(f"L['{n}']" for n in ("input_ids", "positions", "req_ids", "slots", "page_table"))
