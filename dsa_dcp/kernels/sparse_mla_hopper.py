"""Sparse MLA decode for Hopper (sm_90a), written in Gluon below Triton's ``tl.dot``.

Same contract as :mod:`dsa_dcp.kernels.sparse_mla` (``sparse_mla_hopper`` has the signature of
``sparse_mla_triton`` plus its own launch options): ``q_nope[B, H, 512]``, ``q_pe[B, H, 64]``,
``kv[S, 576]`` (the queries' dtype, or FP8 E4M3 with a per-tensor ``kv_scale``), ``topk[B, K]``
int32/int64 slot ids (negative entries and entries ``>= S`` skipped: page size 1), ``sm_scale``;
returns ``out[B, H, 512]`` in ``q_nope``'s dtype and ``lse[B, H]`` fp32, natural log. A row with
no valid slot gives ``out = 0``, ``lse = -inf``; a NaN in a query or in a KV row the top-k names
gives that row NaN ``out`` and NaN ``lse`` (NaN is never turned into an empty row).

Design (one CTA per request ``b``, 64-head block and K split; 12 warps in three roles, each a
``gl.warp_specialize`` partition, talking through mbarriers)::

    producer (4 warps)      gathers the KV rows of each 64-key tile into a ring of 2 shared-memory
                            stages (latent halves and rope in three NVMMA-swizzled buffers): BF16
                            with cp.async (16 B a thread, zero-fill for skipped entries, every
                            producer thread arrives on the stage's mbarrier when its copies land),
                            FP8 with loads widened to fp16 in registers and stored (exact: every
                            E4M3 value is an fp16 value); the next tile's indices are loaded a
                            tile ahead
    softmax group (4 warps) S = Q K^T once per tile (wgmma 64 x 64 over the 576 columns: three
                            products, latent halves and rope, Q in shared memory), online softmax
                            in fp32 (exp2, the scale folded in), P and the tile's correction factor
                            to shared memory for the output group, then O[:, :256] += P V[:, :256]
                            with P from registers
    output group (4 warps)  O[:, 256:] += P V[:, 256:] with P from shared memory, after rescaling
                            by the correction factor the softmax group shared (64 floats)

so the score tile is computed once, and the 64 x 512 fp32 accumulator is split by output
columns over two warp groups (128 registers a thread each; registers: softmax group 232, output
group 160, producer 112). Shared memory: Q 72 KB, two KV stages of 72 KB, P 8 KB: 224.5 KB of the
227 KB a CTA may have (:func:`smem_bytes`), so one CTA an SM. A 128-head request runs as two CTAs
with neighbouring ids, so the second one's gathers mostly hit L2. When ``B * ceil(H / 64)`` CTAs
fill less than 3/4 of the GPU, K is split in whole tiles over several CTAs that write fp32
partials ``(out, lse)``, and a second (Triton) kernel merges them by log-sum-exp: a split with
NaN LSE makes the row NaN, a split with no valid key weighs 0, all splits empty give (0, -inf).

Launch options (``num_splits``, ``block_k``, ``prefetch``, ``early_s``) come from the measured
dispatch table when none is given. ``block_k=32`` runs 32-key tiles in four stages (the same
shared memory, three tiles in flight instead of one); ``prefetch=n`` prefetches the rows of the
tile n ahead into L2 (``cp.async.bulk.prefetch.L2``); ``early_s`` issues the next tile's score
product before waiting for this tile's ``P V``. Measured on the H200 (docs/benchmarks.md): the
prefetch and the early scores are slower on every shape, 32-key tiles slower for BF16 and equal
for FP8; the defaults are 64-key tiles, no prefetch, no early scores.

Precision: BF16 KV: products in bf16 with fp32 accumulation, P rounded to bf16 for ``P V`` (as
FlashAttention and FlashMLA). FP8 KV: no FP8 tensor-core products (they would need FP8 queries
and P, and V transposed in shared memory); the KV is widened exactly to fp16, bf16 queries go to
fp16 scaled by 2^-8 (exact in bf16; undone in the score scale: no overflow below |q| = 2^24),
P is rounded to fp16; ``kv_scale`` multiplies the scores and the output once. Measured against
the fp64 reference on the same (dequantized) values, both KV dtypes, bf16 output: max |error| /
max |out| 2.5e-3 to 3.1e-3 (bf16 output rounding is 2^-9 = 2e-3), LSE within 3.3e-6.

Limits: Hopper only (compute capability 9.0) with Triton 3.6's Gluon (:func:`available` says
why not elsewhere); ``Dc = 512`` and ``Dr = 64``; bf16 or fp16 queries (both the same dtype);
any H (blocks of 64 heads: H = 16 or 32 compute a whole masked 64-head tile), any K (the last
tile masked), any S below 2^31; KV rows on 16-byte boundaries; no autograd. It does not run under the Triton interpreter or on
CPU tensors (the Triton kernel is the CPU-tested implementation of the same contract). Speed,
measured: 1.2-2.5x the Triton kernel from B = 8 up and slower than it at B = 1 with K <= 1024;
at B = 128 about 0.9-0.98x of FlashInfer's fa3 (BF16 KV). FP8 KV is not faster than BF16 KV: the
producer widens a tile in registers, so only one tile is in flight, and the consumer groups,
not the bytes, bound the time at large B.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from . import dispatch
from ._common import cdiv, check_same_device, last_dim_contiguous, sm_count

_OP = "sparse_mla_hopper"
DC, DR = 512, 64
BLOCK_H = 64  # heads of one CTA: the wgmma M
BLOCK_K = 64  # keys of one tile
STAGES = 2  # KV tiles in shared memory
PIPELINES = {64: 2, 32: 4}  # key tile -> stages that fit the shared memory with Q and P
PREFETCH = 0  # key tiles ahead whose rows the producer prefetches into L2 (measured: 2 and 3 are slower)
EARLY_S = False  # issue the next tile's scores before this tile's P V completes (measured: slower)
HALF = DC // 2  # output columns of one warp group
WORKER_REGS = (160, 112)  # output group, producer; the softmax group gets 3 * 168 - 272 = 232
MAX_REGS = 168  # per thread at launch for 12 warps (12 * 32 * 168 = 64512 <= 65536)
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
Q_DTYPES = (torch.bfloat16, torch.float16)
TRITON_VERSION = "3.6"  # the Gluon API this module is written against
ENV_FORCE = "DSA_DCP_HOPPER_KERNEL"  # "0": report unavailable (e.g. to compare backends)


def smem_bytes(block_k: int = BLOCK_K, stages: int = STAGES) -> int:
    """Shared memory of one CTA: Q, the KV stages, P (16-bit), two rows of 64 floats (the
    compiled kernel adds its mbarriers: 230,208 bytes at 64-key tiles, 226,144 at 32)."""
    return 2 * (BLOCK_H * (DC + DR) + stages * block_k * (DC + DR) + BLOCK_H * block_k) + 4 * 2 * BLOCK_H

_IMPORT_ERROR: str | None = None
try:  # Gluon exists in triton >= 3.4; its API moves between releases, so any failure means "not here"
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
except Exception as e:  # pragma: no cover - depends on the installed triton
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def _version_ok() -> bool:
    return _IMPORT_ERROR is None and triton.__version__.startswith(TRITON_VERSION)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the kernel cannot run on ``device``'s tensors (default: the current CUDA device's;
    ``None`` when it can)."""
    if os.environ.get(ENV_FORCE) == "0":
        return f"disabled by {ENV_FORCE}=0"
    if _IMPORT_ERROR is not None:
        return f"triton.experimental.gluon (Hopper) does not import: {_IMPORT_ERROR}"
    if not triton.__version__.startswith(TRITON_VERSION):
        return f"written against triton {TRITON_VERSION}'s Gluon API, found triton {triton.__version__}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Gluon kernels do not run under the Triton interpreter"
    if device is not None and device.type != "cuda":
        return "needs CUDA tensors"
    if not torch.cuda.is_available():
        return "no CUDA device"
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    if _capability(index) != (9, 0):
        return f"needs compute capability 9.0 (Hopper), device {index} has {_capability(index)}"
    return None


def available(device: torch.device | None = None) -> bool:
    """Whether :func:`sparse_mla_hopper` can run on ``device`` (default: the current CUDA device)."""
    return unavailable_reason(device) is None


def supports(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor) -> bool:
    """The shapes and dtypes the kernel is built for (``sparse_mla_hopper`` refuses the rest)."""
    return (
        q_nope.shape[-1] == DC
        and q_pe.shape[-1] == DR
        and q_nope.dtype in Q_DTYPES
        and q_pe.dtype == q_nope.dtype
        and (kv.dtype == q_nope.dtype or kv.dtype in FP8_KV_DTYPES)
        and _rows_aligned(kv)
    )


if _IMPORT_ERROR is None:
    try:

        @gluon.constexpr_function
        def _gather_layout(fp8, cols):
            """Rows of ``cols`` elements over 4 warps, 16 bytes (one vector) a thread."""
            vec = 16 if fp8 else 8
            lanes_c = min(32, cols // vec)
            return gl.BlockedLayout([1, vec], [32 // lanes_c, lanes_c], [4, 1], [1, 0])

        @gluon.jit
        def _q_operand(q, Q_PRESCALE: gl.constexpr, MMA_DTYPE: gl.constexpr):
            """Queries in the products' dtype; with Q_PRESCALE (bf16 queries on FP8 KV) scaled by
            2^-8 first (exact in bf16) so that fp16 holds them (the launcher undoes it)."""
            if Q_PRESCALE:
                q = q * 0.00390625
            return q.to(MMA_DTYPE)

        @gluon.jit
        def _scores_async(q_l, q_r, q_p, kv_l, kv_r, kv_p, st, s_zero):
            """S = Q K^T for the tile in stage ``st``: three wgmma groups (latent halves, rope)."""
            s = warpgroup_mma(q_l, kv_l.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_r, kv_r.index(st).permute((1, 0)), s, is_async=True)
            return warpgroup_mma(q_p, kv_p.index(st).permute((1, 0)), s, is_async=True)

        @gluon.jit
        def _softmax_partition(
            q_nope_ptr, q_pe_ptr, topk_row, out_ptr, lse_ptr,
            q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
            ready, empty, p_ready, p_free, l_ready,
            b, h0, H, S, k_begin, k_end, n_tiles, out_row0, qk_scale, out_scale, q_prescale,
            stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
            BK: gl.constexpr, STAGES: gl.constexpr, Q_PRESCALE: gl.constexpr, MMA_DTYPE: gl.constexpr,
            EARLY_S: gl.constexpr,
        ):  # fmt: skip
            """Warp group 0: queries to shared memory; per tile S = Q K^T, online softmax, P and
            the correction factor to the output group, O[:, :256] += P V[:, :256]; then the
            left half of the output and the LSE. EARLY_S: the next tile's S is issued right after
            this tile's P V, so the tensor cores run them back to back (its wait moves to the top
            of the next iteration)."""
            BH: gl.constexpr = 64
            HALF: gl.constexpr = 256
            DR: gl.constexpr = 64
            # queries: loaded once, [64, 256] + [64, 256] + [64, 64] in shared memory
            ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
            qpl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            offs_h = h0 + gl.arange(0, BH, gl.SliceLayout(1, ql))
            cols = gl.arange(0, HALF, gl.SliceLayout(0, ql))
            qn_row = q_nope_ptr + b * stride_qn_b
            in_h = (offs_h < H)[:, None]
            offs_hp = h0 + gl.arange(0, BH, gl.SliceLayout(1, qpl))
            cols_p = gl.arange(0, DR, gl.SliceLayout(0, qpl))
            # all three loads in flight before the first store
            qa = gl.load(qn_row + offs_h[:, None] * stride_qn_h + cols[None, :], mask=in_h, other=0.0)
            qb = gl.load(qn_row + offs_h[:, None] * stride_qn_h + (cols + HALF)[None, :], mask=in_h, other=0.0)
            qc = gl.load(q_pe_ptr + b * stride_qp_b + offs_hp[:, None] * stride_qp_h + cols_p[None, :],
                         mask=(offs_hp < H)[:, None], other=0.0)
            q_l.store(_q_operand(qa, Q_PRESCALE, MMA_DTYPE))
            q_r.store(_q_operand(qb, Q_PRESCALE, MMA_DTYPE))
            q_p.store(_q_operand(qc, Q_PRESCALE, MMA_DTYPE))
            fence_async_shared()  # generic-proxy stores, read next by wgmma (async proxy)

            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BK, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HALF, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

            m_i = gl.full([BH], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([BH], gl.float32, row_s)
            acc = gl.zeros([BH, HALF], gl.float32, o_layout)
            s_zero = gl.zeros([BH, BK], gl.float32, s_layout)
            offs_k = k_begin + gl.arange(0, BK, col_s)
            idx = gl.load(topk_row + offs_k, mask=offs_k < k_end, other=-1)  # the tile's, a tile ahead
            s_tok = warpgroup_mma_init(s_zero)
            if EARLY_S:
                if n_tiles > 0:
                    mbarrier.wait(ready.index(0), 0)
                    fence_async_shared()
                    s_tok = _scores_async(q_l, q_r, q_p, kv_l, kv_r, kv_p, 0, s_zero)
            for j in range(n_tiles):
                st = j % STAGES
                if EARLY_S:
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                else:
                    mbarrier.wait(ready.index(st), (j // STAGES) & 1)
                    fence_async_shared()  # the producer's generic-proxy writes, read by wgmma
                    s = warpgroup_mma_wait(num_outstanding=0,
                                           deps=(_scores_async(q_l, q_r, q_p, kv_l, kv_r, kv_p, st, s_zero),))
                valid = (idx >= 0) & (idx < S)
                s = gl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) before a key
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                p16 = p.to(MMA_DTYPE)
                # hand P and alpha to the output group once it has consumed the previous tile's
                mbarrier.wait(p_free, (j & 1) ^ 1)
                p_smem.store(p16)
                alpha_smem.store(alpha)
                fence_async_shared()
                gl.thread_barrier()  # all four warps' stores are done before thread 0 arrives
                mbarrier.arrive(p_ready, count=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                pv = warpgroup_mma(gl.convert_layout(p16, p_layout), kv_l.index(st), acc, is_async=True)
                offs_k = offs_k + BK
                idx = gl.load(topk_row + offs_k, mask=offs_k < k_end, other=-1)
                if EARLY_S:
                    if j + 1 < n_tiles:
                        nxt = (j + 1) % STAGES
                        mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
                        fence_async_shared()
                        s_tok = _scores_async(q_l, q_r, q_p, kv_l, kv_r, kv_p, nxt, s_zero)
                        acc = warpgroup_mma_wait(num_outstanding=3, deps=(pv,))  # P V done, S's 3 groups not
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                gl.thread_barrier()
                mbarrier.arrive(empty.index(st), count=1)

            # epilogue: l to the output group, then the left half and the LSE
            l_smem.store(l_i)
            gl.thread_barrier()
            mbarrier.arrive(l_ready, count=1)
            empty_row = l_i == 0.0  # NaN is not empty: it reaches out and lse
            denom = gl.where(empty_row, 1.0, l_i)
            inv = gl.convert_layout(out_scale / denom, row_o)
            out = acc * inv[:, None]
            rows_o = h0 + gl.arange(0, BH, row_o)
            cols_o = gl.arange(0, HALF, gl.SliceLayout(0, o_layout))
            dst = out_ptr + (out_row0 + rows_o.to(gl.int64))[:, None] * 512 + cols_o[None, :]
            gl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(rows_o < H)[:, None])
            lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(denom)) * 0.6931471805599453)
            rows_s = h0 + gl.arange(0, BH, row_s)
            gl.store(lse_ptr + out_row0 + rows_s, lse, mask=rows_s < H)

        @gluon.jit
        def _output_partition(
            q_nope_ptr, q_pe_ptr, topk_row, kv_ptr, out_ptr, lse_ptr,
            q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
            ready, empty, p_ready, p_free, l_ready,
            b, h0, H, S, k_begin, k_end, n_tiles, out_row0, out_scale, stride_kv,
            BK: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
        ):  # fmt: skip
            """Warp group 1: O[:, 256:] += P V[:, 256:] per tile, then the right half of the output."""
            BH: gl.constexpr = 64
            HALF: gl.constexpr = 256
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HALF, 16])
            row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
            acc = gl.zeros([BH, HALF], gl.float32, o_layout)
            for j in range(n_tiles):
                st = j % STAGES
                mbarrier.wait(ready.index(st), (j // STAGES) & 1)  # (complete by now: orders the data)
                mbarrier.wait(p_ready, j & 1)
                fence_async_shared()
                alpha = alpha_smem.load(row_o)
                acc = acc * alpha[:, None]
                acc = warpgroup_mma(p_smem, kv_r.index(st), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(p_free, count=1)
                mbarrier.arrive(empty.index(st), count=1)
            mbarrier.wait(l_ready, 0)
            l_i = l_smem.load(row_o)
            denom = gl.where(l_i == 0.0, 1.0, l_i)
            out = acc * (out_scale / denom)[:, None]
            rows_o = h0 + gl.arange(0, BH, row_o)
            cols_o = HALF + gl.arange(0, HALF, gl.SliceLayout(0, o_layout))
            dst = out_ptr + (out_row0 + rows_o.to(gl.int64))[:, None] * 512 + cols_o[None, :]
            gl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(rows_o < H)[:, None])

        @gluon.jit
        def _prefetch_rows_l2(rows, ok, row_bytes):
            """One bulk L2 prefetch a KV row (``cp.async.bulk.prefetch.L2``, sm_90) where ``ok``."""
            gl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
                "=r,l,r,r", [rows, ok.to(gl.int32), gl.full(rows.shape, row_bytes, gl.int32, rows.type.layout)],
                dtype=gl.int32, is_pure=False, pack=1)

        @gluon.jit
        def _tile_rows(topk_row, kv_ptr, k0, k_end, S, stride_kv, layout: gl.constexpr, BK: gl.constexpr):
            """Row pointers of one key tile's KV rows (row 0 where skipped) and which are valid."""
            offs = k0 + gl.arange(0, BK, layout)
            idx = gl.load(topk_row + offs, mask=offs < k_end, other=-1)
            valid = (idx >= 0) & (idx < S)
            return kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * stride_kv, valid

        @gluon.jit
        def _producer_partition(
            q_nope_ptr, q_pe_ptr, topk_row, kv_ptr, out_ptr, lse_ptr,
            q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
            ready, empty, p_ready, p_free, l_ready,
            b, h0, H, S, k_begin, k_end, n_tiles, out_row0, out_scale, stride_kv,
            BK: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, PREFETCH: gl.constexpr,
            NO_GATHER: gl.constexpr,
        ):  # fmt: skip
            """Producer warps: gather each tile's KV rows into the stage ring (skipped entries
            zero-filled, so 0 * NaN from an unwritten row cannot reach the output). PREFETCH
            tiles ahead, each row is first prefetched into L2 (a bulk prefetch a row), so the
            gather into shared memory finds it there: with two stages only one tile is in flight
            to shared memory, and the prefetches keep more of the rows in flight."""
            HALF: gl.constexpr = 256
            DR: gl.constexpr = 64
            # 16 bytes a thread: FP8 widened to fp16 in registers and stored, bf16 one cp.async each
            ll: gl.constexpr = _gather_layout(FP8, HALF)
            lp: gl.constexpr = _gather_layout(FP8, DR)
            pfl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            row_bytes = (HALF * 2 + DR) * (1 if FP8 else 2)
            cols = gl.arange(0, HALF, gl.SliceLayout(0, ll))
            cols_p = HALF * 2 + gl.arange(0, DR, gl.SliceLayout(0, lp))
            for t in gl.static_range(STAGES, PREFETCH):  # tiles past the first stages, not reached below
                pf_rows, pf_ok = _tile_rows(topk_row, kv_ptr, k_begin + t * BK, k_end, S, stride_kv, pfl, BK)
                _prefetch_rows_l2(pf_rows, pf_ok, row_bytes)
            # the next tile's row pointers are loaded a tile ahead (their index loads off the path)
            rows, valid = _tile_rows(topk_row, kv_ptr, k_begin, k_end, S, stride_kv, gl.SliceLayout(1, ll), BK)
            rows_p, valid_p = _tile_rows(topk_row, kv_ptr, k_begin, k_end, S, stride_kv, gl.SliceLayout(1, lp), BK)
            for j in range(n_tiles):
                st = j % STAGES
                k0 = k_begin + j * BK
                if PREFETCH > 0:
                    pf_rows, pf_ok = _tile_rows(topk_row, kv_ptr, k0 + PREFETCH * BK, k_end, S, stride_kv, pfl, BK)
                    _prefetch_rows_l2(pf_rows, pf_ok, row_bytes)
                ptr_l = rows[:, None] + cols[None, :]
                ptr_p = rows_p[:, None] + cols_p[None, :]
                if NO_GATHER:  # measurement aid: the stages are released unfilled (compute time alone)
                    mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
                    gl.thread_barrier()
                    mbarrier.arrive(ready.index(st), count=1)
                elif FP8:
                    # loads first, so they fly while the stage is still being read
                    xl = gl.load(ptr_l, mask=valid[:, None], other=0.0)
                    xr = gl.load(ptr_l + HALF, mask=valid[:, None], other=0.0)
                    xp = gl.load(ptr_p, mask=valid_p[:, None], other=0.0)
                    rows, valid = _tile_rows(topk_row, kv_ptr, k0 + BK, k_end, S, stride_kv, gl.SliceLayout(1, ll), BK)
                    rows_p, valid_p = _tile_rows(topk_row, kv_ptr, k0 + BK, k_end, S, stride_kv,
                                                 gl.SliceLayout(1, lp), BK)
                    mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
                    kv_l.index(st).store(xl.to(gl.float16))
                    kv_r.index(st).store(xr.to(gl.float16))
                    kv_p.index(st).store(xp.to(gl.float16))
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(ready.index(st), count=1)
                else:
                    mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
                    async_copy.async_copy_global_to_shared(kv_l.index(st), ptr_l, mask=valid[:, None])
                    async_copy.async_copy_global_to_shared(kv_r.index(st), ptr_l + HALF, mask=valid[:, None])
                    async_copy.async_copy_global_to_shared(kv_p.index(st), ptr_p, mask=valid_p[:, None])
                    # every producer thread arrives when its own copies have landed
                    async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
                    rows, valid = _tile_rows(topk_row, kv_ptr, k0 + BK, k_end, S, stride_kv, gl.SliceLayout(1, ll), BK)
                    rows_p, valid_p = _tile_rows(topk_row, kv_ptr, k0 + BK, k_end, S, stride_kv,
                                                 gl.SliceLayout(1, lp), BK)

        # sizes are not specialized (one compile serves every B, H, K, S); strides are (alignment)
        @gluon.jit(do_not_specialize=["B", "H", "K", "S", "HB", "SPLITS", "split_len"])
        def _sparse_mla_hopper_kernel(
            q_nope_ptr, q_pe_ptr, kv_ptr, topk_ptr, out_ptr, lse_ptr,
            B, H, K, S, HB, SPLITS, split_len, qk_scale, out_scale, q_prescale,
            stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_kv, stride_topk,
            BK: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, Q_PRESCALE: gl.constexpr,
            MMA_DTYPE: gl.constexpr, PREFETCH: gl.constexpr, EARLY_S: gl.constexpr, NO_GATHER: gl.constexpr,
        ):  # fmt: skip
            BH: gl.constexpr = 64
            HALF: gl.constexpr = 256
            DR: gl.constexpr = 64
            # one flat grid, head blocks fastest: the CTAs of one request's head blocks are
            # neighbours and read the same gathered rows, mostly from L2 for the second one
            pid = gl.program_id(0)
            hb = pid % HB
            split = (pid // HB) % SPLITS
            b = pid // (HB * SPLITS)
            h0 = hb * BH
            k_begin = split * split_len
            k_end = gl.minimum(k_begin + split_len, K)
            n_tiles = gl.cdiv(k_end - k_begin, BK)
            out_row0 = (split * B + b).to(gl.int64) * H  # out is [splits, B, H, 512], lse [splits, B, H]
            topk_row = topk_ptr + b.to(gl.int64) * stride_topk

            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], MMA_DTYPE)
            qp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DR], MMA_DTYPE)
            kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, HALF], MMA_DTYPE)
            kvp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DR], MMA_DTYPE)
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BK], MMA_DTYPE)
            vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
            q_l = gl.allocate_shared_memory(MMA_DTYPE, [BH, HALF], q_layout)
            q_r = gl.allocate_shared_memory(MMA_DTYPE, [BH, HALF], q_layout)
            q_p = gl.allocate_shared_memory(MMA_DTYPE, [BH, DR], qp_layout)
            kv_l = gl.allocate_shared_memory(MMA_DTYPE, [STAGES, BK, HALF], kv_layout)
            kv_r = gl.allocate_shared_memory(MMA_DTYPE, [STAGES, BK, HALF], kv_layout)
            kv_p = gl.allocate_shared_memory(MMA_DTYPE, [STAGES, BK, DR], kvp_layout)
            p_smem = gl.allocate_shared_memory(MMA_DTYPE, [BH, BK], p_layout)
            alpha_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
            l_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                # BF16: each of the 128 producer threads arrives (cp.async.mbarrier.arrive.noinc);
                # FP8: one arrival after the producer's stores and fence
                mbarrier.init(ready.index(i), count=1 if FP8 or NO_GATHER else 128)
                mbarrier.init(empty.index(i), count=2)  # both consumer warp groups
            mbarrier.init(p_ready, count=1)
            mbarrier.init(p_free, count=1)
            mbarrier.init(l_ready, count=1)

            # (argument tuples written out in the call: a tuple held in a variable, or built with +,
            # turns its constexpr members into tensors)
            gl.warp_specialize([
                (_softmax_partition, (q_nope_ptr, q_pe_ptr, topk_row, out_ptr, lse_ptr,
                                      q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
                                      ready, empty, p_ready, p_free, l_ready,
                                      b, h0, H, S, k_begin, k_end, n_tiles, out_row0, qk_scale, out_scale,
                                      q_prescale, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                                      BK, STAGES, Q_PRESCALE, MMA_DTYPE, EARLY_S)),
                (_output_partition, (q_nope_ptr, q_pe_ptr, topk_row, kv_ptr, out_ptr, lse_ptr,
                                     q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
                                     ready, empty, p_ready, p_free, l_ready,
                                     b, h0, H, S, k_begin, k_end, n_tiles, out_row0, out_scale, stride_kv,
                                     BK, STAGES, FP8)),
                (_producer_partition, (q_nope_ptr, q_pe_ptr, topk_row, kv_ptr, out_ptr, lse_ptr,
                                     q_l, q_r, q_p, kv_l, kv_r, kv_p, p_smem, alpha_smem, l_smem,
                                     ready, empty, p_ready, p_free, l_ready,
                                     b, h0, H, S, k_begin, k_end, n_tiles, out_row0, out_scale, stride_kv,
                                     BK, STAGES, FP8, PREFETCH, NO_GATHER)),
            ], [4, 4], [160, 112])  # WORKER_REGS

        @triton.jit(do_not_specialize=["BH", "SPLITS"])
        def _combine_kernel(part_ptr, plse_ptr, out_ptr, lse_ptr, BH, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr):
            """out[r] = sum_s exp(lse_s - lse) part[s, r], lse = logsumexp_s lse_s over the splits of
            row r = (b, h). A split with LSE -inf has no key (weight 0, its part never read into the
            sum); a NaN LSE or a NaN part makes the row NaN. All splits empty: out 0, lse -inf."""
            r = tl.program_id(0).to(tl.int64)
            offs_s = tl.arange(0, BLOCK_S)
            in_s = offs_s < SPLITS
            lse_s = tl.load(plse_ptr + offs_s * BH + r, mask=in_s, other=float("-inf"))
            m = tl.max(tl.where(lse_s == lse_s, lse_s, float("-inf")), axis=0)  # NaN-free max
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp(lse_s - m_safe)  # 0 for -inf, NaN for NaN
            total = tl.sum(w, axis=0)
            cols = tl.arange(0, D)
            part = tl.load(part_ptr + (offs_s * BH + r)[:, None] * D + cols[None, :], mask=in_s[:, None], other=0.0)
            contrib = tl.where((w != 0.0)[:, None], w[:, None] * part, 0.0)  # (NaN w: NaN * part = NaN)
            empty = total == 0.0
            denom = tl.where(empty, 1.0, total)
            out = tl.sum(contrib, axis=0) / denom
            tl.store(out_ptr + r * D + cols, out.to(out_ptr.dtype.element_ty))
            tl.store(lse_ptr + r, tl.where(empty, float("-inf"), m_safe + tl.log(denom)))

    except Exception as e:  # pragma: no cover - a Gluon API this module does not know
        _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def default_splits(B: int, H: int, K: int, sms: int, block_k: int = BLOCK_K) -> int:
    """K splits for ``B * ceil(H / 64)`` CTAs on ``sms`` multiprocessors (one CTA fits an SM):
    none when the CTAs fill at least 3/4 of the GPU, else enough to fill it once, each split
    keeping two key tiles or more."""
    ctas = B * cdiv(H, BLOCK_H)
    if 4 * ctas >= 3 * sms:
        return 1
    return max(1, min(sms // ctas, cdiv(K, 2 * block_k)))


def _rows_aligned(kv: torch.Tensor) -> bool:
    """Whether every KV row starts on a 16-byte boundary: the gathers copy 16 bytes a thread (a
    KV whose last dim is strided is copied by the launcher, and so aligned)."""
    if kv.dim() != 2 or kv.stride(-1) != 1:
        return True
    return (kv.stride(0) * kv.element_size()) % 16 == 0 and kv.data_ptr() % 16 == 0


def _check(q_nope, q_pe, kv, topk, sm_scale, kv_scale) -> None:
    for name, t, nd in (("q_nope", q_nope, 3), ("q_pe", q_pe, 3), ("kv", kv, 2), ("topk", topk, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise ValueError(f"{_OP}: {name} must be a {nd}-dim tensor, got {getattr(t, 'shape', t)!r}")
    B, H, Dc = q_nope.shape
    if Dc != DC or tuple(q_pe.shape) != (B, H, DR) or kv.shape[1] != DC + DR:
        raise ValueError(
            f"{_OP}: needs q_nope [B, H, {DC}], q_pe [B, H, {DR}], kv [S, {DC + DR}]; got "
            f"{tuple(q_nope.shape)}, {tuple(q_pe.shape)}, {tuple(kv.shape)}"
        )
    if q_nope.dtype not in Q_DTYPES or q_pe.dtype != q_nope.dtype:
        raise ValueError(f"{_OP}: q_nope and q_pe must both be bf16 or fp16, got {q_nope.dtype}, {q_pe.dtype}")
    if kv.dtype in FP8_KV_DTYPES:
        if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)) or not kv_scale > 0:
            raise ValueError(f"{_OP}: FP8 kv needs a positive Python float kv_scale, got {kv_scale!r}")
    elif kv.dtype != q_nope.dtype:
        raise ValueError(f"{_OP}: kv must have the queries' dtype {q_nope.dtype} or be float8_e4m3fn, got {kv.dtype}")
    elif kv_scale is not None:
        raise ValueError(f"{_OP}: kv_scale is only for FP8 kv, got kv dtype {kv.dtype}")
    if topk.dtype not in (torch.int32, torch.int64) or topk.shape[0] != B:
        raise ValueError(f"{_OP}: topk must be int32/int64 [B={B}, K], got {topk.dtype} {tuple(topk.shape)}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"{_OP}: sm_scale must be a Python float, got {sm_scale!r}")
    check_same_device(_OP, q_nope=q_nope, q_pe=q_pe, kv=kv, topk=topk)
    if not _rows_aligned(kv):
        raise ValueError(f"{_OP}: kv rows must start on 16-byte boundaries (row stride {kv.stride(0)} "
                         f"elements of {kv.element_size()} bytes, data at {kv.data_ptr() % 16} mod 16)")
    if kv.shape[0] >= 2**31:
        raise ValueError(f"{_OP}: at most 2^31 - 1 KV rows (int32 slot ids), got {kv.shape[0]}")


def sparse_mla_hopper(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    sm_scale: float,
    kv_scale: float | None = None,
    *,
    num_splits: int | None = None,
    prefetch: int | None = None,
    early_s: bool | None = None,
    block_k: int | None = None,
    _compute_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``sparse_mla`` contract on the Hopper kernel (module docstring). No host sync;
    CUDA-graph capturable.

    ``num_splits``: K splits (default :func:`default_splits`); ``prefetch``: how many key tiles
    ahead the producer prefetches rows into L2 (default ``PREFETCH``; 0: none); ``early_s``: issue
    the next tile's score product before waiting for this tile's ``P V`` (default ``EARLY_S``);
    ``block_k``: keys of a tile, 64 (two stages) or 32 (four stages; default ``BLOCK_K``).
    When none of the four is given on a CUDA device, they come from the measured dispatch table
    (``hopper_tiles`` of the shape's entry, :mod:`dsa_dcp.kernels.dispatch`) where it has them.
    ``_compute_only`` is a measurement aid: the producer releases every stage unfilled, so the
    result is garbage and the time is the kernel's without its gathers."""
    _check(q_nope, q_pe, kv, topk, sm_scale, kv_scale)
    B, H, _ = q_nope.shape
    K = topk.shape[1]
    device = q_nope.device
    if B == 0 or H == 0 or K == 0:
        out = torch.zeros((B, H, DC), dtype=q_nope.dtype, device=device)
        return out, torch.full((B, H), float("-inf"), dtype=torch.float32, device=device)
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"{_OP}: cannot run here: {reason}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{_OP}: num_splits must be >= 1, got {num_splits}")
    if prefetch is not None and prefetch < 0:
        raise ValueError(f"{_OP}: prefetch must be >= 0, got {prefetch}")
    if num_splits is None and prefetch is None and early_s is None and block_k is None:
        choice = dispatch.choose(H, B, K, kv.dtype, device)  # measured for this shape, if any
        if choice is not None:
            num_splits = choice.hopper_tiles.get("num_splits")
            prefetch = choice.hopper_tiles.get("prefetch")
            early_s = choice.hopper_tiles.get("early_s")
            block_k = choice.hopper_tiles.get("block_k")
    block_k = block_k or BLOCK_K
    if block_k not in PIPELINES:
        raise ValueError(f"{_OP}: block_k must be one of {sorted(PIPELINES)}, got {block_k}")
    tiles = cdiv(K, block_k)
    splits = min(num_splits or default_splits(B, H, K, sm_count(device), block_k), tiles)
    split_len = cdiv(tiles, splits) * block_k
    splits = cdiv(K, split_len)  # every split has at least one key
    fp8 = kv.dtype in FP8_KV_DTYPES
    if prefetch is None:
        prefetch = PREFETCH
    if early_s is None:
        early_s = EARLY_S
    q_prescale = 1.0
    if fp8:
        mma_dtype = gl.float16
        q_prescale = 1.0 if q_nope.dtype == torch.float16 else 2.0**-8
    else:
        mma_dtype = gl.bfloat16 if q_nope.dtype == torch.bfloat16 else gl.float16
    scale = 1.0 if kv_scale is None else float(kv_scale)
    q_nope = last_dim_contiguous(q_nope)
    q_pe = last_dim_contiguous(q_pe)
    kv = last_dim_contiguous(kv)
    topk = topk.contiguous()
    lead = () if splits == 1 else (splits,)
    out = torch.empty(lead + (B, H, DC), dtype=q_nope.dtype if splits == 1 else torch.float32, device=device)
    lse = torch.empty(lead + (B, H), dtype=torch.float32, device=device)
    head_blocks = cdiv(H, BLOCK_H)
    _sparse_mla_hopper_kernel[(head_blocks * splits * B,)](
        q_nope, q_pe, kv, topk, out, lse,
        B, H, K, kv.shape[0], head_blocks, splits, split_len, float(sm_scale) * scale / q_prescale * math.log2(math.e), scale,
        q_prescale, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
        topk.stride(0),
        BK=block_k, STAGES=PIPELINES[block_k], FP8=fp8, Q_PRESCALE=q_prescale != 1.0, MMA_DTYPE=mma_dtype, PREFETCH=prefetch,
        EARLY_S=bool(early_s), NO_GATHER=bool(_compute_only),
        num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip
    if splits == 1:
        return out, lse
    merged = torch.empty((B, H, DC), dtype=q_nope.dtype, device=device)
    merged_lse = torch.empty((B, H), dtype=torch.float32, device=device)
    _combine_kernel[(B * H,)](out, lse, merged, merged_lse, B * H, splits, D=DC,
                              BLOCK_S=max(2, 1 << (splits - 1).bit_length()), num_warps=4)
    return merged, merged_lse
