"""Ops over position-indexed caches, the position-sharded cache, and what the recognition refuses."""

import math

import pytest
import torch

import dsa_dcp  # noqa: F401  registers the ops
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.kernels import sparse_mla_reference
from dsa_dcp.ops_positions import (position_store_reference, sparse_mha_positions_reference,
                                   sparse_mla_positions_reference)
from dsa_dcp.position_cache import PositionShardedCache, allocate_position_cache, local_positions
from dsa_dcp.kernels import topk_remap_reference
from dsa_dcp.slots import local_row, localize_slots, owner
from dsa_dcp.validate import DCPValidationError

B, T, H, DC, DR, DV, K = 3, 12, 4, 8, 4, 6, 5


def _slots(gen, rows=B * 2, k=K):
    """Flat slots b * T + p with -1 entries, one row all -1."""
    slots = torch.randint(-1, B * T, (rows, k), generator=gen)
    slots[0] = -1
    return slots


def _dense_reference(q, keys, values, slots, dv):
    """fp64 softmax over the named (b, p) entries, by brute force per row and head."""
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for r in range(q.shape[0]):
        named = [int(s) for s in slots[r] if s >= 0]
        if not named:
            continue
        for h in range(q.shape[1]):
            k = torch.stack([keys(s, h) for s in named]).double()
            v = torch.stack([values(s, h) for s in named]).double()
            scores = k @ q[r, h].double() * 0.3
            lse[r, h] = torch.logsumexp(scores, 0)
            out[r, h] = torch.softmax(scores, 0) @ v
    return out, lse


def test_sparse_mla_positions_is_sparse_mla_over_the_flat_pool():
    gen = torch.Generator().manual_seed(0)
    kv, pe = torch.randn(B, T, DC, generator=gen), torch.randn(B, T, DR, generator=gen)
    q_nope, q_pe = torch.randn(6, H, DC, generator=gen), torch.randn(6, H, DR, generator=gen)
    slots = _slots(gen, 6)
    out, lse = sparse_mla_positions_reference(q_nope, q_pe, [kv, pe], slots, 0.3, compute_dtype=torch.float64)
    pool = torch.cat([kv, pe], -1).reshape(B * T, DC + DR)
    want_out, want_lse = sparse_mla_reference(q_nope, q_pe, pool, slots, 0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)  # an all -1 row is empty


def test_sparse_mha_positions_against_brute_force():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(B, H, T, DC + DR, generator=gen), torch.randn(B, H, T, DV, generator=gen)
    q = torch.randn(6, H, DC + DR, generator=gen)
    slots = _slots(gen, 6)
    out, lse = sparse_mha_positions_reference(q[..., :DC], q[..., DC:], [k, v], slots, 0.3,
                                              compute_dtype=torch.float64)
    want_out, want_lse = _dense_reference(q, lambda s, h: k[s // T, h, s % T], lambda s, h: v[s // T, h, s % T], slots, DV)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert out.shape == (6, H, DV)


def test_nan_in_a_named_position_propagates_and_an_unnamed_one_does_not():
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(B, H, T, DC, generator=gen), torch.randn(B, H, T, DV, generator=gen)
    q = torch.randn(2, H, DC, generator=gen)
    slots = torch.tensor([[0, 1, -1], [T + 2, -1, -1]])
    k[0, :, 1] = float("nan")  # named by row 0 only
    k[1, :, 5] = float("nan")  # named by no row
    out, lse = sparse_mha_positions_reference(q, q[..., :0], [k, v], slots, 0.3)
    assert torch.isnan(lse[0]).all() and torch.isnan(out[0]).all()
    assert torch.isfinite(lse[1]).all() and torch.isfinite(out[1]).all()


def test_position_store_skips_negative_positions_and_writes_a_batch_prefix():
    cache = torch.zeros(4, T, DC)
    rows = torch.randn(2, 3, DC)
    position_store_reference(cache, torch.tensor([5, -1, 7]), rows, 1)
    assert torch.equal(cache[:2, 5], rows[:, 0]) and torch.equal(cache[:2, 7], rows[:, 2])
    assert cache[2:].abs().sum() == 0 and cache[:, [0, 1, 2, 3, 4, 6] + list(range(8, T))].abs().sum() == 0


@pytest.mark.parametrize("world, interleave", [(2, 1), (3, 1), (2, 2)])
def test_remapped_flat_slots_address_the_local_cache(world, interleave):
    """topk_remap of global flat slots b * T + p gives the rank's flat slots b * T/N + local_row(p)."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(B, H, T, DC, generator=gen)
    v = torch.randn(B, H, T, DV, generator=gen)
    q = torch.randn(6, H, DC, generator=gen)
    slots = _slots(gen, 6)
    want = sparse_mha_positions_reference(q, q[..., :0], [full, v], slots, 0.3)
    positions = torch.arange(T)
    outs, lses = [], []
    for rank in range(world):
        mine = owner(positions, world, interleave) == rank
        local_k = full[:, :, mine][:, :, torch.argsort(local_row(positions[mine], world, interleave))]
        local_v = v[:, :, mine][:, :, torch.argsort(local_row(positions[mine], world, interleave))]
        local, _ = topk_remap_reference(slots, world, rank, interleave)
        out, lse = sparse_mha_positions_reference(q, q[..., :0], [local_k, local_v], local, 0.3)
        outs.append(out)
        lses.append(lse)
    merged_lse = torch.logsumexp(torch.stack(lses), 0)
    weights = torch.exp(torch.stack(lses) - merged_lse).nan_to_num(0.0)
    merged = (weights.unsqueeze(-1) * torch.stack(outs)).sum(0)
    torch.testing.assert_close(merged_lse, want[1])
    torch.testing.assert_close(merged, want[0], rtol=1e-5, atol=1e-6)


def test_position_sharded_cache_holds_its_share_and_refuses_eager_use():
    cache = allocate_position_cache((2, 3, T, DC), 2, dcp_size=3)
    assert isinstance(cache, PositionShardedCache) and tuple(cache.shape) == (2, 3, T, DC)
    assert tuple(local_positions(cache).shape) == (2, 3, T // 3, DC)
    assert local_positions(cache).untyped_storage().nbytes() == 2 * 3 * (T // 3) * DC * 4
    with pytest.raises(RuntimeError, match="outside a program the dsa_dcp passes rewrote"):
        cache[:, :, :4].sum()
    # an operation on the cache outside the step (generate's cache reordering) is named as such
    with pytest.raises(RuntimeError, match="a DCP cache does not support it, except beam search's reorder_cache"):
        cache.index_select(0, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="must be a multiple of dcp_size \\* interleave = 4"):
        allocate_position_cache((2, 10, DC), 1, dcp_size=2, interleave=2)


def _write_and_read(cache, rows, positions):
    cache.index_copy_(1, positions, rows)
    return cache[:, :8].sum(-1), cache.sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_group_of_one_computes_and_a_larger_group_refuses_other_backends(backend):
    """dcp_size=1 holds every position: any backend computes on it as on a plain tensor. A shard of a
    larger group refuses every backend but dsa_dcp (AOT autograd would otherwise compile the model's
    code over a stand-in and return numbers computed from no cache at all)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    step = _write_and_read if backend == "eager" else torch.compile(_write_and_read, backend=backend, fullgraph=True)
    whole = allocate_position_cache((2, T, DC), 1, dcp_size=1)
    assert isinstance(whole, PositionShardedCache) and tuple(local_positions(whole).shape) == (2, T, DC)
    local_positions(whole).copy_(torch.randn(2, T, DC, generator=g))
    plain = local_positions(whole).clone()
    rows, positions = torch.randn(2, 2, DC, generator=g), torch.tensor([5, 1])
    out = step(whole, rows, positions)
    want = _write_and_read(plain, rows, positions)
    torch.testing.assert_close(local_positions(whole), plain, rtol=0, atol=0)
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b)
    shard = allocate_position_cache((2, T, DC), 1, dcp_size=2)
    with pytest.raises(Exception, match="outside a program the dsa_dcp passes rewrote"):
        step(shard, rows, positions)


class _StrayRead(torch.nn.Module):
    """Writes a position cache as DeepSeek's code does, then reads it densely without a top-k."""

    def __init__(self, dcp_size):
        super().__init__()
        self.register_buffer("kv_cache", allocate_position_cache((B, T, DC), 1, dcp_size=dcp_size))

    def forward(self, x, start_pos: int):
        self.kv_cache[:B, start_pos:start_pos + 1] = x
        return self.kv_cache[:B, :start_pos + 1].sum(1)


def test_a_position_cache_read_outside_recognized_attention_is_refused():
    torch._dynamo.reset()
    with fake_group(2):
        compiled = torch.compile(_StrayRead(2), backend="dsa_dcp", options={"dcp_size": 2}, fullgraph=True)
        with pytest.raises(Exception) as err:
            compiled(torch.randn(B, 1, DC), 3)
    cause = err.value
    while cause is not None and not isinstance(cause, DCPValidationError):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert isinstance(cause, DCPValidationError), repr(err.value)
    (problem,) = cause.problems
    assert "position cache l_self_buffers_kv_cache_ is used by" in problem and "getitem" in problem


def test_a_cache_allocated_for_another_group_size_is_refused():
    torch._dynamo.reset()
    with fake_group(2):
        compiled = torch.compile(_StrayRead(3), backend="dsa_dcp", options={"dcp_size": 2}, fullgraph=True)
        with pytest.raises(Exception, match="was allocated for dcp_size=3, interleave=1 but compiled for dcp_size=2"):
            compiled(torch.randn(B, 1, DC), 3)


def test_localize_slots_on_positions_is_the_write_rule():
    positions = torch.arange(T)
    for rank in range(3):
        local = localize_slots(positions, 3, rank)
        assert torch.equal(local >= 0, owner(positions, 3) == rank)
