"""NaN under DCP: wherever the single-rank model shows NaN, every merge mode shows it, and nowhere else.

A NaN in a KV row that a top-k names makes the single-rank attention of that row NaN; the DCP
program must give NaN in exactly the same rows (a rank's shard with a NaN LSE is never an empty
shard), and the rows that never read the corrupt slot must stay finite and equal. First the merge
helpers in one process (each rank's part computed in turn), then the compiled model on gloo ranks.
"""

import math

import pytest
import torch

import checks
from dsa_dcp import head_groups, merge
from dsa_dcp.kernels import lse_combine_reference
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config
from dsa_dcp.models.runner import make_requests
from dsa_dcp.slots import local_row, owner


# many short gloo runs: kept ranks (conftest.py)
pytestmark = pytest.mark.usefixtures("kept_ranks")

QUIET_NAN = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


# ---------------------------------------------------------------------------------------------
# the merge modes' runtime pieces, every rank played in one process


def _rank_results(n, b=5, h=4, d=3):
    """Each rank's ``(out[B, H, D], lse[B, H])``: row 0 a NaN LSE on rank 1 (head 0), row 1 a NaN in
    rank 0's out (head 1, one element), row 2 an empty shard with a NaN out on rank 0 (ignored),
    row 3 empty everywhere, row 4 a +inf LSE on the last rank (head 2)."""
    g = torch.Generator().manual_seed(n)
    outs = torch.randn((n, b, h, d), generator=g)
    lses = torch.randn((n, b, h), generator=g)
    lses[1 % n, 0, 0] = math.nan
    outs[0, 1, 1, 2] = math.nan
    if n > 1:
        lses[0, 2], outs[0, 2] = -math.inf, math.nan
    lses[:, 3], outs[:, 3] = -math.inf, math.nan
    lses[n - 1, 4, 2] = math.inf
    return outs, lses


@QUIET_NAN
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_merge_helper_follows_the_lse_combine_rule(n):
    """ag (gather all, combine), a2a (exchange head groups, combine) and ag_rs (rescale by the
    gathered LSEs, sum over ranks) give the brute-force merge, NaN exactly where it has NaN."""
    outs, lses = _rank_results(n)
    h, d = outs.shape[2], outs.shape[3]
    exp_out, exp_lse = checks.brute_lse_combine(outs, lses)

    # ag: every rank gathers every rank's (out, lse) and combines all heads
    gathered = torch.stack([head_groups.pack_head_groups(outs[r], lses[r], 1)[0] for r in range(n)])
    ag = lse_combine_reference(*head_groups.unpack_head_groups(gathered, d))

    # a2a: rank j receives head group j of every rank's packed result
    packed = [head_groups.pack_head_groups(outs[r], lses[r], n) for r in range(n)]
    a2a = [lse_combine_reference(*head_groups.unpack_head_groups(torch.stack([p[j] for p in packed]), d)) for j in range(n)]

    # ag_rs: every rank rescales by the gathered LSEs; the reduce-scatter sums head group j on rank j
    scaled = [merge.rescale_for_reduce_scatter(outs[r], lses[r], lses, n) for r in range(n)]
    ag_rs = [merge.finish_reduce_scatter(sum(s[0][j] for s in scaled)[None], scaled[0][1], outs[0], n, j)
             for j in range(n)]

    for what, out, lse in [("ag", *ag),
                           ("a2a", torch.cat([o for o, _ in a2a], 1), torch.cat([lz for _, lz in a2a], 1)),
                           ("ag_rs", torch.cat([o for o, _ in ag_rs], 1), torch.cat([lz for _, lz in ag_rs], 1))]:
        assert out.shape == exp_out.shape and lse.shape == exp_lse.shape, what
        checks.assert_close(out, exp_out, 1e-5, f"{what} out", scale_floor=1.0, nan=True)
        checks.assert_close(lse, exp_lse, 1e-5, f"{what} lse", scale_floor=1.0, nan=True)
        assert lse[0, 0].isnan() and out[0, 0].isnan().all(), f"{what}: a NaN LSE is never an empty shard"
        assert out[1, 1, 2].isnan() and out[1].isnan().sum() == 1, f"{what}: a NaN in a shard's out"
        assert torch.isfinite(out[2]).all() and torch.isfinite(lse[2]).all(), f"{what}: an empty shard's NaN leaked"
        assert (out[3] == 0).all() and torch.isneginf(lse[3]).all(), f"{what}: every shard empty"
        assert torch.isposinf(lse[4, 2]) and out[4, 2].isnan().all(), f"{what}: +inf LSE"


# ---------------------------------------------------------------------------------------------
# the compiled model on gloo ranks against the single-rank model, a NaN in one KV row

FAMILY, LAYERS, STEPS, ROWS = "deepseek-v3.2-tiny", 2, 3, 12
POISON_LAYER, POISON_REQUEST, POISON_POSITION, POISON_COLUMN = 0, 0, 1, 5
MERGES = ("ag", "a2a", "ag_rs", "fused_a2a")
FX_MERGES = ("ag", "ag_rs", "fused_a2a")


def _setup():
    cfg = get_config(FAMILY, n_layers=LAYERS)
    # two requests, prompts shorter than K = 8: every row's top-k names every earlier slot of its
    # own request, so the poisoned slot is read by request 0's later rows and never by request 1's
    batch = make_requests(cfg, [3, 6], max_new_tokens=STEPS, seed=5)
    return cfg, batch


def _poisoned(step, poison):
    """``step`` with ``poison()`` run once, after the first (prefill) step wrote the KV."""
    calls = []

    def run(*args):
        if len(calls) == 1:
            poison()
        calls.append(None)
        return step(*args)

    return run


def _poison_slot(batch):
    return batch.slot(POISON_REQUEST, POISON_POSITION)


def _dcp_rank(rank, world, merges):
    cfg, batch = _setup()
    slot = torch.tensor([_poison_slot(batch)])
    mine, row = int(owner(slot, world, 1)) == rank, int(local_row(slot, world, 1))
    from one_trace import OneTrace

    results = {}
    torch._dynamo.reset()
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=11)

    @torch.no_grad()
    def poison():
        if mine:  # the one rank that stores the slot
            model.kv_caches()[POISON_LAYER][row, POISON_COLUMN] = math.nan

    # one trace, a compile a mode; Inductor (the default lowering) compiles the default merge (a2a), the
    # FX lowering the others (Inductor's lowering of every merge: tests/test_dcp.py)
    backend = OneTrace({mode: {"dcp_size": world, "merge": mode} | ({"lowering": "fx"} if mode in FX_MERGES else {})
                        for mode in merges})
    step = torch.compile(model, backend=backend, fullgraph=True)
    for mode in merges:
        backend.select(mode)
        model.reset_caches()
        with torch.no_grad():
            results[mode] = generate(_poisoned(step, poison), batch, STEPS, pad_to=ROWS).step_logits
    return results


def _single_rank():
    cfg, batch = _setup()
    model = DSAModel(cfg, batch.num_slots, seed=11)

    @torch.no_grad()
    def poison():
        model.kv_caches()[POISON_LAYER][_poison_slot(batch), POISON_COLUMN] = math.nan

    with torch.no_grad():
        return generate(_poisoned(model, poison), batch, STEPS, pad_to=ROWS)


@QUIET_NAN
def test_nan_in_a_named_kv_row_shows_in_the_same_rows_under_every_merge():
    ref = _single_rank()
    # the single-rank model: request 0's rows after the poisoning are NaN, request 1's are not
    poisoned_rows = 0
    for i, (logits, rows) in enumerate(zip(ref.step_logits, ref.step_rows)):
        for j, (req, _) in enumerate(rows):
            nan_row = bool(logits[j].isnan().any())
            assert nan_row == (i >= 1 and req == POISON_REQUEST), (i, req)
            poisoned_rows += nan_row
    assert poisoned_rows >= 2
    ranks = run_on_ranks(_dcp_rank, 2, MERGES, timeout=600)
    for mode in MERGES:
        for rank, res in enumerate(ranks):
            got = res[mode]
            assert len(got) == len(ref.step_logits), (mode, rank)
            for i, (a, b) in enumerate(zip(got, ref.step_logits)):
                rows = [x.isnan().any(1).nonzero().flatten().tolist() for x in (a, b)]
                same = torch.equal(a.isnan(), b.isnan())
                assert same, f"{mode}, rank {rank}, step {i}: NaN in rows {rows[0]}, single rank in rows {rows[1]}"
                finite = ~b.isnan().any(dim=1)
                assert finite.any()
                rel = ((a[finite] - b[finite]).norm() / b[finite].norm()).item()
                assert rel < 1e-5, (mode, rank, i, rel)
