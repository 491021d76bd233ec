"""DCP for Hugging Face transformers models: a static cache that holds 1/N of the positions per rank.

One line on each rank, beside compiling the model with the backend::

    from dsa_dcp.integrations.transformers import DCPStaticCache

    model.compile(backend="dsa_dcp", options={"dcp_size": N}, fullgraph=True)
    cache = DCPStaticCache(model.config, max_cache_len=L, batch_size=B, dcp_size=N)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n)

``DCPStaticCache`` is transformers' ``StaticCache`` with every layer allocated up front (a compiled
prefill must find the caches as inputs) and each layer's K/V (``[B, H, T, D]``) a
``PositionShardedCache``: the global shape for the model's code, ``T / N`` positions in memory
(``max_cache_len`` is rounded up to a multiple of ``N * interleave``). The indexer's key cache
(``StaticIndexedLayer.indexer_keys``) stays whole on every rank, as the indexer needs every key.
The ``dsa_dcp`` passes recognize the models' masked attention over these caches and localize
their ``index_copy_`` writes (``docs/models.md``).

Use ``model.compile(...)`` (in place) rather than ``torch.compile(model)``: ``generate`` calls
the model itself, so a compiled wrapper's ``generate`` would run the model uncompiled (and the
cache refuses that loudly). transformers' ``cache_implementation=`` accepts only its own names, so
the cache is passed as ``past_key_values``. On CUDA pass ``disable_compile=True`` to ``generate``
so it does not wrap the already compiled model in its own ``torch.compile``.

Every rank of the group runs the same ``generate`` and must choose the same tokens: each step's next
token is the next step's input, and ranks fed different inputs corrupt every rank's result. Greedy
decoding agrees by itself (the ranks' logits are the same); sampling would not where the ranks' random
generators were seeded differently. So ``generate`` with a ``DCPStaticCache`` adds ``DCPGroupSampling``
last to its logits processors (importing this module installs that): every step, rank 0's scores and
random-generator state are broadcast to the group, and every rank chooses what rank 0 chooses
(``do_sample=True``, greedy and beam search alike). The group is the world when it has ``dcp_size``
ranks; otherwise name it with ``cache.sample_over(group)`` (``generate`` refuses to guess). Beam
search (``num_beams > 1``, a cache allocated for ``batch_size * num_beams`` rows) reorders the cache
in place (``DCPStaticCache.reorder_cache``).
"""

from __future__ import annotations

import functools

import torch

from dsa_dcp.position_cache import as_position_cache, local_positions, round_up_length

try:
    import transformers
    from transformers import LogitsProcessor, StaticCache
except ImportError as e:  # pragma: no cover - the optional extra
    raise ImportError("dsa_dcp.integrations.transformers needs transformers: pip install 'dsa-dcp[hf]'") from e

__all__ = ["DCPGroupSampling", "DCPStaticCache", "cache_dims", "cached_layout", "initialize_layers",
           "left_padded_prompts", "sampling_processor", "tiny_model",
           "TINY_MODEL_TYPES"]

TINY_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


def tiny_model(model_type: str, *, attn_implementation: str = "eager", layers: int = 2, seed: int = 0, **overrides):
    """A tiny random transformers DSA model for CPU tests and ``dsa-dcp inspect hf:MODEL_TYPE``.

    12 heads (divisible by 2, 3, 4 and 6 ranks), K (nope 8 + rope 8) and V (4) of different widths,
    dense MLPs (the MoE is untouched by DCP), 8 index heads, top-k 4. GLM-5 layers after the first
    reuse the previous full layer's top-k (``indexer_types``: full, shared, shared, full, ...) and
    its projections have biases.
    """
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=12, num_key_value_heads=12, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                  topk_group=1, index_topk=4, index_head_dim=16, index_n_heads=8, max_position_embeddings=64,
                  num_hidden_layers=layers, first_k_dense_replace=layers, pad_token_id=0)
    if model_type == "deepseek_v32":
        cfg, cls = transformers.DeepseekV32Config(**{**common, **overrides}), transformers.DeepseekV32ForCausalLM
    elif model_type == "glm_moe_dsa":
        pattern = ["full" if i % 3 == 0 else "shared" for i in range(layers)]
        cfg = transformers.GlmMoeDsaConfig(**{"indexer_types": pattern, "attention_bias": True, **common, **overrides})
        cls = transformers.GlmMoeDsaForCausalLM
    else:
        raise ValueError(f"unknown model type {model_type!r}; tiny models exist for {list(TINY_MODEL_TYPES)}")
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return cls(cfg).eval()


def left_padded_prompts(lengths, vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths as ``generate`` takes them: ``input_ids`` and
    ``attention_mask`` ``[len(lengths), max(lengths)]``, each prompt left-padded (mask 0 before it)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
    return ids, mask


# The tiny model's widths are all different, so the shapes its layers cache name the config fields
# they come from (``cached_layout``).
_PROBE_DIMS = {"qk_head_dim": 16, "v_head_dim": 4, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "index_head_dim": 20}


@functools.lru_cache(maxsize=None)
def cached_layout(model_type: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """What this transformers release caches per layer, as config fields: ``((heads, width) of the
    keys, (heads, width) of the values)``, heads being ``"num_attention_heads"`` or ``"one"``.

    Read off a one-token forward of a tiny model of the same type whose widths all differ: releases
    up to 5.17 cache the expanded per-head K (nope + rope) and V; from 5.18 on, MLA's latent
    (``kv_lora_rank``) and its rope part, one head each. Only the public cache API is read.
    """
    widths = {v: k for k, v in _PROBE_DIMS.items()}
    model = tiny_model(model_type, layers=1, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4,
                       kv_lora_rank=24, index_head_dim=20)
    with torch.no_grad():
        cache = model(torch.ones(1, 1, dtype=torch.long), use_cache=True).past_key_values
    layer = cache.layers[0]
    found = []
    for t in (layer.keys, layer.values):
        heads = {1: "one", model.config.num_attention_heads: "num_attention_heads"}.get(t.shape[1])
        width = widths.get(t.shape[-1])
        if t.dim() != 4 or heads is None or width is None:
            raise NotImplementedError(
                f"transformers {transformers.__version__} caches {model_type} layers as K "
                f"{tuple(layer.keys.shape)} and V {tuple(layer.values.shape)} for a tiny model with "
                f"{_PROBE_DIMS}: DCPStaticCache does not know this layout")
        found.append((heads, width))
    return found[0], found[1]


def cache_dims(config) -> dict:
    """Heads and widths of the K and V each layer caches (``cached_layout`` read off this release),
    the index key width and which layers hold index keys."""
    text = config.get_text_config(decoder=True)
    fields = {"one": 1, "num_attention_heads": text.num_attention_heads,
              "qk_head_dim": getattr(text, "qk_head_dim", None) or text.qk_nope_head_dim + text.qk_rope_head_dim,
              "v_head_dim": text.v_head_dim, "kv_lora_rank": text.kv_lora_rank,
              "qk_rope_head_dim": text.qk_rope_head_dim}
    (kh, kw), (vh, vw) = cached_layout(text.model_type)
    return {"k_heads": fields[kh], "k_dim": fields[kw], "v_heads": fields[vh], "v_dim": fields[vw],
            "latent": kw == "kv_lora_rank", "index_dim": getattr(text, "index_head_dim", None),
            "indexer_types": getattr(text, "indexer_types", None)}


def initialize_layers(cache, config, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Allocate every layer of a ``StaticCache`` now (a compiled prefill must find its caches as
    inputs) through the layers' own public ``lazy_initialization`` and ``lazy_initialization_indexer``,
    given empty examples of the shapes this release caches (``cache_dims``)."""
    dims = cache_dims(config)
    device = torch.device(device)
    for i, layer in enumerate(cache.layers):
        k = torch.empty(batch_size, dims["k_heads"], 0, dims["k_dim"], dtype=dtype, device=device)
        v = torch.empty(batch_size, dims["v_heads"], 0, dims["v_dim"], dtype=dtype, device=device)
        layer.lazy_initialization(k, v)
        shared = dims["indexer_types"] is not None and dims["indexer_types"][i] != "full"
        if hasattr(layer, "lazy_initialization_indexer") and dims["index_dim"] and not shared:
            layer.lazy_initialization_indexer(torch.empty(batch_size, 0, dims["index_dim"], dtype=dtype,
                                                          device=device))


class DCPStaticCache(StaticCache):
    """A ``StaticCache`` whose K/V hold this rank's positions only (module docstring).

    ``dcp_size=1`` holds every position: the compiled model attends over the top-k positions alone,
    and the cache works like transformers' own everywhere else (eagerly, under any backend).

    Built on transformers' public cache API: each layer is initialized by its own
    ``lazy_initialization`` (and ``lazy_initialization_indexer``) from empty examples of the shapes
    this release caches (``cache_dims``), then its ``keys`` and ``values`` become position caches.
    """

    def __init__(self, config, max_cache_len: int, *, batch_size: int, dcp_size: int, interleave: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", **kwargs):
        max_cache_len = round_up_length(max_cache_len, dcp_size, interleave)
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self.dcp_size, self.interleave = dcp_size, interleave
        initialize_layers(self, config, batch_size, dtype, device)
        for layer in self.layers:
            layer.keys = as_position_cache(layer.keys, 2, dcp_size=dcp_size, interleave=interleave)
            layer.values = as_position_cache(layer.values, 2, dcp_size=dcp_size, interleave=interleave)

    def kv_positions_per_rank(self) -> list[int]:
        """Positions each layer's K and V hold in memory on this rank (``max_cache_len / dcp_size``)."""
        return [local_positions(t).shape[2] for layer in self.layers for t in (layer.keys, layer.values)]

    # Beam search and sampling under DCP (module docstring); kept apart from __init__.
    sampling_group = None  # the ranks that generate together (sample_over); None: the world

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's cache reordering: every layer's rows (beams) take the rows ``beam_idx`` names,
        in place. The batch dim is not split over the group, so each rank permutes the positions it
        holds, the same way on every rank (every rank computes the same ``beam_idx`` from the same
        scores); the tensors stay the ones the compiled step reads (transformers' static layers would
        replace them with new ones, and a position cache cannot be indexed outside the compiled step)."""
        for layer in self.layers:
            for cache in (layer.keys, layer.values):
                local = local_positions(cache)
                local.copy_(local.index_select(0, beam_idx.to(local.device)))
            if getattr(layer, "is_indexer_initialized", False) and layer.indexer_keys.numel() > 0:
                keys = layer.indexer_keys
                keys.copy_(keys.index_select(0, beam_idx.to(keys.device)))

    def sample_over(self, group) -> "DCPStaticCache":
        """Name the ranks that generate together with this cache (a ``torch.distributed`` process group:
        the DCP group, or a larger one such as the TP group, all of whose ranks run the same requests).
        Without it ``generate`` agrees over the world group when that has ``dcp_size`` ranks, and refuses
        otherwise (two DCP groups serving different requests must not share their tokens). Returns the
        cache."""
        self.sampling_group = group
        return self


# --------------------------------------------------------------------------- sampling under DCP


class DCPGroupSampling(LogitsProcessor):
    """A logits processor that makes every rank of a group choose the token rank ``src`` chooses.

    Called last on each step's scores (``generate`` adds it for a ``DCPStaticCache``), it broadcasts
    rank ``src``'s scores and the state of the random generator ``generate`` samples from (the
    default generator of the scores' device) to every rank of ``group``. Every rank then samples
    (``do_sample=True``: ``torch.multinomial``), picks the argmax, or scores its beams from the same
    numbers with the same generator state, so all of them choose what rank ``src`` alone would have
    chosen, whatever seeds the ranks were started with: the serving engine's "sample once and
    broadcast". One broadcast of ``[batch, vocab]`` floats and one of the generator state per step.
    """

    def __init__(self, group=None, src: int = 0) -> None:
        self.group, self.src = group, src

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        root = dist.get_global_rank(self.group, self.src) if self.group is not None else self.src
        # NCCL moves CUDA tensors only; any other backend (gloo) gets host tensors (gloo's collectives
        # on CUDA tensors go through the host anyway, and its all-gather of them crashes)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        moved = tensor.to(device).contiguous()
        dist.broadcast(moved, src=root, group=self.group)
        return moved.to(tensor.device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return scores
        scores = self._broadcast(scores)
        if scores.is_cuda:
            state = self._broadcast(torch.cuda.get_rng_state(scores.device))
            torch.cuda.set_rng_state(state.cpu(), scores.device)
        else:
            torch.set_rng_state(self._broadcast(torch.get_rng_state()).cpu())
        return scores


def sampling_processor(cache: DCPStaticCache) -> DCPGroupSampling | None:
    """The ``DCPGroupSampling`` ``generate`` adds for ``cache`` (``None`` for a single-rank cache or a
    single process): over ``cache.sampling_group``, else the world when it has ``dcp_size`` ranks;
    refuses (``ValueError``) a world of another size with no group named."""
    import torch.distributed as dist

    if getattr(cache, "dcp_size", 1) == 1:
        return None
    group = cache.sampling_group
    if group is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:  # one process: nothing to agree with (the compiled step refuses the cache's layout)
            return None
        if world != cache.dcp_size:
            raise ValueError(
                f"generate with a DCPStaticCache for dcp_size={cache.dcp_size} in a world of {world} rank(s): the "
                f"ranks that generate together must choose the same tokens, so name them: "
                f"cache.sample_over(group) (the DCP group, or the group of every rank serving these requests)")
    return DCPGroupSampling(group)


def _install_group_sampling() -> None:
    """Make ``generate`` add ``DCPGroupSampling`` last to its logits processors whenever it generates
    with a ``DCPStaticCache`` of ``dcp_size > 1`` (wrapping ``GenerationMixin._get_logits_processor``,
    where ``generate`` builds that list; idempotent). Without it, ranks seeded differently would
    sample different tokens and feed them to the next step: every rank's result would be wrong."""
    import functools
    import inspect

    import transformers
    from transformers.generation.utils import GenerationMixin

    original = getattr(GenerationMixin, "_get_logits_processor", None)
    if original is None:  # refuse loudly: without it ranks seeded differently would sample different tokens
        raise ImportError(
            f"dsa_dcp.integrations.transformers makes generate agree on sampled tokens over the DCP group by "
            f"wrapping GenerationMixin._get_logits_processor, which transformers {transformers.__version__} does "
            f"not have (written against 5.17.0)")
    if getattr(original, "_dsa_dcp_group_sampling", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_logits_processor(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        model_kwargs = signature.bind_partial(self, *args, **kwargs).arguments.get("model_kwargs") or {}
        # the cache's keyword moved (past_key_values up to 5.23, cache from 5.24): any DCPStaticCache given
        cache = next((value for value in model_kwargs.values() if isinstance(value, DCPStaticCache)), None)
        if cache is not None and not any(isinstance(p, DCPGroupSampling) for p in processors):
            processor = sampling_processor(cache)
            if processor is not None:
                processors.append(processor)
        return processors

    _get_logits_processor._dsa_dcp_group_sampling = True
    GenerationMixin._get_logits_processor = _get_logits_processor


_install_group_sampling()
