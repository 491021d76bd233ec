"""Reference DSA model: MLA in absorbed decode form + a lightning indexer, on a paged KV pool.

Written once, for one device, in plain PyTorch; the two cache-touching steps go through the op
vocabulary (``torch.ops.dsa_dcp.kv_store`` and ``torch.ops.dsa_dcp.sparse_mla``) so each is one
node in a dynamo graph. The whole forward traces with ``fullgraph=True``: no data-dependent
Python control flow, no ``.item()``, no boolean-mask indexing.

Forward contract (one step of a batch of rows; a row is one token of one request)::

    logits[T, vocab] fp32 = model(input_ids[T] i64, positions[T] i64, req_ids[T] i64,
                                  slots[T] i64, page_table[R, max_pages] i32)

Padding rows have ``slots = -1`` and ``positions = -1``: they write nothing, their top-k is all
``-1`` and their attention output is 0. ``page_table[r, j]`` is the page holding positions
``[j*P, (j+1)*P)`` of request ``r`` (``-1`` = not allocated); slot of position ``p`` is
``page_table[r, p // P] * P + p % P``.

Tensor parallelism (``DSAModel(..., tp_size=T)`` or ``tp_group=``): each TP rank holds ``H / T``
query heads, i.e. its rows of ``wq_b`` (column-parallel), its heads of ``w_uk`` / ``w_uv``, and its
columns of ``w_o`` (row-parallel), whose output is summed over the TP group; the SwiGLU MLP is
column-parallel (``w_gate_up``: each rank its columns of the gate and of the up projection) then
row-parallel (``w_down``) with its own sum. The
embedding and the LM head are replicated (every rank gets the whole vocabulary's logits), and so
are the MLA latent KV cache (one KV head) and the indexer (every rank scores all index heads, as
published inference code does). ``shard_for_tp`` slices an unsharded model's weights into a
rank's shard; a TP model drawn from ``seed`` holds exactly that shard of the unsharded model of
the same seed. ``tp_size=1`` is the single-device model: same parameters, same graph, no
collective.

The sums are ``torch.distributed._functional_collectives.all_reduce(x, "sum", group_name)``: a
functional collective (a new tensor, no in-place write to a graph value) named by the group's
``group_name`` string, so dynamo traces it with ``fullgraph=True`` into
``_c10d_functional.all_reduce`` + ``wait_tensor`` nodes, the same form as the DCP passes' own
collectives (``docs/dcp.md``), which runs on gloo and NCCL alike; eager code gets the same values
(an ``AsyncCollectiveTensor`` that waits at its first use). The in-place ``dist.all_reduce`` also
traces (dynamo rewrites it into this functional form, as the plain model relies on), but writes
into a graph value. A string rather than the ``ProcessGroup`` object keeps the module's state
plain (a constant for dynamo, nothing to guard on).
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

import dsa_dcp.ops  # noqa: F401  (registers torch.ops.dsa_dcp.*)
from dsa_dcp.kernels.kv_store import quantize_rows
from dsa_dcp.kv_cache import allocate_block_scales, allocate_index_cache, allocate_kv_cache, is_index_cache, kv_layout

from .config import DSAConfig

# The model calls the overloads (not the packets) so dynamo records the exact targets the passes
# look for (``dsa_dcp.ops.SPARSE_ATTENTION_OPS``, ``passes.kv_writes.KV_STORE``).
KV_STORE = torch.ops.dsa_dcp.kv_store.default
KV_STORE_BLOCK_SCALED = torch.ops.dsa_dcp.kv_store_block_scaled.default
SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default

__all__ = ["DSAModel", "DSALayer", "MLAAttention", "MTPLayer", "LightningIndexer", "SwiGLU", "RMSNorm",
           "TensorParallel", "check_tp_size", "shard_for_tp", "rope_inv_freq", "apply_rope"]


# ---------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group: ``size`` ranks, this one ``rank``; ``group_name`` names
    the group for the functional collectives (None when ``size == 1``)."""

    size: int = 1
    rank: int = 0
    group_name: str | None = None


SINGLE = TensorParallel()

# Parameters split over the TP ranks, by leaf name -> the dim split (head-major or MLP columns).
# Every other parameter (w_in: wq_a, wkv_a and the indexer's input products; the norms, the indexer,
# embed, lm_head) is replicated.
TP_SPLIT_DIMS = {"wq_b": 0, "w_uk": 0, "w_uv": 0, "w_o": 1, "w_gate_up": 0, "w_down": 1}
# Split parameters that stack equal parts along the split dim (w_gate_up: the gate's rows, then the
# up projection's): a rank keeps its block of each part, the parts stacked again.
TP_STACKED_PARTS = {"w_gate_up": 2}


def check_tp_size(cfg: DSAConfig, tp_size: int) -> None:
    """Refuse a TP size that does not split the heads and the MLP evenly (``ValueError``)."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    problems = [f"{name}={value}" for name, value in (("n_heads", cfg.n_heads),
                                                      ("intermediate_size", cfg.intermediate_size))
                if value % tp_size]
    if problems:
        raise ValueError(f"tp_size={tp_size} does not divide {' and '.join(problems)} of {cfg.name!r}: each TP rank "
                         f"holds n_heads / tp_size query heads and intermediate_size / tp_size MLP columns")


def _resolve_tp(cfg: DSAConfig, tp_size: int | None, tp_group) -> TensorParallel:
    if tp_size is not None:
        check_tp_size(cfg, tp_size)
    if tp_group is None:
        if tp_size is None or tp_size == 1:
            return SINGLE
        if not dist.is_initialized():
            raise ValueError(f"tp_size={tp_size} needs an initialized process group (torch.distributed), "
                             f"or tp_group=")
        world = dist.get_world_size()
        if world != tp_size:
            raise ValueError(f"tp_size={tp_size} in a world of {world} rank(s): the TP group defaults to the whole "
                             f"world; pass tp_group= (e.g. dist.new_group(ranks)) for a group of {tp_size}")
        tp_group = dist.group.WORLD
    if not dist.is_initialized():
        raise ValueError("tp_group= needs an initialized process group (torch.distributed)")
    size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of tp_group")
    if tp_size is not None and tp_size != size:
        raise ValueError(f"tp_size={tp_size} but tp_group has {size} rank(s)")
    check_tp_size(cfg, size)
    return TensorParallel(size, rank, tp_group.group_name) if size > 1 else SINGLE


def _tp_sum(x: Tensor, tp: TensorParallel) -> Tensor:
    """Sum of the TP ranks' partial results (the identity at ``tp.size == 1``)."""
    if tp.size == 1:
        return x
    return funcol.all_reduce(x, "sum", tp.group_name)


def _tp_slice(name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    leaf = name.rsplit(".", 1)[-1]
    dim = TP_SPLIT_DIMS.get(leaf)
    if dim is None or tp_size == 1:
        return full
    parts = TP_STACKED_PARTS.get(leaf, 1)
    if full.shape[dim] % (tp_size * parts):
        raise ValueError(f"tp_size={tp_size} does not divide dim {dim} of {name} (shape {tuple(full.shape)}"
                         f"{f', {parts} stacked parts' if parts > 1 else ''})")
    block = full.shape[dim] // (tp_size * parts)
    return torch.cat([p.narrow(dim, tp_rank * block, block) for p in full.chunk(parts, dim)], dim)


def shard_for_tp(full: "DSAModel | Mapping[str, Tensor]", tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s state dict, sliced out of an unsharded ``DSAModel`` or its state dict.

    Split parameters (``TP_SPLIT_DIMS``) keep this rank's contiguous ``1 / tp_size`` block of their
    split dim (heads ``[r * H/T, (r+1) * H/T)``, MLP columns likewise; of each stacked part for
    ``w_gate_up``, ``TP_STACKED_PARTS``); the rest are kept whole.
    Load it with ``load_state_dict`` into a ``DSAModel`` of that TP rank (``load_unsharded`` does both).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if isinstance(full, DSAModel):
        if full.tp.size != 1:
            raise ValueError(f"shard_for_tp needs the unsharded model; this one is TP rank {full.tp.rank} "
                             f"of {full.tp.size}")
        check_tp_size(full.cfg, tp_size)
        full = full.state_dict()
    return {name: _tp_slice(name, t, tp_rank, tp_size).clone() for name, t in full.items()}


# ---------------------------------------------------------------------- small pieces


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_inv_freq(dim: int, theta: float) -> Tensor:
    """``theta ** (-2i / dim)`` for ``i < dim / 2`` (fp32, computed in fp64)."""
    return (theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` (half-split / NeoX layout). ``cos, sin``: ``[T, d/2]``,
    broadcast over any head dims between T and the last."""
    half = x.shape[-1] // 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP standing in for DeepSeek/GLM's MoE (the DCP rewrite never touches it).
    Under TP each rank holds ``intermediate_size / T`` columns and the output is summed.

    The gate and up projections share one weight, ``w_gate_up`` (the gate's rows, then up's): one
    matrix product on the input instead of two."""

    def __init__(self, cfg: DSAConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.inter = inter = cfg.intermediate_size // tp.size  # column-parallel gate / up, row-parallel w_down
        self.w_gate_up = nn.Parameter(torch.empty(2 * inter, cfg.hidden_size))
        self.w_down = nn.Parameter(torch.empty(cfg.hidden_size, inter))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w_gate_up).split(self.inter, dim=-1)
        return _tp_sum(F.linear(F.silu(gate) * up, self.w_down), self.tp)


# ---------------------------------------------------------------------- indexer


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2 lightning indexer: picks each row's top-k KV slots of its own request.

    ``score[t, p] = sum_h w[t, h] * relu(q[t, h] . k[slot(p)])`` over positions ``p <= pos[t]``
    of row t's request; the keys are read from ``index_cache`` (written here for this step's rows
    first, so a chunk sees its own earlier rows; the code reads it as the whole cache, which a
    sharded one is not: the ``indexer_kernels`` pass and ``index_cache="sharded"`` replace it). Candidates span the full
    per-request capacity ``max_pages * P`` (static shape). Returns int32 ``[T, K]`` global slots,
    ``K = min(index_topk, max_pages * P)``, best first, ``-1`` where the row has < K candidates.

    Its two products on the layer's input (``x @ wk^T``, the key, and ``x @ weights_proj^T``, the
    head weights) are rows of the attention's merged input weight (``MLAAttention.w_in``): the
    forward takes their results, ``k_in[T, index_head_dim]`` and ``w_in[T, index_n_heads]``.
    """

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        di, hi = cfg.index_head_dim, cfg.index_n_heads
        self.wq = nn.Parameter(torch.empty(hi * di, cfg.q_lora_rank))
        self.k_norm = nn.LayerNorm(di, eps=cfg.norm_eps)
        self.weight_scale = hi**-0.5 * di**-0.5
        self.register_buffer("index_cache", torch.zeros(0, di), persistent=False)  # sized by DSAModel
        # FP8 keys (cfg.index_key_dtype == "fp8"): one fp32 scale a token, kv_store writes it
        self.register_buffer("key_scale", torch.zeros(0), persistent=False)

    def _rope_first(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.cfg.index_rope_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, k_in: Tensor, w_in: Tensor, q_a: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor,
                page_table: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cfg = self.cfg
        t = k_in.shape[0]
        k = self._rope_first(self.k_norm(k_in), cos, sin)
        fp8 = cfg.index_key_dtype == "fp8"
        if fp8:  # quantized by kv_store, its per-token scale written beside it
            KV_STORE_BLOCK_SCALED(self.index_cache, slots, k, self.key_scale)
        else:
            KV_STORE(self.index_cache, slots, k.to(self.index_cache.dtype))

        q = self._rope_first(F.linear(q_a, self.wq).view(t, cfg.index_n_heads, cfg.index_head_dim), cos, sin)
        w = w_in.float() * self.weight_scale  # [T, Hi]
        if fp8:  # queries in E4M3 too, as DeepSeek-V3.2's inference scores FP8 keys: one power-of-two
            # scale a head (the keys' rule), folded into its weight; the products run FP8 x FP8
            q, q_scale = quantize_rows(q.reshape(t * cfg.index_n_heads, cfg.index_head_dim), block=True)
            q = q.view(t, cfg.index_n_heads, cfg.index_head_dim)
            w = w * q_scale.view(t, cfg.index_n_heads)

        # Candidate slots: every position of the row's request, over the full capacity.
        page_size = cfg.page_size
        pages = page_table.index_select(0, req_ids.clamp(min=0)).long()  # [T, max_pages]
        offs = torch.arange(page_size, device=pages.device)
        cand = (pages.unsqueeze(-1) * page_size + offs).flatten(1)  # [T, C]
        capacity = cand.shape[1]
        pos = torch.arange(capacity, device=cand.device)
        valid = (pos.unsqueeze(0) <= positions.unsqueeze(1)) & (cand >= 0)

        keys = self.index_cache[cand.clamp(min=0)].float()  # [T, C, Di]
        if fp8:  # the real key is e4m3 * its token's scale
            keys = keys * self.key_scale[cand.clamp(min=0)].unsqueeze(-1)
        logits = torch.einsum("thd,tcd->thc", q.float(), keys).relu()
        score = torch.einsum("thc,th->tc", logits, w)
        score = score.masked_fill(~valid, float("-inf"))

        top_score, top_idx = torch.topk(score, min(cfg.index_topk, capacity), dim=-1)
        top_slots = cand.gather(1, top_idx)
        return torch.where(top_score == float("-inf"), torch.full_like(top_slots, -1), top_slots).to(torch.int32)


# ---------------------------------------------------------------------- attention


class MLAAttention(nn.Module):
    """Multi-head latent attention, absorbed decode form, over the top-k slots.

    The epilogue is kept in exactly the form the DCP merge pass pattern-matches to shard by
    heads: ``einsum("thc,hcv->thv", out, w_uv)`` -> ``flatten(1)`` -> ``linear(., w_o)`` (under
    TP followed by the sum over the TP group). Under TP the layer holds ``n_local_heads = H / T``
    heads; the latent KV cache and the indexer are whole.
    """

    def __init__(self, cfg: DSAConfig, layer: int, tp: TensorParallel = SINGLE, indexer: bool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.tp = tp
        self.n_local_heads = h = cfg.n_heads // tp.size
        own_indexer = cfg.has_indexer(layer) if indexer is None else indexer  # the MTP layer always owns one
        # The products on the layer's input share one weight, its rows wq_a, wkv_a, then the indexer's
        # wk and weights_proj: one matrix product a layer instead of four (docs/models.md)
        self.in_sizes = (cfg.q_lora_rank, cfg.kv_dim) + ((cfg.index_head_dim, cfg.index_n_heads) if own_indexer else ())
        self.w_in = nn.Parameter(torch.empty(sum(self.in_sizes), cfg.hidden_size))
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Parameter(torch.empty(h * cfg.qk_head_dim, cfg.q_lora_rank))
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.w_uk = nn.Parameter(torch.empty(h, cfg.qk_nope_head_dim, cfg.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(h, cfg.kv_lora_rank, cfg.v_head_dim))
        self.w_o = nn.Parameter(torch.empty(cfg.hidden_size, h * cfg.v_head_dim))
        self.indexer = LightningIndexer(cfg) if own_indexer else None
        self.register_buffer("kv_cache", torch.zeros(0, cfg.kv_dim), persistent=False)  # sized by DSAModel
        # FP8 KV with kv_scales="block": fp32 [rows, ceil(kv_dim / 128)], written by kv_store beside each row
        self.register_buffer("kv_block_scales", torch.zeros(0), persistent=False)

    def input_weights(self) -> tuple[Tensor, ...]:
        """Views of ``w_in``'s parts: ``(wq_a, wkv_a)``, then the indexer's ``(wk, weights_proj)`` where
        the layer owns one."""
        return self.w_in.split(self.in_sizes)

    def kv_scale_args(self) -> tuple:
        """The scale arguments of this layer's ``kv_store`` and ``sparse_mla`` calls: none for a cache
        in the model's dtype; ``(kv_scale,)`` for FP8 per tensor; ``(None, block_scales)`` per 128 columns."""
        cfg = self.cfg
        if cfg.kv_dtype != "fp8":
            return ()
        return (cfg.kv_scale,) if cfg.kv_scales == "tensor" else (None, self.kv_block_scales)

    def forward(self, x: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor, page_table: Tensor,
                topk: Tensor | None, rope: tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Returns ``(o[T, hidden], topk[T, K])``; ``topk`` is this layer's own (indexer layers) or
        the one passed in (IndexShare layers)."""
        cfg = self.cfg
        t = x.shape[0]
        cos, sin, idx_cos, idx_sin = rope
        dc = cfg.kv_lora_rank

        q_a, kv_a, *index_in = F.linear(x, self.w_in).split(self.in_sizes, dim=-1)
        q_a = self.q_a_norm(q_a)
        q = F.linear(q_a, self.wq_b).view(t, self.n_local_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)

        c_kv = self.kv_a_norm(kv_a[:, :dc])
        k_pe = apply_rope(kv_a[:, dc:], cos, sin)
        row = torch.cat([c_kv, k_pe], dim=-1)
        scales = self.kv_scale_args()
        if cfg.kv_dtype != "fp8":
            KV_STORE(self.kv_cache, slots, row.to(self.kv_cache.dtype))
        elif cfg.kv_scales == "tensor":  # FP8: quantized by the store
            KV_STORE(self.kv_cache, slots, row, cfg.kv_scale)
        else:
            KV_STORE_BLOCK_SCALED(self.kv_cache, slots, row, self.kv_block_scales)

        if self.indexer is not None:
            topk = self.indexer(*index_in, q_a, positions, req_ids, slots, page_table, idx_cos, idx_sin)
        assert topk is not None, "a layer without an indexer needs the previous indexer's top-k"

        q_lat = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        out, lse = SPARSE_MLA(q_lat, q_pe.contiguous(), self.kv_cache, topk, cfg.sm_scale, *scales)
        o = torch.einsum("thc,hcv->thv", out, self.w_uv)
        o = o.flatten(1)
        o = torch.nn.functional.linear(o, self.w_o)
        return _tp_sum(o, self.tp), topk


class DSALayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer: int, tp: TensorParallel = SINGLE, indexer: bool | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = MLAAttention(cfg, layer, tp, indexer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, tp)

    def forward(self, h: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor, page_table: Tensor,
                topk: Tensor | None, rope: tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, topk = self.attn(self.attn_norm(h), positions, req_ids, slots, page_table, topk, rope)
        h = h + a
        h = h + self.mlp(self.mlp_norm(h))
        return h, topk


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token prediction layer: the draft of speculative decoding.

    Row ``t`` at position ``p`` takes the token at ``p + 1`` and the hidden state ``h_p`` the target
    model (or the previous draft step) produced at ``p``; each is RMS-normed, they are concatenated
    (embedding first) and projected ``2d -> d`` (``eh_proj``), then one decoder layer with its own
    MLA attention, lightning indexer and KV cache (written at the row's own slot, as the target's
    row at ``p`` is) gives ``h'_p``, whose norm the model's shared output head reads to predict the
    token at ``p + 2``. Returns ``(logits, hidden)``; ``hidden`` (after ``norm``) feeds the next draft
    step of a chain.
    """

    def __init__(self, cfg: DSAConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.eh_proj = nn.Parameter(torch.empty(cfg.hidden_size, 2 * cfg.hidden_size))
        self.layer = DSALayer(cfg, cfg.n_layers, tp, indexer=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, embedded: Tensor, hidden: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor,
                page_table: Tensor, rope: tuple[Tensor, Tensor, Tensor, Tensor], lm_head: Tensor
                ) -> tuple[Tensor, Tensor]:
        h = F.linear(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1), self.eh_proj)
        h, _ = self.layer(h, positions, req_ids, slots, page_table, None, rope)
        h = self.norm(h)
        return F.linear(h, lm_head).float(), h


# ---------------------------------------------------------------------- model


class DSAModel(nn.Module):
    """DeepSeek-V3.2 / GLM-5-shaped decoder with sparse attention on a paged KV pool.

    ``num_slots`` is the global slot pool size S. The KV caches are allocated by
    ``dsa_dcp.kv_cache.allocate_kv_cache(S, Dc + Dr, dcp_size=, interleave=)``, so a DCP rank
    holds only the ``local_cache_rows(S, N, I)`` rows it owns and the backend can read the layout
    off the tensor (``dcp_size=1``: the global cache). ``kv_rows`` instead gives a raw cache of
    that many rows with no recorded layout (an escape hatch; the DCP backend refuses it). The
    index-key caches (``dsa_dcp.kv_cache.allocate_index_cache``) are global ``[S, index_head_dim]``
    with ``index_cache="replicated"`` (every rank holds every key), or, with
    ``index_cache="sharded"``, this rank's ``local_cache_rows(S, N, I)`` rows like the KV caches
    (compile with the same ``index_cache`` option).

    Weights are drawn on the CPU from ``seed`` (the same values on every device), then
    cast/moved; caches are allocated directly at ``dtype``/``device`` (the KV and index-key caches at
    the config's ``kv_dtype`` / ``index_key_dtype`` when it names one: FP8 E4M3 with their scales,
    which ``kv_store`` writes and the attention and the indexer read; docs/models.md, "FP8 KV"). ``model.to(...)`` keeps
    the KV layouts (``_apply`` re-records them).

    Buffers (non-persistent): ``layers[i].attn.kv_cache`` for every layer,
    ``layers[i].attn.indexer.index_cache`` for indexer layers.

    MTP (``cfg.mtp_layers == 1``): ``mtp`` is an ``MTPLayer`` (the speculative decoding draft, run by
    ``draft``) with its own ``mtp.layer.attn.kv_cache`` and index cache, allocated whole on every rank
    (``draft_cache="replicated"``, compiled with ``replicated_modules=["mtp"]``) or split like the
    target's (``draft_cache="split"``).

    Tensor parallelism (module docstring): ``tp_size=T`` splits the model over the whole world
    (which must have T ranks), ``tp_group=`` over the given process group (several TP groups can
    sit side by side in one world); ``model.tp`` is this rank's ``TensorParallel``. The seeded
    weights are this TP rank's shard of the unsharded model of the same seed;
    ``load_unsharded(full)`` loads the shard of any unsharded model's weights.
    """

    def __init__(self, cfg: DSAConfig, num_slots: int, *, kv_rows: int | None = None, dcp_size: int = 1,
                 interleave: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, index_cache: str = "replicated", tp_size: int | None = None,
                 tp_group: dist.ProcessGroup | None = None, draft_cache: str = "replicated") -> None:
        super().__init__()
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.cfg = cfg
        self.num_slots = num_slots
        self.tp = _resolve_tp(cfg, tp_size, tp_group)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DSALayer(cfg, i, self.tp) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # registered last, so the target's weights drawn from ``seed`` are the same with or without it
        self.mtp = MTPLayer(cfg, self.tp) if cfg.mtp_layers else None
        self._init_weights(seed)
        self.to(device=device, dtype=dtype)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta).to(device),
                             persistent=False)
        self.register_buffer("index_rope_inv_freq", rope_inv_freq(cfg.index_rope_dim, cfg.rope_theta).to(device),
                             persistent=False)
        self.allocate_caches(dcp_size=dcp_size, interleave=interleave, kv_rows=kv_rows, index_cache=index_cache,
                             draft_cache=draft_cache)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Drawn at the unsharded shapes, then sliced: a TP rank holds its shard of the seed's model.
        gen = torch.Generator(device="cpu").manual_seed(seed)
        tp = self.tp
        for name, p in self._weights_in_draw_order():
            leaf = name.rsplit(".", 1)[-1]
            shape = list(p.shape)
            if leaf in TP_SPLIT_DIMS:
                shape[TP_SPLIT_DIMS[leaf]] *= tp.size
            if name.endswith("norm.weight"):  # RMSNorm / LayerNorm gains near 1
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("norm.bias"):
                value = 0.1 * torch.randn(shape, generator=gen)
            elif leaf == "embed":
                value = torch.randn(shape, generator=gen)
            else:  # projections: unit gain over the contracted dim
                fan_in = {"w_uk": shape[-1], "w_uv": shape[1]}.get(leaf, shape[-1])
                value = torch.randn(shape, generator=gen) * fan_in**-0.5
            p.copy_(_tp_slice(name, value, tp.rank, tp.size))

    def _weights_in_draw_order(self):
        """``(name, tensor)`` in the order ``_init_weights`` draws them: the parameters, except that each
        attention's ``w_in`` is drawn as the weights it holds, each where it stood in the parameter
        order before they were merged (``wq_a`` first, ``wkv_a`` after ``wq_b``, the indexer's ``wk``
        and ``w_weights`` after its ``wq``), so a seed gives the weights it always gave."""
        after: dict[str, list] = {}
        for name, p in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if leaf != "w_in":
                yield name, p
                yield from after.pop(name, [])
                continue
            wq_a, wkv_a, *index = self.get_submodule(prefix).input_weights()
            yield f"{prefix}.wq_a", wq_a
            after[f"{prefix}.wq_b"] = [(f"{prefix}.wkv_a", wkv_a)]
            if index:
                after[f"{prefix}.indexer.wq"] = list(zip((f"{prefix}.indexer.wk", f"{prefix}.indexer.w_weights"), index))
        assert not after, f"weights left undrawn: {list(after)}"

    def load_unsharded(self, full: "DSAModel | Mapping[str, Tensor]") -> "DSAModel":
        """Load this TP rank's shard (``shard_for_tp``) of an unsharded model's weights; returns self."""
        self.load_state_dict(shard_for_tp(full, self.tp.rank, self.tp.size))
        return self

    # ------------------------------------------------------------------ caches
    def attention_layers(self) -> list[MLAAttention]:
        """Every attention module that owns a KV cache: the target's layers in order, then the MTP layer's."""
        return [layer.attn for layer in self.layers] + ([self.mtp.layer.attn] if self.mtp is not None else [])

    def allocate_caches(self, *, dcp_size: int = 1, interleave: int = 1, kv_rows: int | None = None,
                        index_cache: str = "replicated", draft_cache: str = "replicated") -> None:
        """(Re)allocate every cache, zeroed, at the model's dtype/device (see class docstring).

        ``draft_cache``: ``"replicated"`` (default) gives the MTP layer whole caches on every rank
        (compile its step with ``replicated_modules=["mtp"]``); ``"split"`` splits its KV cache over
        the DCP group like the target's (its index cache then follows ``index_cache``)."""
        if index_cache not in ("replicated", "sharded"):
            raise ValueError(f"index_cache must be 'replicated' or 'sharded', got {index_cache!r}")
        if draft_cache not in ("replicated", "split"):
            raise ValueError(f"draft_cache must be 'replicated' or 'split', got {draft_cache!r}")
        self.dcp_size = dcp_size if kv_rows is None else 1
        self.draft_dcp_size = self.dcp_size if draft_cache == "split" else 1
        self.index_cache = index_cache
        ref, cfg = self.embed, self.cfg
        kv_dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}.get(cfg.kv_dtype, ref.dtype)
        key_dtype = torch.float8_e4m3fn if cfg.index_key_dtype == "fp8" else ref.dtype
        none = torch.zeros(0, device=ref.device)
        for attn in self.attention_layers():
            draft = self.mtp is not None and attn is self.mtp.layer.attn
            size = self.draft_dcp_size if draft else dcp_size
            sharded_keys = index_cache == "sharded" and (not draft or draft_cache == "split")
            if kv_rows is None:
                attn.kv_cache = allocate_kv_cache(self.num_slots, cfg.kv_dim, dcp_size=size,
                                                  interleave=interleave, dtype=kv_dtype, device=ref.device)
            else:
                attn.kv_cache = torch.zeros(kv_rows, cfg.kv_dim, dtype=kv_dtype, device=ref.device)
            fp8_blocks = cfg.kv_dtype == "fp8" and cfg.kv_scales == "block"
            attn.kv_block_scales = allocate_block_scales(attn.kv_cache) if fp8_blocks else none
            if attn.indexer is not None:
                attn.indexer.index_cache = allocate_index_cache(
                    self.num_slots, cfg.index_head_dim, dcp_size=size, interleave=interleave,
                    sharded=sharded_keys, dtype=key_dtype, device=ref.device)
                attn.indexer.key_scale = allocate_block_scales(attn.indexer.index_cache, per_row=True) \
                    if cfg.index_key_dtype == "fp8" else none

    def _apply(self, fn, recurse=True):
        # A move/cast makes new cache tensors; keep their recorded KV layouts and index-cache marks.
        attns = self.attention_layers() if hasattr(self, "mtp") else []
        owners = [(attn, "kv_cache") for attn in attns] + \
            [(attn.indexer, "index_cache") for attn in attns if attn.indexer is not None]
        before = [(kv_layout(getattr(m, name)), is_index_cache(getattr(m, name))) for m, name in owners]
        # FP8 caches and their fp32 scales keep their dtype through model.to(dtype): a cast would drop
        # the quantization (or round the scales); only the device follows fn
        pinned = [(m, name, getattr(m, name)) for m, name in owners
                  if getattr(m, name).dtype == torch.float8_e4m3fn] + \
            [(m, name, getattr(m, name)) for m in self.modules() for name in ("kv_block_scales", "key_scale")
             if isinstance(getattr(m, name, None), Tensor) and getattr(m, name).numel()] \
            if hasattr(self, "layers") else []
        out = super()._apply(fn, recurse)
        for module, name, old in pinned:
            new = getattr(module, name)
            if new.dtype != old.dtype:
                setattr(module, name, old.to(device=new.device))
        for (module, name), (layout, index) in zip(owners, before):
            cache = getattr(module, name)
            if (layout is None or kv_layout(cache) is not None) and (not index or is_index_cache(cache)):
                continue
            if index:
                fresh = allocate_index_cache(self.num_slots, cache.shape[1], dcp_size=getattr(layout, "dcp_size", 1),
                                             interleave=getattr(layout, "interleave", 1), sharded=layout is not None,
                                             dtype=cache.dtype, device=cache.device)
            else:
                fresh = allocate_kv_cache(layout.num_slots, cache.shape[1], dcp_size=layout.dcp_size,
                                          interleave=layout.interleave, dtype=cache.dtype, device=cache.device)
            setattr(module, name, fresh.copy_(cache))
        if hasattr(self, "rope_inv_freq"):  # rope tables stay fp32 whatever the model dtype
            dev = self.rope_inv_freq.device
            self.rope_inv_freq = rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta).to(dev)
            self.index_rope_inv_freq = rope_inv_freq(self.cfg.index_rope_dim, self.cfg.rope_theta).to(dev)
        return out

    @property
    def kv_rows(self) -> int:
        return self.layers[0].attn.kv_cache.shape[0]

    def kv_caches(self) -> list[Tensor]:
        """Every layer's KV cache, layer order (the target's; the MTP layer's is ``draft_kv_cache()``)."""
        return [layer.attn.kv_cache for layer in self.layers]

    def draft_kv_cache(self) -> Tensor:
        """The MTP layer's KV cache (whole on every rank unless allocated with ``draft_cache="split"``)."""
        if self.mtp is None:
            raise ValueError(f"{self.cfg.name!r} has no MTP layer; build it with get_config(..., mtp_layers=1)")
        return self.mtp.layer.attn.kv_cache

    def index_caches(self) -> dict[int, Tensor]:
        """Index-key cache of each indexer layer, keyed by layer id."""
        return {i: layer.attn.indexer.index_cache for i, layer in enumerate(self.layers)
                if layer.attn.indexer is not None}

    @torch.no_grad()
    def reset_caches(self) -> None:
        """Zero every cache: the target's and the MTP layer's, with the FP8 caches' scales."""
        for attn in self.attention_layers():
            attn.kv_cache.zero_()
            attn.kv_block_scales.zero_()
            if attn.indexer is not None:
                attn.indexer.index_cache.zero_()
                attn.indexer.key_scale.zero_()

    # ------------------------------------------------------------------ forward
    def _refuse_eager(self, dcp_size: int, what: str) -> None:
        if dcp_size > 1 and not torch.compiler.is_compiling():
            # The caches hold this rank's rows only: the code as written would index them with
            # global slots. This runs only if dynamo fell back to eager (a graph break, or the
            # recompile limit), and must fail loudly rather than attend over the wrong rows.
            raise RuntimeError(
                f"this model's {what} allocated for dcp_size={dcp_size}; run it through "
                f"torch.compile(backend='dsa_dcp', options={{'dcp_size': {dcp_size}, ...}}, fullgraph=True) "
                f"(it ran eagerly: a graph break or dynamo's recompile limit)"
            )

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.rope_inv_freq
        idx_freqs = positions.float().unsqueeze(-1) * self.index_rope_inv_freq
        return freqs.cos(), freqs.sin(), idx_freqs.cos(), idx_freqs.sin()

    def forward(self, input_ids: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor,
                page_table: Tensor, return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``logits[T, vocab]`` (fp32); with ``return_hidden=True`` also the final hidden states
        ``[T, hidden]`` (after the final norm: what the output head reads, and what ``draft`` takes)."""
        self._refuse_eager(self.dcp_size, "KV caches are")
        rope = self._rope(positions)
        h = F.embedding(input_ids, self.embed)
        topk: Tensor | None = None
        for layer in self.layers:
            h, topk = layer(h, positions, req_ids, slots, page_table, topk, rope)
        h = self.norm(h)
        logits = F.linear(h, self.lm_head).float()
        return (logits, h) if return_hidden else logits

    def draft(self, input_ids: Tensor, positions: Tensor, req_ids: Tensor, slots: Tensor, page_table: Tensor,
              hidden: Tensor) -> tuple[Tensor, Tensor]:
        """One MTP step (``MTPLayer``): row ``t`` holds the token at ``positions[t] + 1`` and the hidden
        state produced at ``positions[t]``; it writes the MTP layer's caches at ``slots[t]`` (the slot of
        ``positions[t]``) and returns ``(logits[T, vocab] fp32, hidden[T, hidden])``: the logits predict
        the token at ``positions[t] + 2``, the hidden feeds the next step of a draft chain. Padding rows
        as in ``forward``."""
        if self.mtp is None:
            raise ValueError(f"{self.cfg.name!r} has no MTP layer; build it with get_config(..., mtp_layers=1)")
        self._refuse_eager(self.draft_dcp_size, "MTP (draft) caches are")
        embedded = F.embedding(input_ids, self.embed)
        return self.mtp(embedded, hidden.to(embedded.dtype), positions, req_ids, slots, page_table,
                        self._rope(positions), self.lm_head)
