"""A DSA model written the way model authors publish inference code next to their weights.

This module is the test subject for DCP on unmodified models, so it imports nothing from
``dsa_dcp`` and follows the shape of DeepSeek-V3.2-Exp's ``inference/model.py`` (our own code,
bf16/fp32 arithmetic instead of the FP8 kernels, a dense SwiGLU instead of the MoE):

- per-request caches ``kv_cache[max_batch, max_seq_len, Dc]`` and ``pe_cache[..., Dr]`` (buffers),
  written by slice assignment ``cache[:bsz, start_pos:end_pos] = x``;
- positions as Python ints (``start_pos``); ``forward(tokens, start_pos)`` returns the last
  position's logits;
- a prefill step (``seqlen > 1``) that writes the caches and attends over the chunk in hand (MHA
  form, never reading the cache), a decode step (``seqlen == 1``) in the absorbed MLA form that
  reads the caches;
- the top-k as ``torch.full(..., -inf).scatter_(-1, topk, 0)`` added to the scores before the
  softmax;
- the value up-projection sliced per step out of the fused ``wkv_b`` weight, and a row-parallel
  output linear ending in ``.type_as(x)``.

Published code varies in small ways the DCP rewrite must take; each is a field of ``ModelArgs``
(off by default, so the default model is the one above), tested under DCP:

- ``cache_cast``: the decode step reads the caches and its query through a cast to float32
  (``"float"``: ``kv_cache[:bsz, :end_pos].float()``, ``"to"``: ``.to(torch.float32)``,
  ``"type_as"``: ``.type_as(scores)``), and its output is cast back (``.type_as(x)``);
- ``softmax_cast``: ``scores.float().softmax(dim=-1).type_as(scores)`` instead of
  ``scores.softmax(dim=-1, dtype=torch.float32)``;
- ``mask_add``: ``"inplace"`` (``scores += mask``, the default) or ``"out_of_place"``
  (``scores = scores + mask``);
- ``topk_break``: a graph break between the indexer and the attention, so that the top-k reaches
  the attention's graph as an input (``"assert"``: a data-dependent check of the top-k,
  ``"broadcast"``: ``dist.broadcast`` of it from rank 0 when a process group is up); compile such
  a model without ``fullgraph``.

Tensor and expert parallelism as the published code has them (``ModelArgs.tensor_parallel``, off
by default: the DCP tests build this model inside gloo worlds and mean one device): the
``Transformer`` reads ``world_size`` and ``rank`` from ``torch.distributed`` when it is built,
as the published code does under ``torchrun``, and every parallel module keeps the values it was
built with. ``ColumnParallelLinear`` holds its rank's ``1 / world_size`` of the output features,
``RowParallelLinear`` its share of the input features and all-reduces its output
(``dist.all_reduce``, which dynamo traces as a functional collective), the heads split
``n_local_heads = n_heads // world_size`` (``wq_b``, ``wkv_b`` column-parallel, ``wo``
row-parallel), the MLP is column- then row-parallel, ``ParallelEmbedding`` holds a slice of the
vocabulary (rows of other ranks masked to 0, then all-reduced), and the column-parallel head's
logits are all-gathered. The indexer and the caches are whole on every rank. With
``n_routed_experts > 0`` every layer from ``n_dense_layers`` on has an expert-parallel ``MoE``:
rank r holds experts ``[r * E / W, (r + 1) * E / W)``, the gate is replicated, each local expert
runs on every row weighted by its routing weight (0 where the row is not routed to it: no
data-dependent control flow, so the step traces with ``fullgraph=True``), and the experts' sum is
all-reduced; the shared experts are a tensor-parallel ``MLP``. ``load_unsharded(model,
state_dict)`` loads a rank's shard of an unsharded model's weights. ``world_size == 1`` is the
one-device model as before.

``generate`` is the published ``generate.py`` loop: batched prompts of different lengths,
a prefill of the shortest prompt, then one position per step for every request (prompt tokens
fed as they are until each prompt is used up), greedy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

# Tensor parallelism of the published code: set by Transformer.__init__ (1 and 0 unless
# ModelArgs.tensor_parallel), read by the parallel modules when they are built.
world_size = 1
rank = 0


@dataclasses.dataclass
class ModelArgs:
    max_batch_size: int = 4
    max_seq_len: int = 24
    vocab_size: int = 64
    dim: int = 32
    inter_dim: int = 64
    n_layers: int = 2
    n_heads: int = 6
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    index_n_heads: int = 8
    index_head_dim: int = 16
    index_topk: int = 4
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32
    # forms of published code (module docstring)
    cache_cast: str = ""  # "", "float", "to", "type_as"
    softmax_cast: bool = False
    mask_add: str = "inplace"  # or "out_of_place"
    topk_break: str = ""  # "", "assert", "broadcast"
    # tensor parallelism over the default process group's ranks (module docstring)
    tensor_parallel: bool = False
    # expert-parallel MoE (0 routed experts: a dense MLP in every layer)
    n_routed_experts: int = 0
    n_activated_experts: int = 2
    n_shared_experts: int = 1
    moe_inter_dim: int = 16
    n_dense_layers: int = 1  # layers [0, n_dense_layers) keep the dense MLP
    score_func: str = "softmax"  # or "sigmoid" (weights renormalized over the chosen experts)
    route_scale: float = 1.0

    def __post_init__(self):
        forms = {"cache_cast": ("", "float", "to", "type_as"), "mask_add": ("inplace", "out_of_place"),
                 "topk_break": ("", "assert", "broadcast"), "score_func": ("softmax", "sigmoid")}
        for name, allowed in forms.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)!r}; allowed: {allowed}")
        if self.n_routed_experts and not 1 <= self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(f"ModelArgs.n_activated_experts={self.n_activated_experts} must be in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")
        if self.n_routed_experts < 0 or self.n_shared_experts < 0:
            raise ValueError(f"ModelArgs.n_routed_experts={self.n_routed_experts} and n_shared_experts="
                             f"{self.n_shared_experts} must be >= 0")


def tiny_args(**overrides) -> ModelArgs:
    """A config small enough for CPU tests (6 heads: divisible by 2 and 3 ranks)."""
    return ModelArgs(**overrides)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _part(what: str, n: int) -> int:
    """``n / world_size``, refusing a remainder (the published code asserts)."""
    if n % world_size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel world_size={world_size}")
    return n // world_size


class ColumnParallelLinear(Linear):
    """This rank's ``out_features / world_size`` output features (rows ``[rank * part, (rank + 1) * part)``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        part = _part("out_features", out_features)
        super().__init__(in_features, part, bias, dtype)
        self.part_out_features, self.world_size, self.rank = part, world_size, rank


class RowParallelLinear(Linear):
    """This rank's ``in_features / world_size`` input features; the output is all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        part = _part("in_features", in_features)
        super().__init__(part, out_features, bias, dtype)
        self.part_in_features, self.world_size, self.rank = part, world_size, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.world_size > 1:
            torch.distributed.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.type_as(x)


class ParallelEmbedding(nn.Module):
    """This rank's ``vocab_size / world_size`` rows of the embedding; other ranks' tokens give 0
    here, and the all-reduce puts every token's row together."""

    def __init__(self, vocab_size: int, dim: int, dtype=None):
        super().__init__()
        self.part_vocab_size = _part("vocab_size", vocab_size)
        self.world_size, self.rank = world_size, rank
        self.vocab_start_idx = rank * self.part_vocab_size
        self.vocab_end_idx = self.vocab_start_idx + self.part_vocab_size
        self.weight = nn.Parameter(torch.empty(self.part_vocab_size, dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            mask = (x < self.vocab_start_idx) | (x >= self.vocab_end_idx)
            x = x - self.vocab_start_idx
            x[mask] = 0
        y = F.embedding(x, self.weight)
        if self.world_size > 1:
            y[mask] = 0
            torch.distributed.all_reduce(y)
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def precompute_freqs(dim: int, seqlen: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate pairs of the last dim: ``(x[2i], x[2i+1])`` (interleaved) or ``(x[i], x[i + d/2])``.
    ``x``: ``[B, S, H, D]``; ``cos, sin``: ``[S, D/2]``."""
    dtype = x.dtype
    x = x.float()
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    y = torch.stack([r1, r2], dim=-1).flatten(-2) if interleaved else torch.cat([r1, r2], dim=-1)
    return y.to(dtype)


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_head_dim = args.qk_rope_head_dim
        self.index_topk = args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, dtype=args.dtype)
        self.wk = Linear(args.dim, self.head_dim, dtype=args.dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, dtype=args.dtype)
        self.weights_proj = Linear(args.dim, self.n_heads, dtype=args.dtype)
        self.softmax_scale = self.head_dim ** -0.5
        self.register_buffer("k_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.head_dim,
                                                    dtype=args.dtype), persistent=False)

    def forward(self, x, qr, start_pos: int, cos, sin, mask):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim)
        q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        q = torch.cat([apply_rotary_emb(q_pe, cos, sin, interleaved=False), q_nope], dim=-1)
        k = self.k_norm(self.wk(x))
        k_pe, k_nope = torch.split(k, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        k = torch.cat([apply_rotary_emb(k_pe.unsqueeze(2), cos, sin, interleaved=False).squeeze(2), k_nope], dim=-1)
        self.k_cache[:bsz, start_pos:end_pos] = k
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5 * self.softmax_scale
        logits = torch.einsum("bshd,btd->bsht", q.float(), self.k_cache[:bsz, :end_pos].float()).relu()
        index_score = torch.einsum("bsht,bsh->bst", logits, weights)
        if mask is not None:
            index_score += mask
        return index_score.topk(min(self.index_topk, end_pos), dim=-1)[1]


class MLA(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_local_heads = _part("n_heads", args.n_heads)
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.wq_a = Linear(args.dim, args.q_lora_rank, dtype=args.dtype)
        self.q_norm = RMSNorm(args.q_lora_rank)
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, args.n_heads * self.qk_head_dim, dtype=args.dtype)
        self.wkv_a = Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, dtype=args.dtype)
        self.kv_norm = RMSNorm(self.kv_lora_rank)
        self.wkv_b = ColumnParallelLinear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                          dtype=args.dtype)
        self.wo = RowParallelLinear(args.n_heads * self.v_head_dim, args.dim, dtype=args.dtype)
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.args = args
        self.indexer = Indexer(args)
        self.register_buffer("float_anchor", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.kv_lora_rank,
                                                     dtype=args.dtype), persistent=False)
        self.register_buffer("pe_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.qk_rope_head_dim,
                                                     dtype=args.dtype), persistent=False)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        form = self.args.cache_cast
        if form == "float":
            return t.float()
        if form == "to":
            return t.to(torch.float32)
        if form == "type_as":
            return t.type_as(self.float_anchor)
        return t

    def _add_mask(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.args.mask_add == "out_of_place":
            return scores + mask
        scores += mask
        return scores

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        if self.args.softmax_cast:
            return scores.float().softmax(dim=-1).type_as(scores)
        return scores.softmax(dim=-1, dtype=torch.float32)

    def forward(self, x: torch.Tensor, start_pos: int, cos, sin, mask):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(bsz, seqlen, self.n_local_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, cos, sin)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_norm(kv)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), cos, sin)
        self.kv_cache[:bsz, start_pos:end_pos] = kv
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
        topk_indices = self.indexer(x, qr, start_pos, cos, sin, mask)
        if self.args.topk_break == "assert":  # data-dependent: a graph break
            assert int(topk_indices.max()) < end_pos, "top-k past the context"
        elif self.args.topk_break == "broadcast" and torch.distributed.is_initialized():
            torch.distributed.broadcast(topk_indices, src=0)  # every rank attends with rank 0's top-k
        if mask is not None:  # prefill: MHA over the chunk in hand
            q = torch.cat([q_nope, q_pe], dim=-1)
            kv = self.wkv_b(kv)
            kv = kv.view(bsz, seqlen, self.n_local_heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_local_heads, -1)], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q, k).mul_(self.softmax_scale)
            index_mask = torch.full((bsz, seqlen, seqlen), float("-inf"), device=x.device).scatter_(-1, topk_indices, 0)
            index_mask += mask
            scores = self._add_mask(scores, index_mask.unsqueeze(2))
            scores = self._softmax(scores)
            x = torch.einsum("bsht,bthd->bshd", scores.type_as(x), v)
        else:  # decode: absorbed MLA over the caches
            wkv_b = self.wkv_b.weight.view(self.n_local_heads, -1, self.kv_lora_rank)
            q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :self.qk_nope_head_dim])
            cast = self._cast
            scores = (torch.einsum("bshc,btc->bsht", cast(q_nope), cast(self.kv_cache[:bsz, :end_pos])) +
                      torch.einsum("bshr,btr->bsht", cast(q_pe), cast(self.pe_cache[:bsz, :end_pos]))
                      ) * self.softmax_scale
            index_mask = torch.full((bsz, 1, end_pos), float("-inf"), device=x.device).scatter_(-1, topk_indices, 0)
            scores = self._add_mask(scores, index_mask.unsqueeze(2))
            scores = self._softmax(scores)
            if self.args.cache_cast:  # float32 probabilities over the float32 cache, the result cast back
                x = torch.einsum("bsht,btc->bshc", scores, cast(self.kv_cache[:bsz, :end_pos])).type_as(x)
            else:
                x = torch.einsum("bsht,btc->bshc", scores.type_as(x), self.kv_cache[:bsz, :end_pos])
            x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim:])
        return self.wo(x.flatten(2))


class MLP(nn.Module):
    def __init__(self, dim: int, inter_dim: int, dtype=None):
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, inter_dim, dtype=dtype)
        self.w2 = RowParallelLinear(inter_dim, dim, dtype=dtype)
        self.w3 = ColumnParallelLinear(dim, inter_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    """Replicated top-k router: ``(weights[T, k], indices[T, k])`` of each row's experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.topk = args.n_activated_experts
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=args.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = scores.sigmoid()
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.score_func == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.route_scale).type_as(x), indices


class Expert(nn.Module):
    """One routed expert: a SwiGLU MLP held whole by the rank that owns it."""

    def __init__(self, dim: int, inter_dim: int, dtype=None):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype=dtype)
        self.w2 = Linear(inter_dim, dim, dtype=dtype)
        self.w3 = Linear(dim, inter_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Expert-parallel MoE: this rank's experts ``[rank * E / W, (rank + 1) * E / W)`` (the others
    are ``None`` in ``experts``), a replicated gate, tensor-parallel shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        self.n_routed_experts = args.n_routed_experts
        self.n_local_experts = _part("n_routed_experts", args.n_routed_experts)
        self.world_size = world_size
        self.experts_start_idx = rank * self.n_local_experts
        self.experts_end_idx = self.experts_start_idx + self.n_local_experts
        self.gate = Gate(args)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim, dtype=args.dtype)
            if self.experts_start_idx <= i < self.experts_end_idx else None for i in range(args.n_routed_experts))
        self.shared_experts = (MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, dtype=args.dtype)
                               if args.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        # every local expert on every row, weighted by the row's routing weight for it (0 if not chosen):
        # no data-dependent branch or row selection, so the step traces with fullgraph=True
        route = torch.zeros(x.shape[0], self.n_routed_experts, dtype=weights.dtype, device=x.device)
        route = route.scatter(1, indices, weights)
        y = torch.zeros_like(x)
        for i in range(self.experts_start_idx, self.experts_end_idx):
            y = y + self.experts[i](x) * route[:, i, None]
        if self.world_size > 1:
            torch.distributed.all_reduce(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.attn = MLA(args)
        self.ffn = (MoE(args) if args.n_routed_experts and layer_id >= args.n_dense_layers
                    else MLP(args.dim, args.inter_dim, dtype=args.dtype))
        self.attn_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)

    def forward(self, x, start_pos: int, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), start_pos, cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        global world_size, rank
        parallel = args.tensor_parallel and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if parallel else 1
        rank = torch.distributed.get_rank() if parallel else 0
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.world_size = world_size
        self.embed = (ParallelEmbedding(args.vocab_size, args.dim, dtype=args.dtype) if world_size > 1
                      else nn.Embedding(args.vocab_size, args.dim, dtype=args.dtype))  # one device: as before
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.head = ColumnParallelLinear(args.dim, args.vocab_size, dtype=args.dtype)
        cos, sin = precompute_freqs(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        seqlen = tokens.size(1)
        cos = self.freqs_cos[start_pos:start_pos + seqlen]
        sin = self.freqs_sin[start_pos:start_pos + seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu_(1) if seqlen > 1 else None
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, start_pos, cos, sin, mask)
        h = self.norm(h)
        if self.world_size == 1:
            return self.head(h[:, -1]).float()
        logits = self.head(h[:, -1])  # this rank's vocabulary columns: gathered from every rank
        all_logits = [torch.empty_like(logits) for _ in range(self.world_size)]
        torch.distributed.all_gather(all_logits, logits)
        return torch.cat(all_logits, dim=-1).float()


@torch.no_grad()
def load_unsharded(model: "Transformer", state_dict: dict[str, torch.Tensor]) -> "Transformer":
    """Load this rank's shard of an unsharded model's ``state_dict`` into ``model`` (built with
    ``tensor_parallel``): column-parallel weights and biases and the embedding keep the rank's block
    of rows, row-parallel weights its block of columns, the MoE its own experts (the others' are
    skipped); the rest is kept whole. Returns ``model``."""
    split: dict[str, int] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (ColumnParallelLinear, ParallelEmbedding)):
            split[prefix + "weight"] = 0
            if getattr(module, "bias", None) is not None:
                split[prefix + "bias"] = 0
        elif isinstance(module, RowParallelLinear):
            split[prefix + "weight"] = 1
    shard = {}
    for name, mine in model.state_dict().items():
        full = state_dict[name]
        if name in split:  # this rank's block: the module's rank, the part it was built with
            dim, part = split[name], mine.shape[split[name]]
            if full.shape[dim] == part * model.world_size:
                full = full.narrow(dim, model.get_submodule(name.rsplit(".", 1)[0]).rank * part, part)
        if full.shape != mine.shape:
            raise ValueError(f"{name}: the unsharded weight's shape {tuple(state_dict[name].shape)} does not shard "
                             f"to this rank's {tuple(mine.shape)} over world_size={model.world_size}")
        shard[name] = full
    model.load_state_dict(shard)
    return model


def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights drawn on the CPU from ``seed`` (norm gains near 1, projections N(0, 1/fan_in))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


@torch.no_grad()
def generate(model, prompt_tokens: list[list[int]], max_new_tokens: int, max_seq_len: int | None = None
             ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation as in the published ``generate.py``; ``model`` may be a compiled model.

    Returns each request's new tokens and the logits of every step (``[B, vocab]``, fp32).
    """
    prompt_lens = [len(t) for t in prompt_tokens]
    max_seq_len = max_seq_len or model.max_seq_len
    total_len = min(max_seq_len, max_new_tokens + max(prompt_lens))
    tokens = torch.full((len(prompt_tokens), total_len), -1, dtype=torch.long)
    for i, t in enumerate(prompt_tokens):
        tokens[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    prompt_mask = tokens != -1
    prev_pos, step_logits = 0, []
    for cur_pos in range(min(prompt_lens), total_len):
        logits = model(tokens[:, prev_pos:cur_pos], prev_pos)
        step_logits.append(logits.float().cpu())
        next_token = logits.argmax(dim=-1)
        tokens[:, cur_pos] = torch.where(prompt_mask[:, cur_pos], tokens[:, cur_pos], next_token)
        prev_pos = cur_pos
    completions = [tokens[i, n:n + max_new_tokens].tolist() for i, n in enumerate(prompt_lens)]
    return completions, step_logits


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]

