"""What ``dsa-dcp inspect TARGET`` compiles, and how, in one process.

A TARGET is a built-in config name (``deepseek-v3.2``, ``glm5``, ``glm5.2``, aliases ``glm5.1``,
``glm5.3``, each also ``-tiny``), ``hf:MODEL_TYPE[:LAYERS]`` (a tiny transformers model,
``deepseek_v32`` or ``glm_moe_dsa``, on a ``DCPStaticCache``) or ``module:factory``, a function returning
``(model, example_inputs)`` (called with ``dcp_size=N`` when it accepts that keyword, so it can
allocate the rank's KV caches with ``dsa_dcp.allocate_kv_cache(..., dcp_size=N)``).

The model is compiled for rank 0 of an N-rank DCP group without N processes: a ``fake`` process
group (``torch.testing._internal.distributed.fake_pg``) of world size N stands in for the group,
so the functional collectives trace and run as no-ops and no other rank exists. One step is run
to trigger the compilation; its values are meaningless and never looked at.

Built-in configs: a ``-tiny`` config is built for real on the CPU (tiny widths, the real layer
count and indexer layers). A full-size config is never allocated: the model is built on the
``meta`` device (no storage, no weight init) and compiled on meta tensors, so its graph, shapes
and collective bytes are those of the real widths. The memory plan is computed from the config, and so
is the capacity under TP (``tp_size``; ``capacity.py``): the compiled graph itself is not TP-sharded.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect as pyinspect
import math
import os
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist

from dsa_dcp.models import ALIASES, CONFIGS, DSAModel, get_config
from dsa_dcp.models.runner import decode_step_inputs

FAKE_GROUP_NOTE = ("fake process group (torch.distributed 'fake' backend, world size {n}): rank 0 compiled "
                   "in one process; collectives are traced and run as no-ops")


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world_size`` ranks, this process being rank 0."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            "dsa-dcp inspect compiles with its own fake process group, but torch.distributed is already "
            "initialized in this process; inspect a model you compiled yourself with dsa_dcp.inspect(compiled), "
            "or run the inspection in a fresh process"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def builtin_model(name: str, dcp_size: int, interleave: int = 1, rows: int = 4, index_cache: str = "replicated"
                  ) -> tuple[Any, tuple, Any, str]:
    """``(model, example_inputs, config, how)`` for a built-in config (see module docstring).

    A full-size model is built in bf16 (the serving dtype), so collective bytes are bf16 bytes; a
    ``-tiny`` one in float32 (the CPU reference).
    """
    cfg = get_config(name)
    tiny = cfg.name.endswith("-tiny")
    device = "cpu" if tiny else "meta"
    # the full top-k (K = index_topk) fits in each request's pages
    pages = max(1, math.ceil(cfg.index_topk / cfg.page_size))
    inputs, num_slots = decode_step_inputs(cfg, rows, pages * cfg.page_size - 1, device)
    if tiny:
        model = DSAModel(cfg, num_slots, dcp_size=dcp_size, interleave=interleave, index_cache=index_cache)
        how = (f"DSAModel({cfg.name}): {cfg.n_layers} layers, {len(cfg.indexer_layers)} with an indexer; "
               f"built on the CPU (tiny widths); one step of {rows} decode rows, top-k {cfg.index_topk}")
    else:
        with torch.device("meta"):
            model = _MetaDSAModel(cfg, num_slots, dcp_size=dcp_size, interleave=interleave, device="meta",
                                  dtype=torch.bfloat16, index_cache=index_cache)
        how = (f"DSAModel({cfg.name}): {cfg.n_layers} layers, {len(cfg.indexer_layers)} with an indexer; "
               f"full size in bf16, built and traced on the meta device (no memory allocated, real shapes); "
               f"one step of {rows} decode rows, top-k {cfg.index_topk}")
    return model, inputs, cfg, how


class _MetaDSAModel(DSAModel):
    """``DSAModel`` on the meta device: weights have shapes but no values, so nothing to initialize."""

    def _init_weights(self, seed: int) -> None:
        pass


def factory_model(spec: str, dcp_size: int) -> tuple[Any, tuple, Any, str]:
    """``(model, example_inputs, config or None, how)`` from ``module:factory``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"TARGET {spec!r} is neither a built-in config nor module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for TARGET {spec!r}: {e}") from e
    for part in attr.split("."):
        factory = getattr(factory, part)
    params = pyinspect.signature(factory).parameters
    takes_size = "dcp_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    result = factory(dcp_size=dcp_size) if takes_size else factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    cfg = getattr(model, "cfg", None)
    how = f"{spec}() -> {type(model).__name__}" + (f" (called with dcp_size={dcp_size})" if takes_size else "")
    return model, inputs, cfg, how


HF_PREFIX = "hf:"


class _HFStep(torch.nn.Module):
    """One decode step of a transformers model on a DCP static cache, as a module of one input."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True).logits


def hf_model(target: str, dcp_size: int, interleave: int = 1, rows: int = 4) -> tuple[Any, tuple, Any, str]:
    """``hf:MODEL_TYPE[:LAYERS]`` (``deepseek_v32``, ``glm_moe_dsa``): a tiny random transformers model
    (``integrations.transformers.tiny_model``) on a ``DCPStaticCache``; one step of ``rows`` requests."""
    from dsa_dcp.integrations.transformers import DCPStaticCache, tiny_model

    model_type, _, layers = target[len(HF_PREFIX):].partition(":")
    layers = int(layers) if layers else 4
    model = tiny_model(model_type, layers=layers)
    cache = DCPStaticCache(model.config, max_cache_len=model.config.index_topk * 4, batch_size=rows,
                           dcp_size=dcp_size, interleave=interleave)
    length = cache.get_max_length()
    how = (f"{type(model).__name__} ({model_type}, transformers): {layers} layers, tiny random weights, eager "
           f"attention, on a DCPStaticCache of {length} positions ({length // dcp_size} per rank); one step of "
           f"{rows} requests")
    return _HFStep(model, cache), (torch.ones(rows, 1, dtype=torch.long),), None, how


def is_builtin(target: str) -> bool:
    return target in CONFIGS or target in ALIASES


def inspect_target(target: str, *, dcp_size: int = 2, merge: str = "a2a", interleave: int = 1,
                   kv_dtype: str = "bf16", slots: int | None = None, gpu_mem_gib: float | None = None,
                   rows: int = 4, options: dict | None = None, tp_size: int | None = None, **capacity: Any):
    """Compile ``target`` for rank 0 of a fake ``dcp_size``-rank group and return its ``Inspection``.

    Resets dynamo's caches first (each inspection is one fresh compilation). It compiles with
    ``lowering="fx"`` unless ``options`` say otherwise: the passes, and so everything inspected,
    are the same under every lowering, and the FX lowering compiles in a fraction of the time.

    With ``tp_size`` the report also holds ``capacity.capacity_plan(config, tp_size, dcp_size,
    **capacity)`` (``weight_dtype``, ``replicate_q``, ``gpu``, ``reserve_gb``), computed from the
    target's ``DSAConfig`` before anything is compiled: a layout the config cannot be split by
    raises ``capacity.LayoutError`` first.
    """
    from dsa_dcp.inspection.capacity import LayoutError, capacity_plan
    from dsa_dcp.inspection.report import inspect

    index_cache = (options or {}).get("index_cache", "replicated")
    if tp_size is None and capacity:
        raise TypeError(f"{sorted(capacity)} need tp_size (the TP size the capacity is computed for)")

    def plan_for(cfg):
        if tp_size is None:
            return None
        if cfg is None or not hasattr(cfg, "kv_dim"):
            raise LayoutError(f"tp_size (--tp) needs the target's DSAConfig (a built-in config, or a module:factory "
                              f"whose model has a cfg attribute); {target!r} has none")
        return capacity_plan(cfg, tp_size, dcp_size, kv_dtype=kv_dtype, index_cache=index_cache, **capacity)

    if is_builtin(target):
        plan = plan_for(get_config(target))
        model, inputs, cfg, how = builtin_model(target, dcp_size, interleave, rows, index_cache)
    elif target.startswith(HF_PREFIX):
        plan = plan_for(None)
        model, inputs, cfg, how = hf_model(target, dcp_size, interleave, rows)
    else:
        model, inputs, cfg, how = factory_model(target, dcp_size)
        plan = plan_for(cfg)
    opts = {"dcp_size": dcp_size, "merge": merge, "interleave": interleave, "lowering": "fx", **(options or {})}
    torch._dynamo.reset()
    with fake_group(dcp_size):
        compiled = torch.compile(model, backend="dsa_dcp", options=opts, fullgraph=True)
        with torch.no_grad():
            compiled(*inputs)
    group = FAKE_GROUP_NOTE.format(n=dcp_size) if dcp_size > 1 else "none (dcp_size = 1)"
    return inspect(compiled, config=cfg, kv_dtype=kv_dtype, slots=slots, gpu_mem_gib=gpu_mem_gib,
                   target={"name": target, "how": how, "process_group": group}, capacity=plan)
