"""Fused a2a merge: pack, exchange and LSE-combine in one kernel launch per layer.

Contract (``fused_a2a_merge_reference``, the composed reference, is the same function)::

    fused_a2a_merge(out_r[B, H, D], lse_r[B, H], N, r) -> (out[B, H/N, D], lse[B, H/N])

where rank ``r`` receives head group ``r`` (heads ``[r*G, (r+1)*G)``, ``G = H/N``) of every rank's
partial result and LSE-combines them (``lse_combine`` semantics: only ``lse = -inf`` is an empty
shard, whose payload is never read; a NaN or ``+inf`` LSE, or a NaN in a non-empty shard's
payload, reaches the result as in ``lse_combine``).

The kernel works on a ``MergeWorkspace`` that every rank of the group allocates once, before any
CUDA-graph capture, and whose buffers all ranks can address:

- ``payload[2, N, B_max, G, D]`` (dtype of ``out``) and ``lse[2, N, B_max, G]`` (float32): slot
  ``e % 2`` of merge number ``e``, source rank, row, head;
- ``flags[N]`` (int64): ``flags[src]`` counts the programs of ``src`` that finished writing here;
- ``state[3]`` (int64, local only): ``[merges done, programs done in this merge, flags received
  from each source before this merge]``;
- ``peers[3, N]`` (int64): each rank's ``payload``, ``lse`` and ``flags`` addresses as seen here.

The work is split into ``B * G`` items (row ``b``, head ``g`` of a group). Program ``p`` of rank
``r`` (grid ``P = min(B * G, max_programs)``, identical on every rank):

1. reads ``e = state[0]``; for its items ``p, p + P, ...`` and every destination ``j`` it writes
   head ``j * G + g`` of ``out_r[b]``, ``lse_r[b]`` into rank ``j``'s slot ``e % 2`` at source ``r``
   (the ``N`` destinations unrolled, so their loads are in flight together);
2. block barrier, then ``flags_j[r] += 1`` on every rank ``j`` (release, system scope);
3. spins until ``flags[src] >= state[2] + P`` for every ``src`` (acquire, system scope);
4. combines its items of its own head group from the ``N`` sources and writes the result;
5. the last program to finish sets ``state = [e + 1, 0, state[2] + P]`` (every program read the
   state before that).

``P`` may differ from one merge to the next (a step at another batch size): the count each
source has sent so far is carried in ``state[2]``, not derived from ``e``. Every rank of one merge
has the same ``B`` and so the same ``P``. Counts grow monotonically and are never reset, so the
kernel replays inside a CUDA graph. Two
slots suffice: a rank can write merge ``e + 2`` into a peer only after it received that peer's
merge ``e + 1``, which the peer sends after it finished reading merge ``e``. All ``P`` programs of
a rank must be resident at once (spinning programs wait for the others): ``max_programs`` stays
below the number of SMs.

The table of peer addresses comes from torch symmetric memory on several GPUs
(``MergeWorkspace.symmetric``), or from CUDA tensors shared between processes on one GPU
(``MergeWorkspace.from_buffers``, the test harness). Under the Triton interpreter the kernel runs
in two phases (``PHASE`` 1: steps 1-2, ``PHASE`` 2: steps 3-5) so one process can play all ranks
without spinning: there phase 2 finds every flag already raised, and a count short of its target
(which on a GPU would spin forever) turns the result's LSE into NaN instead (the tests compare
NaN positions with the reference, so a short count fails them).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import triton
import triton.language as tl

from dsa_dcp.kernels._common import check_launchable, next_pow2
from dsa_dcp.kernels.lse_combine import lse_combine_reference

MAX_PROGRAMS = 64


def fused_a2a_merge_reference(outs: list[torch.Tensor], lses: list[torch.Tensor], rank: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``rank`` gets, from every rank's ``out_r[B, H, D]`` and ``lse_r[B, H]``."""
    n = len(outs)
    g = outs[0].shape[1] // n
    heads = slice(rank * g, (rank + 1) * g)
    return lse_combine_reference(torch.stack([o[:, heads] for o in outs]), torch.stack([l[:, heads] for l in lses]))


# RANK is a runtime argument, never specialized: every rank of one process runs the same
# compiled kernel. (Emulating N ranks in one process, a kernel compiled per rank would be loaded
# while another rank's kernel spins on its flags, and loading a module waits for the device to go
# idle: a deadlock.)
@triton.jit(do_not_specialize=["RANK"])
def _fused_a2a_merge_kernel(
    out_ptr, lse_ptr, res_ptr, res_lse_ptr,
    peers_ptr, my_payload_ptr, my_lse_ptr, my_flags_ptr, state_ptr,
    B, H, D, G, B_MAX, RANK,
    N: tl.constexpr, BLOCK_D: tl.constexpr, PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr)
    received = tl.load(state_ptr + 2)
    slot = epoch % 2
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D

    if PHASE != 2:
        # 1. send: for my items (row b, head g of a group), head g of group j goes to rank j
        for item in range(pid, B * G, nprog):
            b = item // G
            g = item % G
            row = ((slot * N + RANK) * B_MAX + b) * G + g
            for j in tl.static_range(N):
                dst_payload = tl.load(peers_ptr + j).to(tl.pointer_type(out_ptr.dtype.element_ty))
                dst_lse = tl.load(peers_ptr + N + j).to(tl.pointer_type(tl.float32))
                h = j * G + g
                vals = tl.load(out_ptr + (b * H + h) * D + offs, mask=dmask)
                tl.store(dst_payload + row * D + offs, vals, mask=dmask)
                tl.store(dst_lse + row, tl.load(lse_ptr + b * H + h))
        # 2. every thread's stores are done before the flag is raised
        tl.debug_barrier()
        for j in tl.static_range(N):
            dst_flags = tl.load(peers_ptr + 2 * N + j).to(tl.pointer_type(tl.int64))
            tl.atomic_add(dst_flags + RANK, 1, sem="release", scope="sys")

    if PHASE != 1:
        # 3. wait for every source's programs of this merge
        target = received + nprog
        short = 0
        for src in tl.static_range(N):
            seen = tl.atomic_add(my_flags_ptr + src, 0, sem="acquire", scope="sys")
            if PHASE == 2:  # interpreter: every send already happened; never spin
                short += (seen < target).to(tl.int32)
            else:
                while seen < target:
                    seen = tl.atomic_add(my_flags_ptr + src, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        # 4. combine my items of my head group
        for item in range(pid, B * G, nprog):
            b = item // G
            g = item % G
            m = -float("inf")
            for src in tl.static_range(N):
                row = ((slot * N + src) * B_MAX + b) * G + g
                # the max keeps NaN, so a NaN LSE wins over a +inf one
                m = tl.maximum(m, tl.load(my_lse_ptr + row, cache_modifier=".cg"), propagate_nan=tl.PropagateNan.ALL)
            m_safe = tl.where(m == -float("inf"), 0.0, m)
            total = 0.0
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for src in tl.static_range(N):
                row = ((slot * N + src) * B_MAX + b) * G + g
                l_s = tl.load(my_lse_ptr + row, cache_modifier=".cg")
                w = tl.exp(l_s - m_safe)  # 0 for an empty shard; NaN for a NaN one, or +inf beside m = +inf
                vals = tl.load(my_payload_ptr + row * D + offs, mask=dmask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
                # an empty shard's payload is selected away; a non-empty one's NaN counts even at weight 0
                acc += tl.where(l_s == -float("inf"), 0.0, w * vals)
                total += w
            zero = total == 0  # every shard empty (a NaN total is not 0)
            denom = tl.where(zero, 1.0, total)
            tl.store(res_ptr + (b * G + g) * D + offs, (acc / denom).to(res_ptr.dtype.element_ty), mask=dmask)
            res_lse = tl.where(m == float("inf"), float("inf"), m + tl.log(denom))  # +inf - +inf is NaN: keep +inf
            res_lse = tl.where(zero, -float("inf"), res_lse)
            if PHASE == 2:
                res_lse = tl.where(short == 0, res_lse, float("nan"))
            tl.store(res_lse_ptr + b * G + g, res_lse)
        # 5. the last program to finish advances the epoch
        done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel")
        if done == nprog - 1:
            tl.store(state_ptr + 2, target)
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, epoch + 1)


@dataclasses.dataclass
class MergeWorkspace:
    """One rank's buffers for the fused merge and the table of every rank's addresses."""

    dcp_size: int
    rank: int
    max_rows: int
    heads: int  # H (all heads); each rank combines H / N of them
    head_dim: int
    payload: torch.Tensor  # [2, N, max_rows, G, D]
    lse: torch.Tensor  # [2, N, max_rows, G] float32
    flags: torch.Tensor  # [N] int64
    state: torch.Tensor  # [3] int64
    peers: torch.Tensor  # [3, N] int64

    @staticmethod
    def buffers(dcp_size: int, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str, empty=torch.empty) -> dict[str, torch.Tensor]:
        """The shared buffers of one rank (``empty`` allocates them: plain or symmetric memory)."""
        g = heads // dcp_size
        flags = empty((dcp_size,), dtype=torch.int64, device=device)
        flags.zero_()
        return {
            "payload": empty((2, dcp_size, max_rows, g, head_dim), dtype=dtype, device=device),
            "lse": empty((2, dcp_size, max_rows, g), dtype=torch.float32, device=device),
            "flags": flags,
        }

    @classmethod
    def from_buffers(cls, rank: int, all_buffers: list[dict[str, torch.Tensor]]) -> MergeWorkspace:
        """Build rank ``rank``'s workspace from every rank's buffers as mapped in this process."""
        mine = all_buffers[rank]
        n = len(all_buffers)
        _, _, max_rows, g, d = mine["payload"].shape
        device = mine["payload"].device
        peers = torch.tensor(
            [[b[k].data_ptr() for b in all_buffers] for k in ("payload", "lse", "flags")], dtype=torch.int64
        ).to(device)
        state = torch.zeros(3, dtype=torch.int64, device=device)
        return cls(n, rank, max_rows, g * n, d, mine["payload"], mine["lse"], mine["flags"], state, peers)

    @classmethod
    def symmetric(cls, group_name: str, dcp_size: int, rank: int, max_rows: int, heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> MergeWorkspace:
        """Buffers in torch symmetric memory, peer addresses from its rendezvous (several GPUs)."""
        import torch.distributed._symmetric_memory as symm_mem

        mine = cls.buffers(dcp_size, max_rows, heads, head_dim, dtype, device, empty=symm_mem.empty)
        handles = {k: symm_mem.rendezvous(t, group_name) for k, t in mine.items()}
        peers = torch.tensor([handles[k].buffer_ptrs for k in ("payload", "lse", "flags")], dtype=torch.int64)
        state = torch.zeros(3, dtype=torch.int64, device=device)
        return cls(dcp_size, rank, max_rows, heads, head_dim, mine["payload"], mine["lse"], mine["flags"], state,
                   peers.to(device))

    def fits(self, out: torch.Tensor) -> bool:
        b, h, d = out.shape
        return b <= self.max_rows and h == self.heads and d == self.head_dim and out.dtype == self.payload.dtype


def fused_a2a_merge_triton(out: torch.Tensor, lse: torch.Tensor, ws: MergeWorkspace, *, phase: int = 0,
                           max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: send, signal, wait, combine (see module docstring). ``phase`` is for the
    interpreter tests only (1: send and signal, 2: wait and combine; 0: both)."""
    b, h, d = out.shape
    if not ws.fits(out):
        raise ValueError(f"fused_a2a_merge: out {tuple(out.shape)} {out.dtype} does not fit the workspace "
                         f"(max_rows={ws.max_rows}, heads={ws.heads}, head_dim={ws.head_dim}, {ws.payload.dtype})")
    if lse.shape != (b, h) or lse.dtype != torch.float32:
        raise ValueError(f"fused_a2a_merge: lse must be float32 [B, H] = [{b}, {h}], got {tuple(lse.shape)} {lse.dtype}")
    g = h // ws.dcp_size
    res = torch.empty((b, g, d), dtype=out.dtype, device=out.device)
    res_lse = torch.empty((b, g), dtype=torch.float32, device=out.device)
    if b == 0:
        return res, res_lse
    check_launchable(_fused_a2a_merge_kernel, out, lse)
    grid = (min(b * g, max_programs),)  # one program per (row, head) item, up to max_programs
    _fused_a2a_merge_kernel[grid](
        out.contiguous(), lse.contiguous(), res, res_lse,
        ws.peers, ws.payload, ws.lse, ws.flags, ws.state,
        b, h, d, g, ws.max_rows, ws.rank,
        N=ws.dcp_size, BLOCK_D=next_pow2(d), PHASE=phase,
    )
    return res, res_lse


# Workspaces by process-group name: registered by a harness, or created in symmetric memory on the
# first call that none fits (which happens in a warm-up run, before any CUDA-graph capture). A
# group keeps every workspace it was given: a CUDA graph captured with one still writes into it,
# and every rank picks the same one (the first that fits), since all ranks merge the same shapes.
_workspaces: dict[str, list[MergeWorkspace]] = {}
_no_symmetric_memory: set[str] = set()  # groups that failed to get one: not asked again, warned once


def register_workspace(group_name: str, ws: MergeWorkspace) -> None:
    _workspaces.setdefault(group_name, []).append(ws)


def workspace_for(group_name: str, out: torch.Tensor, dcp_size: int, rank: int) -> MergeWorkspace | None:
    """The first workspace of ``group_name`` that fits ``out``, creating one in symmetric memory if
    none does and the group supports it; ``None`` if there is none (the caller falls back to the
    composed merge)."""
    for ws in _workspaces.get(group_name, ()):
        if ws.fits(out):
            return ws
    if group_name in _no_symmetric_memory:  # every call would fail the same way again
        return None
    try:
        max_rows = max(64, next_pow2(out.shape[0]))
        ws = MergeWorkspace.symmetric(group_name, dcp_size, rank, max_rows, out.shape[1], out.shape[2],
                                      out.dtype, out.device)
    except Exception as e:  # noqa: BLE001 - no symmetric memory here (one GPU per rank needed): fall back
        _no_symmetric_memory.add(group_name)
        warnings.warn(f"fused_a2a_merge: no symmetric-memory workspace for group {group_name!r} "
                      f"({type(e).__name__}: {e}); using the composed merge (pack, all-to-all, "
                      "combine) instead", RuntimeWarning, stacklevel=2)
        return None
    register_workspace(group_name, ws)
    return ws


def has_workspace(group_name: str) -> bool:
    """Whether the fused kernel (not the composed fallback) serves ``group_name``."""
    return bool(_workspaces.get(group_name))


def unavailable_reason(group_name: str) -> str | None:
    """Why the fused merge cannot run on this CUDA group (``None`` when it can)."""
    if has_workspace(group_name):
        return None
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    backend = dist.get_backend(_resolve_process_group(group_name))
    if backend != "nccl":
        return f"the group's backend is {backend!r}; symmetric memory needs NCCL with one GPU per rank"
    return None
