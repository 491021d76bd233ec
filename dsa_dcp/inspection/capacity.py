"""Weights, KV and index-key bytes per rank, and the KV tokens a GPU holds, under TP with DCP inside it.

Computed from a config's shapes alone; nothing is built or allocated. The layout is the one the
published serving code uses (see ``docs/capacity.md``):

- **TP T, DCP N inside it.** ``T % N == 0``; the DCP groups are N contiguous TP ranks and add no
  ranks. EP (expert parallelism) is the whole world: each of the T ranks holds ``E / T`` routed
  experts.
- **Per rank**: ``H / T`` heads of the attention up-projections (``wq_b`` and ``wkv_b``
  column-parallel, ``wo`` row-parallel); the dense MLPs and the shared experts split by T; the
  embedding and the LM head vocab-parallel (split by T); the q/kv down-projections (``wq_a``,
  ``wkv_a``), the norms, the router gates and the indexer replicated. With ``replicate_q`` (the
  Q projection replicated over the DCP group) a rank also holds the ``wq_b`` rows and the absorbed
  ``W_UK`` (the nope part of ``wkv_b``) of the other ``(N - 1) * H / T`` heads of its DCP group.
- **KV**: MLA's latent KV is one KV head, the same on every TP rank: TP alone stores all of it on
  every rank, DCP N stores each token on one rank of each DCP group. The per-token bytes are the
  memory plan's (``memory.memory_plan``: ``kv / N`` of KV, and the index keys whole when the index
  cache is replicated or ``/ N`` when it is sharded); they do not depend on T.
- **KV tokens** = ``(GPU memory - weights per rank - reserve - fixed cache bytes) / bytes per token
  per rank``: the tokens of the whole TP group (each token is spread over one DCP group; the T / N
  DCP groups hold the same tokens), compared with TP alone (N = 1) on the same GPU.

Weight storage: ``fp8`` is the published checkpoints' layout (linear weights e4m3 with one fp32
scale per 128 x 128 block, counted as ``1 + 4 / 128**2`` bytes a weight; norms, embedding, LM head,
router gates and the indexer's head weights bf16; the router's score-correction bias fp32);
``bf16`` stores the linear weights in bf16 too. The multi-token-prediction layer of the checkpoints
is not counted. ``DSAConfig`` holds no MoE shapes (a dense SwiGLU stands in for the MoE), so the
published MoE shapes of the real configs are in ``PUBLISHED_MOE``; any other config is counted as
the model ``DSAModel`` builds: a dense SwiGLU of ``intermediate_size`` in every layer.
"""

from __future__ import annotations

import dataclasses
import math

from dsa_dcp.inspection.memory import memory_plan

GB = 10**9
FP8_BLOCK = 128
FP8_BYTES_PER_WEIGHT = 1 + 4 / FP8_BLOCK**2  # e4m3 + one fp32 scale per 128 x 128 block
WEIGHT_DTYPES = ("fp8", "bf16")
DEFAULT_RESERVE_FRACTION = 0.10


class LayoutError(ValueError):
    """A TP / DCP layout the model cannot be split by; the message lists every problem."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    source: str


GPUS = {
    "h200": GPU("h200", 150_109_880_320,
                "NVIDIA H200: the total memory torch reports on this project's H200 "
                "(torch.cuda.get_device_properties(0).total_memory, 143,771 MiB; sold as 141 GB)"),
    "b300": GPU("b300", 288 * GB, "NVIDIA B300: 288 GB, the spec sheet's figure"),
}
DEFAULT_GPU = "h200"


@dataclasses.dataclass(frozen=True)
class MoEShapes:
    """The MoE of a published checkpoint (what ``DSAConfig`` does not hold)."""

    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int  # the first layers have a dense MLP of ``intermediate_size``


# From the published config.json files (the same values as transformers' DeepseekV32Config and
# GlmMoeDsaConfig defaults).
PUBLISHED_MOE = {
    "deepseek-v3.2": MoEShapes(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                               first_k_dense_replace=3),
    "glm5": MoEShapes(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3),
    "glm5.2": MoEShapes(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                        first_k_dense_replace=3),
}


def moe_shapes(cfg) -> MoEShapes | None:
    """The config's MoE: its own fields when it has them, else the published checkpoint's, else
    ``None`` (a dense MLP in every layer)."""
    if getattr(cfg, "n_routed_experts", None):
        return MoEShapes(cfg.n_routed_experts, getattr(cfg, "n_shared_experts", 0),
                         cfg.moe_intermediate_size, getattr(cfg, "first_k_dense_replace", 0))
    return PUBLISHED_MOE.get(cfg.name)


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    """Weights of one kind on one rank: how they are split, how many, in what storage, their bytes."""

    name: str
    split: str
    params_per_rank: int
    storage: str
    bytes_per_rank: float


def _config(config):
    from dsa_dcp.models import get_config

    return get_config(config) if isinstance(config, str) else config


def layout_problems(config, tp_size: int, dcp_size: int) -> list[str]:
    """Why ``config`` cannot run at TP ``tp_size`` with DCP ``dcp_size`` inside it ([] when it can)."""
    cfg = _config(config)
    t, n = tp_size, dcp_size
    for name, v in (("tp_size", t), ("dcp_size", n)):
        if not (isinstance(v, int) and v >= 1):
            return [f"{name} must be an integer >= 1, got {v!r}"]
    problems = []
    if t % n:
        problems.append(f"dcp_size {n} must divide tp_size {t}: a DCP group is {n} contiguous ranks of the "
                        f"{t}-rank TP group (tp_size % dcp_size == 0)")
    if cfg.n_heads % t:
        problems.append(f"tp_size {t} must divide the {cfg.n_heads} attention heads of {cfg.name} "
                        "(each TP rank holds n_heads / tp_size of them)")
    moe = moe_shapes(cfg)
    dense_layers = cfg.n_layers if moe is None else min(moe.first_k_dense_replace, cfg.n_layers)
    if dense_layers and cfg.intermediate_size % t:
        problems.append(f"tp_size {t} must divide intermediate_size {cfg.intermediate_size} of {cfg.name} "
                        "(the dense MLP is split by tp_size)")
    if moe is not None and dense_layers < cfg.n_layers:
        if moe.n_routed_experts % t:
            problems.append(f"the EP size {t} (= tp_size: the experts are split over every rank) must divide "
                            f"the {moe.n_routed_experts} routed experts of {cfg.name}")
        shared = moe.n_shared_experts * moe.moe_intermediate_size
        if shared % t:
            problems.append(f"tp_size {t} must divide the shared experts' width {shared} of {cfg.name} "
                            "(the shared experts are split by tp_size)")
    return problems


def check_layout(config, tp_size: int, dcp_size: int) -> None:
    """Raise ``LayoutError`` naming every problem of the layout (``layout_problems``)."""
    problems = layout_problems(config, tp_size, dcp_size)
    if problems:
        raise LayoutError(f"cannot split {_config(config).name} at tp {tp_size} with dcp {dcp_size}: "
                          + "; ".join(problems))


def weight_groups(config, tp_size: int, dcp_size: int = 1, weight_dtype: str = "fp8",
                  replicate_q: bool = True) -> list[WeightGroup]:
    """The weights one rank holds, by kind (see the module docstring for the rules)."""
    cfg = _config(config)
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    check_layout(cfg, tp_size, dcp_size)
    t, n = tp_size, dcp_size
    linear = FP8_BYTES_PER_WEIGHT if weight_dtype == "fp8" else 2
    linear_name = "fp8 + 128x128 block scales" if weight_dtype == "fp8" else "bf16"
    layers, d = cfg.n_layers, cfg.hidden_size
    heads = cfg.n_heads // t
    qk, nope, v = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    moe = moe_shapes(cfg)
    groups: list[WeightGroup] = []

    def add(name: str, split: str, params: int, per_weight: float, storage: str) -> None:
        groups.append(WeightGroup(name, split, params, storage, params * per_weight))

    add("attention down-projections (wq_a, wkv_a)", "replicated",
        layers * d * (cfg.q_lora_rank + cfg.kv_dim), linear, linear_name)
    add("attention q up-projection (wq_b)", f"column-parallel: {heads} of {cfg.n_heads} heads",
        layers * heads * qk * cfg.q_lora_rank, linear, linear_name)
    add("attention kv up-projection (wkv_b = W_UK, W_UV)", f"column-parallel: {heads} of {cfg.n_heads} heads",
        layers * heads * (nope + v) * cfg.kv_lora_rank, linear, linear_name)
    add("attention output (wo)", f"row-parallel: {heads} of {cfg.n_heads} heads", layers * heads * v * d,
        linear, linear_name)
    others = (n - 1) * heads if replicate_q else 0
    add("replicate_q: wq_b and W_UK of the DCP group's other heads",
        f"{others} more heads ({n} x {heads} in all)" if others else
        ("none (dcp 1)" if n == 1 else "none (replicate_q off)"),
        layers * others * (qk * cfg.q_lora_rank + nope * cfg.kv_lora_rank), linear, linear_name)
    indexers = len(cfg.indexer_layers)
    add(f"indexer wq_b, wk ({indexers} layers)", "replicated",
        indexers * (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim),
        linear, linear_name)
    add(f"indexer weights_proj, k_norm ({indexers} layers)", "replicated",
        indexers * (d * cfg.index_n_heads + 2 * cfg.index_head_dim), 2, "bf16")
    if moe is None:
        add(f"MLP (dense SwiGLU, {layers} layers: no published MoE shapes)", f"split by {t}",
            layers * 3 * d * cfg.intermediate_size // t, linear, linear_name)
    else:
        dense = min(moe.first_k_dense_replace, layers)
        sparse = layers - dense
        experts = moe.n_routed_experts // t
        shared = moe.n_shared_experts * moe.moe_intermediate_size
        add(f"dense MLP ({dense} layers)", f"split by {t}", dense * 3 * d * cfg.intermediate_size // t,
            linear, linear_name)
        add(f"routed experts ({sparse} layers)", f"EP {t}: {experts} of {moe.n_routed_experts} experts",
            sparse * experts * 3 * d * moe.moe_intermediate_size, linear, linear_name)
        add(f"shared experts ({sparse} layers)", f"split by {t}", sparse * 3 * d * shared // t, linear,
            linear_name)
        add(f"router gates ({sparse} layers)", "replicated", sparse * moe.n_routed_experts * d, 2, "bf16")
        add(f"router score-correction biases ({sparse} layers)", "replicated", sparse * moe.n_routed_experts, 4,
            "fp32")
    vocab = math.ceil(cfg.vocab_size / t)
    add("embedding and LM head", f"vocab-parallel: {vocab:,} of {cfg.vocab_size:,} rows", 2 * vocab * d, 2, "bf16")
    add("norms", "replicated", layers * (2 * d + cfg.q_lora_rank + cfg.kv_lora_rank) + d, 2, "bf16")
    return groups


def _gpu(gpu: str | float) -> GPU:
    if isinstance(gpu, str):
        key = gpu.lower()
        if key in GPUS:
            return GPUS[key]
        try:
            gpu = float(gpu)
        except ValueError:
            raise ValueError(f"gpu must be one of {sorted(GPUS)} or a memory size in GB, got {gpu!r}") from None
    if not gpu > 0:
        raise ValueError(f"gpu memory must be > 0 GB, got {gpu}")
    return GPU("custom", int(round(gpu * GB)), f"{gpu:g} GB, as given")


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """One model at TP ``tp_size`` with DCP ``dcp_size`` inside it, on one GPU (see module docstring)."""

    config: str
    tp_size: int
    dcp_size: int
    ep_size: int
    kv_dtype: str
    index_cache: str
    weight_dtype: str
    replicate_q: bool
    gpu: str
    gpu_source: str
    gpu_memory_bytes: int
    reserve_bytes: int
    reserve_source: str
    weights: tuple[WeightGroup, ...]
    weight_bytes_per_rank: int
    replicate_q_bytes_per_rank: int
    model_params: int  # every weight counted once (tp 1)
    kv_bytes_per_token_per_rank: float
    index_bytes_per_token_per_rank: float
    bytes_per_token_per_rank: float
    fixed_bytes_per_rank: int  # the caches' per-tensor scales (fp8 KV)
    free_bytes_per_rank: int  # for KV and index keys; negative when the weights do not fit
    kv_tokens: int
    tp_alone_weight_bytes_per_rank: int
    tp_alone_bytes_per_token_per_rank: float
    tp_alone_kv_tokens: int
    capacity_vs_tp_alone: float | None  # kv_tokens / tp_alone_kv_tokens; None when TP alone holds none

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines for the text and HTML reports."""
        t, n = self.tp_size, self.dcp_size
        groups = (f"{t // n} DCP group{'s' if t // n > 1 else ''} of {n} contiguous TP ranks" if n > 1
                  else "TP alone, no DCP")
        storage = ("fp8: linear weights e4m3 + an fp32 scale per 128x128 block; norms, embedding, LM head, "
                   "router gates, indexer weights_proj bf16; router biases fp32"
                   if self.weight_dtype == "fp8" else
                   "bf16 (router biases fp32)")
        out = [
            ("config / layout", f"{self.config}: tp {t}, dcp {n} ({groups}), EP {self.ep_size}"),
            ("weights, whole model", f"{self.model_params:,} parameters (no MTP layer)"),
            ("weight storage", storage),
            ("weights per rank", f"{self.weight_bytes_per_rank:,} B ({_gb(self.weight_bytes_per_rank)})"),
        ]
        out += [(f"  {g.name}", f"{_gb(g.bytes_per_rank)}: {g.split}") for g in self.weights]
        split_index = self.index_cache == "sharded" and n > 1
        out += [
            ("KV bytes per token per rank", f"{_num(self.kv_bytes_per_token_per_rank)} (1/{n} of the latent KV: each token "
             "on one rank of each DCP group)" if n > 1 else
             f"{_num(self.kv_bytes_per_token_per_rank)} (all of it: one latent KV head, stored by every TP rank)"),
            ("index-key bytes per token per rank", f"{_num(self.index_bytes_per_token_per_rank)} "
             + (f"(sharded: 1/{n})" if split_index else "(replicated on every rank)")),
            ("bytes per token per rank", f"{_num(self.bytes_per_token_per_rank)} ({self.kv_dtype} KV)"),
            ("GPU memory", f"{_gb(self.gpu_memory_bytes)} ({self.gpu_source})"),
            ("reserve", f"{_gb(self.reserve_bytes)} ({self.reserve_source})"),
            ("free for KV per rank", f"{_gb(self.free_bytes_per_rank)} (GPU memory - weights - reserve"
             + (f" - {self.fixed_bytes_per_rank} B of cache scales)" if self.fixed_bytes_per_rank else ")")),
            ("KV tokens per GPU", f"{self.kv_tokens:,} (free / bytes per token per rank; tokens of the whole TP "
             "group, each GPU holding its share)" if self.free_bytes_per_rank > 0 else
             "0 (the weights and the reserve do not fit)"),
            (f"tp {t} alone", f"{self.tp_alone_kv_tokens:,} tokens ({_gb(self.tp_alone_weight_bytes_per_rank)} of "
             f"weights, {_num(self.tp_alone_bytes_per_token_per_rank)} B per token per rank)"),
            (f"capacity vs tp {t} alone", "n/a (TP alone holds no tokens)" if self.capacity_vs_tp_alone is None
             else f"{self.capacity_vs_tp_alone:.2f}x"),
        ]
        return out


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _gb(b: float) -> str:
    return f"{b / GB:,.2f} GB"


def _free_and_tokens(gpu_bytes: int, weights: int, reserve: int, fixed: int, per_token: float) -> tuple[int, int]:
    free = gpu_bytes - weights - reserve - fixed
    return free, (int(free // per_token) if free > 0 else 0)


def capacity_plan(config, tp_size: int, dcp_size: int = 1, *, kv_dtype: str = "bf16",
                  index_cache: str = "replicated", weight_dtype: str = "fp8", replicate_q: bool = True,
                  gpu: str | float = DEFAULT_GPU, reserve_gb: float | None = None) -> CapacityPlan:
    """The plan for ``config`` (a ``DSAConfig`` or a name) at TP ``tp_size`` with DCP ``dcp_size``
    inside it, on ``gpu`` (a name in ``GPUS`` or a memory size in GB = 10**9 bytes), keeping
    ``reserve_gb`` GB (default 10% of the GPU's memory) for everything but weights and caches.

    Raises ``LayoutError`` when the config cannot be split that way (``layout_problems``)."""
    cfg = _config(config)
    check_layout(cfg, tp_size, dcp_size)
    device = _gpu(gpu)
    if reserve_gb is None:
        reserve = int(round(DEFAULT_RESERVE_FRACTION * device.memory_bytes))
        reserve_source = (f"{DEFAULT_RESERVE_FRACTION:.0%} of the GPU memory, for activations, CUDA graphs, "
                          "communication buffers and fragmentation")
    else:
        if not reserve_gb >= 0:
            raise ValueError(f"reserve_gb must be >= 0, got {reserve_gb}")
        reserve, reserve_source = int(round(reserve_gb * GB)), f"{reserve_gb:g} GB, as given"
    if reserve >= device.memory_bytes:
        raise ValueError(f"the reserve ({_gb(reserve)}) leaves nothing of the GPU's {_gb(device.memory_bytes)}")

    # the per-token bytes are the memory plan's: one source for the KV and index-key layouts
    plan = memory_plan(cfg, kv_dtype, dcp_size, index_cache=index_cache)
    alone = memory_plan(cfg, kv_dtype, 1, index_cache=index_cache)
    groups = weight_groups(cfg, tp_size, dcp_size, weight_dtype, replicate_q)
    weights = round(sum(g.bytes_per_rank for g in groups))
    extra = round(sum(g.bytes_per_rank for g in groups if g.name.startswith("replicate_q")))
    alone_weights = round(sum(g.bytes_per_rank for g in weight_groups(cfg, tp_size, 1, weight_dtype)))
    model_params = sum(g.params_per_rank for g in weight_groups(cfg, 1, 1, weight_dtype))
    free, tokens = _free_and_tokens(device.memory_bytes, weights, reserve, plan.fixed_bytes_per_rank,
                                    plan.bytes_per_token_per_rank)
    _, alone_tokens = _free_and_tokens(device.memory_bytes, alone_weights, reserve, alone.fixed_bytes_per_rank,
                                       alone.bytes_per_token_per_rank)
    return CapacityPlan(
        config=cfg.name, tp_size=tp_size, dcp_size=dcp_size, ep_size=tp_size, kv_dtype=kv_dtype,
        index_cache=index_cache, weight_dtype=weight_dtype, replicate_q=replicate_q, gpu=device.name,
        gpu_source=device.source, gpu_memory_bytes=device.memory_bytes, reserve_bytes=reserve,
        reserve_source=reserve_source, weights=tuple(groups), weight_bytes_per_rank=weights,
        replicate_q_bytes_per_rank=extra, model_params=model_params,
        kv_bytes_per_token_per_rank=plan.kv_bytes_per_token_per_rank,
        index_bytes_per_token_per_rank=plan.index_bytes_per_token_per_rank,
        bytes_per_token_per_rank=plan.bytes_per_token_per_rank, fixed_bytes_per_rank=plan.fixed_bytes_per_rank,
        free_bytes_per_rank=free, kv_tokens=tokens, tp_alone_weight_bytes_per_rank=alone_weights,
        tp_alone_bytes_per_token_per_rank=alone.bytes_per_token_per_rank, tp_alone_kv_tokens=alone_tokens,
        capacity_vs_tp_alone=tokens / alone_tokens if alone_tokens else None,
    )
