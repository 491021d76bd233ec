"""Shapes of the reference DSA models (DeepSeek-V3.2-, GLM-5- and GLM-5.2-shaped).

The real dimensions come from the public configs (see ``/work/shared/FACTS.md`` and
``docs/models.md``). Every family also has a ``-tiny`` twin with the SAME layer count and
indexer pattern but tiny widths, which is what CPU tests run. ``get_config(name, n_layers=8)``
truncates a model for fast tests and re-derives which layers own an indexer from the family's
rule, so a truncated GLM-5.2 still shares top-k the way the real one does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["DSAConfig", "CONFIGS", "ALIASES", "get_config", "indexer_pattern", "yarn_mscale"]


def yarn_mscale(factor: float, mscale_all_dim: float = 1.0) -> float:
    """YaRN attention-scale correction (DeepSeek): ``0.1 * m * ln(factor) + 1`` for factor > 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale_all_dim * math.log(factor) + 1.0


def indexer_pattern(n_layers: int, share_prefix: int, share_period: int) -> tuple[int, ...]:
    """Layers that own an indexer: ``[0, share_prefix)``, then every ``share_period``-th layer.

    ``share_period == 1`` means every layer owns one (DeepSeek-V3.2, GLM-5). GLM-5.2's IndexShare
    is ``(3, 4)``: 0, 1, 2, 6, 10, ..., 74 (21 of 78 layers).
    """
    if share_prefix < 1 or share_period < 1:
        raise ValueError(f"need share_prefix >= 1 and share_period >= 1, got {share_prefix}, {share_period}")
    last = share_prefix - 1
    return tuple(l for l in range(n_layers) if l <= last or (l - last) % share_period == 0)


@dataclass(frozen=True)
class DSAConfig:
    """One DSA model's shapes. Field names follow the DeepSeek/GLM configs.

    ``indexer_layers`` lists the layers that own a lightning indexer (and an index-key cache);
    every other layer reuses the top-k of the closest previous indexer layer and has no indexer
    weights. ``index_share_prefix``/``index_share_period`` is the rule that produced it; it is
    used again when ``get_config`` changes ``n_layers``. ``intermediate_size`` sizes a plain
    SwiGLU MLP standing in for the MoE (the DCP rewrite does not touch the MLP). ``sm_scale``
    defaults to ``(nope + rope) ** -0.5 * attn_mscale ** 2``.
    """

    name: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int  # Dc: latent width of the KV cache row (also the value width)
    qk_rope_head_dim: int  # Dr: rope part of the KV cache row
    qk_nope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    intermediate_size: int
    indexer_layers: tuple[int, ...] = ()  # () -> derived from the share rule
    index_rope_dim: int | None = None  # rope on the first dims of index q/k; None -> qk_rope_head_dim
    index_share_prefix: int = 1
    index_share_period: int = 1
    attn_mscale: float = 1.0  # YaRN mscale folded into sm_scale (DeepSeek-V3.2 long context)
    sm_scale: float | None = None  # None -> (nope + rope) ** -0.5 * attn_mscale ** 2
    rope_theta: float = 10000.0
    page_size: int = 64
    norm_eps: float = 1e-6
    # KV cache storage (docs/models.md, "FP8 KV"): None keeps the model's dtype, "bf16" stores bf16
    # whatever the model computes in (a yardstick for FP8's error); "fp8" stores E4M3,
    # written by kv_store with a per-tensor scale (kv_scales="tensor", the constant kv_scale) or with
    # per-128-column power-of-two scales computed from each row (kv_scales="block", 4 bytes a group).
    kv_dtype: str | None = None
    kv_scales: str = "tensor"
    kv_scale: float = 1.0
    # index keys: None keeps the model's dtype; "fp8" stores E4M3 with one fp32 scale a token
    # (index_head_dim + 4 bytes, as published checkpoints store them; index_head_dim <= 128)
    index_key_dtype: str | None = None
    # multi-token prediction (DeepSeek-V3's MTP): 0 or 1 MTP layer (``model.mtp``), the draft of
    # speculative decoding, with its own attention, indexer and KV cache (docs/models.md, "MTP")
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if not self.indexer_layers:
            object.__setattr__(
                self, "indexer_layers", indexer_pattern(self.n_layers, self.index_share_prefix, self.index_share_period)
            )
        object.__setattr__(self, "indexer_layers", tuple(int(l) for l in self.indexer_layers))
        if self.index_rope_dim is None:
            object.__setattr__(self, "index_rope_dim", self.qk_rope_head_dim)
        if self.sm_scale is None:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * self.attn_mscale**2
            object.__setattr__(self, "sm_scale", scale)
        self._validate()

    def _validate(self) -> None:
        problems = []
        for f in ("n_layers", "hidden_size", "vocab_size", "n_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim",
                  "intermediate_size", "page_size"):
            if getattr(self, f) < 1:
                problems.append(f"{f} must be >= 1, got {getattr(self, f)}")
        for f, v in (("qk_rope_head_dim", self.qk_rope_head_dim), ("index_rope_dim", self.index_rope_dim)):
            if v < 2 or v % 2:
                problems.append(f"{f} must be even and >= 2 (rope rotates pairs), got {v}")
        if self.kv_dtype not in (None, "bf16", "fp8"):
            problems.append(f"kv_dtype must be None (the model's dtype), 'bf16' or 'fp8', got {self.kv_dtype!r}")
        if self.kv_scales not in ("tensor", "block"):
            problems.append(f"kv_scales must be 'tensor' (one scale) or 'block' (per 128 columns), got {self.kv_scales!r}")
        if isinstance(self.kv_scale, bool) or not isinstance(self.kv_scale, (int, float)) \
                or not 0 < self.kv_scale < math.inf:
            problems.append(f"kv_scale must be a positive finite float, got {self.kv_scale!r}")
        if self.index_key_dtype not in (None, "fp8"):
            problems.append(f"index_key_dtype must be None (the model's dtype) or 'fp8', got {self.index_key_dtype!r}")
        elif self.index_key_dtype == "fp8" and self.index_head_dim > 128:
            problems.append(f"index_key_dtype='fp8' keeps one scale a token, so index_head_dim must be <= 128, got "
                            f"{self.index_head_dim}")
        if isinstance(self.mtp_layers, bool) or self.mtp_layers not in (0, 1):
            problems.append(f"mtp_layers must be 0 or 1 (one MTP layer, as DeepSeek-V3 and GLM-5 publish), got "
                            f"{self.mtp_layers!r}")
        if self.index_rope_dim > self.index_head_dim:
            problems.append(f"index_rope_dim {self.index_rope_dim} > index_head_dim {self.index_head_dim}")
        il = self.indexer_layers
        if list(il) != sorted(set(il)) or any(not 0 <= l < self.n_layers for l in il):
            problems.append(f"indexer_layers must be sorted, unique and in [0, {self.n_layers}), got {il}")
        elif not il or il[0] != 0:
            problems.append("layer 0 must own an indexer (there is no earlier top-k to reuse)")
        if problems:
            raise ValueError(f"bad DSAConfig {self.name!r}: " + "; ".join(problems))

    # ------------------------------------------------------------------ derived
    @property
    def kv_dim(self) -> int:
        """Width of one KV cache row: ``Dc + Dr``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def has_indexer(self, layer: int) -> bool:
        return layer in self.indexer_layers

    def topk_source(self, layer: int) -> int:
        """The indexer layer whose top-k ``layer`` attends with (itself if it owns an indexer)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        return max(l for l in self.indexer_layers if l <= layer)

    def topk_capacity(self, max_pages: int) -> int:
        """Top-k width K of a step whose page table has ``max_pages`` columns."""
        return min(self.index_topk, max_pages * self.page_size)


# ---------------------------------------------------------------------- registry

_V32_MSCALE = yarn_mscale(40.0, 1.0)  # rope_scaling: yarn, factor 40, mscale_all_dim 1.0

_REAL: dict[str, dict] = {
    "deepseek-v3.2": dict(
        n_layers=61, hidden_size=7168, vocab_size=129280, n_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=2048, index_n_heads=64, index_head_dim=128, intermediate_size=18432,
        index_share_prefix=1, index_share_period=1, attn_mscale=_V32_MSCALE,
        rope_theta=10000.0, page_size=64,
    ),
    "glm5": dict(
        n_layers=78, hidden_size=6144, vocab_size=154880, n_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
        index_topk=2048, index_n_heads=32, index_head_dim=128, intermediate_size=12288,
        index_share_prefix=1, index_share_period=1, rope_theta=1_000_000.0, page_size=64,
    ),
    "glm5.2": dict(
        n_layers=78, hidden_size=6144, vocab_size=154880, n_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
        index_topk=2048, index_n_heads=32, index_head_dim=128, intermediate_size=12288,
        index_share_prefix=3, index_share_period=4, rope_theta=8_000_000.0, page_size=64,
    ),
}

# Tiny widths, same layer count, indexer rule and sm_scale rule. GLM's v_head_dim != qk_nope_head_dim is kept
# (v 16 vs nope 8) so a head-sharded output projection is exercised with v != nope. 8 index heads,
# not 2: with 2, a quarter of all index scores are exactly 0 (relu of both heads) and about one row
# in five ties at the K-th score, so torch.topk's device-dependent tie order would pick the set.
_TINY = dict(
    hidden_size=32, vocab_size=64, n_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_n_heads=8, index_head_dim=16,
    index_rope_dim=8, intermediate_size=64, page_size=4,
    rope_theta=10000.0,  # so the few positions a CPU test reaches still rotate more than one pair
)
_TINY_OVERRIDES = {"deepseek-v3.2": {}, "glm5": {"v_head_dim": 16}, "glm5.2": {"v_head_dim": 16}}


def _build_registry() -> dict[str, DSAConfig]:
    out: dict[str, DSAConfig] = {}
    for name, real in _REAL.items():
        out[name] = DSAConfig(name=name, **real)
        tiny = dict(real)
        tiny.update(_TINY)
        tiny.update(_TINY_OVERRIDES[name])
        out[f"{name}-tiny"] = DSAConfig(name=f"{name}-tiny", **tiny)
    return out


CONFIGS: dict[str, DSAConfig] = _build_registry()
ALIASES: dict[str, str] = {
    "glm5.1": "glm5", "glm5.1-tiny": "glm5-tiny",
    "glm5.3": "glm5.2", "glm5.3-tiny": "glm5.2-tiny",
}

# Fields derived from others: re-derived after an override unless the override names them.
_DERIVED = {"indexer_layers": (), "sm_scale": None}


def get_config(name: str, **overrides) -> DSAConfig:
    """Registered config by name (aliases resolved), with field overrides.

    Derived fields (``indexer_layers`` from the share rule, ``sm_scale`` from the head dims and
    ``attn_mscale``) are recomputed unless they are overridden themselves; so ``n_layers=8`` on GLM-5.2 keeps
    IndexShare (indexers at 0, 1, 2, 6).
    """
    key = ALIASES.get(name, name)
    if key not in CONFIGS:
        valid = sorted(CONFIGS) + sorted(ALIASES)
        raise KeyError(f"unknown DSA config {name!r}; valid names: {', '.join(valid)}")
    base = CONFIGS[key]
    if not overrides:
        return base
    fields = {f.name for f in dataclasses.fields(DSAConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown DSAConfig field(s) {unknown}; valid: {sorted(fields)}")
    kwargs = {f: getattr(base, f) for f in fields}
    kwargs.update({f: v for f, v in _DERIVED.items() if f not in overrides})
    kwargs.update(overrides)
    return DSAConfig(**kwargs)
