"""Several option sets over one dynamo trace, for the end-to-end tests on gloo ranks.

Most of an end-to-end test's time on a CPU is dynamo tracing the model (about 3 s for a 4-layer tiny
model on one core, against 0.2 s for the rewrite and the FX lowering). A test that runs the same
model under every merge mode would trace it once a mode. ``OneTrace(option_sets)`` is a
``torch.compile`` backend that, for each graph dynamo traces, runs ``dsa_dcp_backend`` once per
option set on its own copy of the graph (the passes rewrite the graph they are given) and returns a
call that runs the compilation of the selected set (``select(key)``). The model is traced once; each
option set is compiled as ``torch.compile(model, backend="dsa_dcp", options=...)`` compiles it, and
with the same example inputs. A refusal is kept and raised when its set is selected and called.

Every rank compiles the option sets in the same order, so the compile-time agreement rounds match
across the group. The model's caches are the same tensors for every set: a test that reads them
after a run zeroes them before the next (``DSAModel.reset_caches``, ``zero_position_caches``).
"""

from __future__ import annotations

import copy
from typing import Any, Hashable

import torch
import torch.fx as fx

import dsa_dcp
from dsa_dcp.backend import dsa_dcp_backend

_GM_ATTRIBUTES = ("meta", "_param_name_to_source", "_source_to_user_stacks")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node metadata copied shallowly, as
    ``Graph.__deepcopy__`` does), sharing ``gm``'s parameters and buffers."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for old_node, new_node in zip(gm.graph.nodes, new.graph.nodes):  # dynamo's attributes on placeholders
        for name, value in vars(old_node).items():
            if name.startswith("_dynamo"):
                setattr(new_node, name, value)
    for name in _GM_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(new, name, copy.copy(getattr(gm, name)))
    return new


class OneTrace:
    """See the module docstring. ``option_sets``: key -> the ``options`` of ``torch.compile``."""

    def __init__(self, option_sets: dict[Hashable, dict[str, Any]]) -> None:
        self.option_sets = dict(option_sets)
        self.current: Hashable = next(iter(self.option_sets))
        self.reports: dict[Hashable, Any] = {}  # key -> the backend report of its last compiled graph
        self.traces = 0

    def select(self, key: Hashable) -> None:
        if key not in self.option_sets:
            raise KeyError(key)
        self.current = key

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.traces += 1
        compiled: dict[Hashable, Any] = {}
        for key, options in self.option_sets.items():
            try:
                compiled[key] = dsa_dcp_backend(copy_graph_module(gm), example_inputs, options)
                self.reports[key] = dsa_dcp.backend_report()
            except Exception as e:  # noqa: BLE001 - raised when the set is run
                compiled[key] = e

        def run(*args):
            fn = compiled[self.current]
            if isinstance(fn, Exception):
                raise fn
            return fn(*args)

        return run


def zero_position_caches(model: torch.nn.Module) -> None:
    """Zero the plain model's position caches (``models/plain.py``; ``DSAModel`` has
    ``reset_caches``), between option sets that share them."""
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.kv_cache.zero_()
            layer.attn.pe_cache.zero_()
