"""Inspect what the ``dsa_dcp`` backend did to a model: ``dsa_dcp.inspect(compiled)`` and ``dsa-dcp inspect``.

``inspect(compiled)`` returns an ``Inspection`` of the last compilation of a ``torch.compile``
result (or of the module / function given to ``torch.compile``); ``dsa_dcp.inspect`` is this
function. ``inspect_target(name, ...)`` compiles a built-in config or a ``module:factory`` for
rank 0 of an N-rank group in this process (a fake process group) and inspects it; it is what the
CLI runs. ``memory_plan`` computes the per-rank memory plan of a config; ``capacity_plan`` its weights
and KV tokens per rank under TP with DCP inside it. See ``docs/inspect.md`` and ``docs/capacity.md``.

Importing this package is cheap: the backend files reports through ``dsa_dcp.registry``; the
report, rendering and target code load when used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["inspect", "inspect_target", "memory_plan", "capacity_plan"]


def inspect(compiled: Any, **memory: Any):
    """The ``Inspection`` of the last compilation of ``compiled`` (see ``report.inspect``)."""
    from dsa_dcp.inspection.report import inspect as _inspect

    return _inspect(compiled, **memory)


def inspect_target(target: str, **kwargs: Any):
    """Compile ``target`` for rank 0 of a fake N-rank group and inspect it (see ``targets.inspect_target``)."""
    from dsa_dcp.inspection.targets import inspect_target as _inspect_target

    return _inspect_target(target, **kwargs)


def memory_plan(config: Any, kv_dtype: str | None = None, dcp_size: int = 1, **kwargs: Any):
    """Per-rank memory plan of a config (see ``memory.memory_plan``)."""
    from dsa_dcp.inspection.memory import memory_plan as _memory_plan

    return _memory_plan(config, kv_dtype, dcp_size, **kwargs)


def capacity_plan(config: Any, tp_size: int, dcp_size: int = 1, **kwargs: Any):
    """Weights, bytes per token and KV tokens per rank at TP ``tp_size`` with DCP ``dcp_size`` inside it
    (see ``capacity.capacity_plan``)."""
    from dsa_dcp.inspection.capacity import capacity_plan as _capacity_plan

    return _capacity_plan(config, tp_size, dcp_size, **kwargs)
