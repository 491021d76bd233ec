"""The fused a2a merge kernel: pack, exchange, combine in one launch.

On the CPU the kernel runs under the Triton interpreter with one process playing every rank
(send phase of all ranks, then receive phase: no spinning). On the GPU, N real processes share
one GPU through CUDA IPC (``dsa_dcp.kernels.ipc_harness``).
"""

import math
import warnings

import pytest
import torch

from dsa_dcp.kernels._common import is_interpreted
from dsa_dcp.kernels.fused_merge import (
    MergeWorkspace,
    _fused_a2a_merge_kernel,
    fused_a2a_merge_reference,
    fused_a2a_merge_triton,
)

interpreted = pytest.mark.skipif(
    not is_interpreted(_fused_a2a_merge_kernel),
    reason="one process plays every rank only under the Triton interpreter (TRITON_INTERPRET=1); "
    "on a GPU the across-processes test covers the kernel",
)


def _inputs(seed, n, b, h, d, dtype, device="cpu"):
    """Row 0: every shard empty (NaN payloads on odd ranks); row 1: rank 0 empty with a NaN
    payload (ignored), a NaN LSE on head 0 and +inf on the last head of the last rank; row 2: a
    NaN in the payload of a non-empty shard (it counts)."""
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(b, h, d, generator=g).to(dtype) for _ in range(n)]
    lses = [torch.randn(b, h, generator=g) * 3 for _ in range(n)]
    if b > 1:
        for r in range(n):
            lses[r][0] = -math.inf
            outs[r][0] = float("nan") if r % 2 else outs[r][0]
        lses[0][1] = -math.inf
        outs[0][1] = float("nan")
        lses[-1][1, 0] = math.nan
        lses[-1][1, -1] = math.inf
    if b > 2:
        outs[-1][2, 0, d - 1] = float("nan")
    return [o.to(device) for o in outs], [l.to(device) for l in lses]


def _check(res, outs, lses, rank, tol):
    """The reference combine's result, NaN exactly where it has NaN (infinities where it has them)."""
    ref_out, ref_lse = fused_a2a_merge_reference([o.cpu().double() for o in outs], [l.cpu() for l in lses], rank)
    out, lse = res[0].cpu(), res[1].cpu()
    torch.testing.assert_close(lse, ref_lse.float(), rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol, equal_nan=True)
    b = out.shape[0]
    if b > 1:
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all(), "every shard empty"
        # the empty shard's NaN payload of row 1 never reaches the result; rank 0 holds head 0
        g = out.shape[1]
        finite = [j for j in range(g) if rank * g + j not in (0, len(outs) * g - 1)]
        assert torch.isfinite(out[1, finite]).all() and torch.isfinite(lse[1, finite]).all()
    if b > 2 and rank == 0:
        assert out[2, 0, -1].isnan() and out[2, 0].isnan().sum() == 1 and torch.isfinite(lse[2]).all()


@interpreted
@pytest.mark.parametrize("n, b, h, d, programs", [(1, 3, 2, 5, 64), (2, 5, 4, 8, 2), (3, 2, 6, 3, 64), (4, 4, 8, 6, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_interpreted_all_ranks_in_one_process(n, b, h, d, programs, dtype):
    buffers = [MergeWorkspace.buffers(n, 8, h, d, dtype, "cpu") for _ in range(n)]
    workspaces = [MergeWorkspace.from_buffers(r, buffers) for r in range(n)]
    batches = [b, 1, b, 2]  # epochs advance, the two slots alternate, the program count changes
    for step, rows in enumerate(batches):
        outs, lses = _inputs(100 * step + n, n, rows, h, d, dtype)
        for r in range(n):
            fused_a2a_merge_triton(outs[r], lses[r], workspaces[r], phase=1, max_programs=programs)
        for r in range(n):
            res = fused_a2a_merge_triton(outs[r], lses[r], workspaces[r], phase=2, max_programs=programs)
            _check(res, outs, lses, r, 1e-5 if dtype == torch.float32 else 2e-2)
    sent = sum(min(rows * (h // n), programs) for rows in batches)  # one program per (row, head) item
    assert all(ws.state.tolist() == [len(batches), 0, sent] for ws in workspaces)
    assert all(ws.flags.tolist() == [sent] * n for ws in workspaces)


@interpreted
def test_workspace_refuses_what_does_not_fit():
    ws = MergeWorkspace.from_buffers(0, [MergeWorkspace.buffers(1, 4, 2, 8, torch.float32, "cpu")])
    with pytest.raises(ValueError, match="does not fit the workspace"):
        fused_a2a_merge_triton(torch.zeros(5, 2, 8), torch.zeros(5, 2), ws)


def _step_batches(b):
    return [b, 1, b, 3]  # the program count min(B * G, 64) changes from merge to merge


def _ipc_rank(rank, ws, n, b, h, d, dtype):
    results = []
    for step, rows in enumerate(_step_batches(b)):
        outs, lses = _inputs(1000 * step + 7 * n + b, n, rows, h, d, dtype, device="cuda")
        res = fused_a2a_merge_triton(outs[rank], lses[rank], ws)
        torch.cuda.synchronize()
        results.append((res[0].cpu(), res[1].cpu()))
    return results, ws.state.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("b", [1, 33])
def test_fused_merge_across_processes_on_one_gpu(n, b):
    from dsa_dcp.kernels.ipc_harness import run_ipc_ranks

    h, d, dtype = 8 * n, 512, torch.bfloat16
    ranks = run_ipc_ranks(_ipc_rank, n, 64, h, d, dtype, n, b, h, d, dtype, timeout=60)
    batches = _step_batches(b)
    for step, rows in enumerate(batches):
        outs, lses = _inputs(1000 * step + 7 * n + b, n, rows, h, d, dtype)
        for rank, (results, state) in enumerate(ranks):
            _check(results[step], outs, lses, rank, 2e-2)
    sent = sum(min(rows * (h // n), 64) for rows in batches)
    assert all(state.tolist() == [len(batches), 0, sent] for _, state in ranks)


def test_a_group_keeps_every_workspace_and_picks_the_first_that_fits(monkeypatch):
    """Symmetric memory needs one GPU per rank, so its allocation is replaced by plain CPU buffers;
    what is checked is which workspace each call gets and that none is dropped (a CUDA graph
    captured with an outgrown workspace still writes into it)."""
    from dsa_dcp.kernels import fused_merge

    made = []

    def fake_symmetric(cls, group_name, dcp_size, rank, max_rows, heads, head_dim, dtype, device):
        ws = cls.from_buffers(rank, [cls.buffers(dcp_size, max_rows, heads, head_dim, dtype, device)
                                     for _ in range(dcp_size)])
        made.append(ws)
        return ws

    monkeypatch.setattr(fused_merge, "_workspaces", {})
    monkeypatch.setattr(MergeWorkspace, "symmetric", classmethod(fake_symmetric))
    small = fused_merge.workspace_for("g", torch.zeros(1, 4, 8), 2, 0)
    assert small.max_rows == 64 and fused_merge.has_workspace("g") and not fused_merge.has_workspace("other")
    large = fused_merge.workspace_for("g", torch.zeros(100, 4, 8), 2, 0)
    assert large.max_rows == 128 and large is not small
    assert fused_merge.workspace_for("g", torch.zeros(3, 4, 8), 2, 0) is small
    assert fused_merge.workspace_for("g", torch.zeros(65, 4, 8), 2, 0) is large
    wider = fused_merge.workspace_for("g", torch.zeros(1, 6, 8), 2, 0)
    assert wider.heads == 6 and fused_merge._workspaces["g"] == [small, large, wider] == made


def test_a_group_without_symmetric_memory_falls_back_with_one_warning(monkeypatch):
    from dsa_dcp.kernels import fused_merge

    asked = []

    def refuse(cls, *args, **kwargs):
        asked.append(args[0])
        raise RuntimeError("no symmetric memory in this test")

    monkeypatch.setattr(fused_merge, "_workspaces", {})
    monkeypatch.setattr(fused_merge, "_no_symmetric_memory", set())
    monkeypatch.setattr(MergeWorkspace, "symmetric", classmethod(refuse))
    with pytest.warns(RuntimeWarning, match="no symmetric memory in this test.*composed merge"):
        assert fused_merge.workspace_for("g", torch.zeros(1, 4, 8), 2, 0) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_merge.workspace_for("g", torch.zeros(1, 4, 8), 2, 0) is None
    assert not fused_merge.has_workspace("g")
    assert asked == ["g"], "a group that failed is not asked for symmetric memory again on every merge"
