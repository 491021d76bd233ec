"""The per-rank memory plan of a DSA model under DCP, computed from its config alone.

Nothing is allocated: the numbers follow from the config, the KV dtype and the group size N.

Per token, per layer (``kv_dim = Dc + Dr``, 576 for every real config):

- ``fp8``: ``kv_dim`` one-byte values (the all-FP8 576-dim layout) and one per-tensor fp32 scale
  per cache, a fixed 4 B per layer that does not grow with tokens; an index key is
  ``index_head_dim`` one-byte values plus a 4-byte fp32 scale (128 + 4 = 132 B).
- ``fp8_block``: ``kv_dim`` one-byte values and one fp32 scale per 128 columns of each row
  (``kv_store``'s ``block_scales``: 576 + 5 x 4 = 596 B), no fixed scale; index keys as ``fp8``.
- ``bf16``: ``kv_dim`` two-byte values (1152 B); an index key is ``index_head_dim`` bf16 values
  (256 B), no scale (132 B when the config's ``index_key_dtype`` is ``"fp8"``).

``kv_dtype=None`` takes the config's own storage (``DSAConfig.kv_dtype`` / ``kv_scales`` /
``index_key_dtype``, the reference models' FP8 options): ``fp8`` or ``fp8_block`` for an FP8 KV
config, else ``bf16`` (the serving dtype; the CPU tests' fp32 is not planned).

Under DCP every rank stores 1/N of the KV (``kv / N`` per token) and, with the replicated index
cache (``index_cache="replicated"``, the default), all of the index keys: per rank
``kv / N + index`` bytes per token. A split index cache (``index_cache="sharded"``) needs
``(kv + index) / N``. "Capacity the replicated index costs" is the ratio of the two minus one: how
many more bytes each token takes, i.e. how many more tokens a split cache holds (GLM-5.3, FP8:
5.8% at N=2, 17% at N=4, 41% at N=8). The plan's per-rank figures follow its ``index_cache``.

Tokens that fit count global slots, i.e. tokens of the whole group: with ``gpu_mem_gib`` GiB of
cache memory per rank, ``floor(bytes / per-rank bytes per token)``; with ``slots`` S the plan gives
the bytes each rank needs for S slots (``local_cache_rows(S, N, I)`` KV rows: ``ceil(S / N)`` when
``I = 1``; S index rows, or as many as the KV rows when sharded).
"""

from __future__ import annotations

import dataclasses

from dsa_dcp.slots import local_cache_rows

KV_DTYPES = ("bf16", "fp8", "fp8_block")
GIB = 1 << 30
FP8_SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per token per rank for one config, KV dtype and group size (see module docstring)."""

    config: str
    kv_dtype: str
    dcp_size: int
    layers: int
    indexer_layers: int
    kv_bytes_per_token_layer: int
    index_bytes_per_token_layer: int
    kv_bytes_per_token: int  # whole model, one copy
    index_bytes_per_token: int  # whole model, one copy
    kv_bytes_per_token_per_rank: float  # kv / N
    index_bytes_per_token_per_rank: float  # replicated: all of it; sharded: index / N
    bytes_per_token_per_rank: float  # kv / N + index (sharded: (kv + index) / N)
    bytes_per_token_per_rank_split_index: float  # (kv + index) / N
    replicated_index_cost: float  # replicated / split - 1
    fixed_bytes_per_rank: int  # per-tensor scales (fp8)
    slots: int | None = None
    bytes_per_rank_for_slots: int | None = None
    gpu_mem_gib: float | None = None
    tokens_that_fit: int | None = None
    tokens_that_fit_split_index: int | None = None
    tokens_that_fit_one_rank: int | None = None  # N = 1: the whole cache on one device
    index_cache: str = "replicated"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines for the text and HTML reports."""
        n = self.dcp_size
        sharded = self.index_cache == "sharded"
        index_share = f"({self.index_bytes_per_token:,} / {n}: sharded)" if sharded else "(replicated on every rank)"
        formula = f"({self.kv_bytes_per_token:,} + {self.index_bytes_per_token:,})/{n}" if sharded else \
            f"{self.kv_bytes_per_token:,}/{n} + {self.index_bytes_per_token:,}"
        out = [
            ("config / KV dtype / N", f"{self.config} / {self.kv_dtype} / {n}"),
            ("KV bytes per token per layer", f"{self.kv_bytes_per_token_layer}"
             + (f" (+ {FP8_SCALE_BYTES} B per-tensor scale per layer, fixed)" if self.kv_dtype == "fp8" else "")),
            ("index-key bytes per token per indexer layer", f"{self.index_bytes_per_token_layer}"),
            ("KV bytes per token, whole model", f"{self.kv_bytes_per_token:,} ({self.layers} layers)"),
            ("index-key bytes per token, whole model", f"{self.index_bytes_per_token:,} ({self.indexer_layers} indexer layers)"),
            ("KV bytes per token per rank", f"{_num(self.kv_bytes_per_token_per_rank)} ({self.kv_bytes_per_token:,} / {n})"),
            ("index-key bytes per token per rank", f"{_num(self.index_bytes_per_token_per_rank)} {index_share}"),
            ("bytes per token per rank", f"{_num(self.bytes_per_token_per_rank)} (= {formula})"),
            ("  with a split index cache", f"{_num(self.bytes_per_token_per_rank_split_index)} "
             f"(= ({self.kv_bytes_per_token:,} + {self.index_bytes_per_token:,})/{n})"),
            ("capacity a replicated index cache costs", f"{100 * self.replicated_index_cost:.1f}% "
             "(a split index cache would hold that many more tokens)"),
        ]
        if self.slots is not None:
            out.append((f"bytes per rank for {self.slots:,} slots", f"{self.bytes_per_rank_for_slots:,} "
                        f"({self.bytes_per_rank_for_slots / GIB:.2f} GiB)"))
        if self.gpu_mem_gib is not None:
            out += [
                (f"tokens that fit in {self.gpu_mem_gib:g} GiB per rank", f"{self.tokens_that_fit:,} (the group's tokens)"),
                ("  with a split index cache", f"{self.tokens_that_fit_split_index:,}"),
                ("  on one device (N = 1)", f"{self.tokens_that_fit_one_rank:,}"),
            ]
        return out


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def kv_bytes_per_layer(kv_dim: int, kv_dtype: str) -> int:
    if kv_dtype == "fp8_block":
        return kv_dim + FP8_SCALE_BYTES * -(-kv_dim // 128)
    return kv_dim * (1 if kv_dtype == "fp8" else 2)


def index_bytes_per_layer(index_head_dim: int, kv_dtype: str, fp8_keys: bool = False) -> int:
    return index_head_dim + FP8_SCALE_BYTES if kv_dtype != "bf16" or fp8_keys else 2 * index_head_dim


def config_kv_dtype(cfg) -> str:
    """The plan's KV dtype for a config's own storage (``DSAConfig.kv_dtype``, ``kv_scales``)."""
    if getattr(cfg, "kv_dtype", None) != "fp8":
        return "bf16"
    return "fp8_block" if cfg.kv_scales == "block" else "fp8"


def memory_plan(config, kv_dtype: str | None = None, dcp_size: int = 1, *, slots: int | None = None,
                gpu_mem_gib: float | None = None, interleave: int = 1, index_cache: str = "replicated") -> MemoryPlan:
    """The plan for a ``DSAConfig`` (or a config name) under DCP of size ``dcp_size`` (``interleave``
    slots kept together on one rank: a rank's cache for ``slots`` holds whole interleave blocks),
    with the index cache ``"replicated"`` or ``"sharded"``."""
    from dsa_dcp.models import get_config

    cfg = get_config(config) if isinstance(config, str) else config
    kv_dtype = config_kv_dtype(cfg) if kv_dtype is None else kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    if not (isinstance(dcp_size, int) and dcp_size >= 1):
        raise ValueError(f"dcp_size must be an integer >= 1, got {dcp_size!r}")
    if slots is not None and gpu_mem_gib is not None:
        raise ValueError("give slots or gpu_mem_gib, not both")
    if index_cache not in ("replicated", "sharded"):
        raise ValueError(f"index_cache must be 'replicated' or 'sharded', got {index_cache!r}")
    n = dcp_size
    sharded = index_cache == "sharded"
    kv_layer = kv_bytes_per_layer(cfg.kv_dim, kv_dtype)
    idx_layer = index_bytes_per_layer(cfg.index_head_dim, kv_dtype, getattr(cfg, "index_key_dtype", None) == "fp8")
    kv = cfg.n_layers * kv_layer
    idx = len(cfg.indexer_layers) * idx_layer
    split = (kv + idx) / n
    per_rank = split if sharded else kv / n + idx
    idx_per_rank = idx / n if sharded else idx
    fixed = FP8_SCALE_BYTES * cfg.n_layers if kv_dtype == "fp8" else 0
    plan = dict(
        config=cfg.name, kv_dtype=kv_dtype, dcp_size=n, layers=cfg.n_layers, indexer_layers=len(cfg.indexer_layers),
        kv_bytes_per_token_layer=kv_layer, index_bytes_per_token_layer=idx_layer, kv_bytes_per_token=kv,
        index_bytes_per_token=idx, kv_bytes_per_token_per_rank=kv / n, index_bytes_per_token_per_rank=idx_per_rank,
        bytes_per_token_per_rank=per_rank, bytes_per_token_per_rank_split_index=split,
        replicated_index_cost=(kv / n + idx) / split - 1, fixed_bytes_per_rank=fixed, index_cache=index_cache,
    )
    if slots is not None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        rows = local_cache_rows(slots, n, interleave)
        plan.update(slots=slots, bytes_per_rank_for_slots=rows * kv + (rows if sharded else slots) * idx + fixed)
    if gpu_mem_gib is not None:
        if gpu_mem_gib <= 0:
            raise ValueError(f"gpu_mem_gib must be > 0, got {gpu_mem_gib}")
        avail = gpu_mem_gib * GIB - fixed
        plan.update(gpu_mem_gib=gpu_mem_gib, tokens_that_fit=int(avail // per_rank),
                    tokens_that_fit_split_index=int(avail // split), tokens_that_fit_one_rank=int(avail // (kv + idx)))
    return MemoryPlan(**plan)
