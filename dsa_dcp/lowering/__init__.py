"""Lowering: turn the rewritten FX graph into what runs each step.

``inductor`` (the default) hands the graph to Inductor (AOT autograd + codegen); the ``dsa_dcp``
custom ops stay fallback kernels there. ``fx`` runs the graph as generated Python code (every
custom op dispatches to its CPU or CUDA kernel). On CUDA the result is then replayed from CUDA
graphs (``cuda_graphs.CudaGraphStep``), unless ``options.cuda_graphs`` is ``False``.

Position caches (``PositionShardedCache``: the global shape, this rank's positions only) are
unwrapped at the boundary: the rewritten graph reads them only through ``local_positions(cache)``,
so the lowered graph takes the local tensor itself in their place, and each call hands it over.
Inductor and the CUDA graphs then see plain tensors.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx

from dsa_dcp.config import DCPOptions
from dsa_dcp.lowering.cuda_graphs import CudaGraphStep
from dsa_dcp.passes.fx import alias_base, mutated_args, overwrites
from dsa_dcp.position_cache import PositionShardedCache, local_positions


def runs_on_cuda(example_inputs: Sequence[object]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the graph's inputs that it writes in place (through views too)."""
    written = {alias_base(a) for node in gm.graph.nodes for a in mutated_args(node)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, p in enumerate(placeholders) if p in written]


def accumulated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the graph's inputs that it updates from their own value (``counter.add_(n)``,
    ``x += y``): running the step again changes them again, which a KV write of the same rows does not."""
    accumulated = {alias_base(a) for node in gm.graph.nodes if not overwrites(node) for a in mutated_args(node)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, p in enumerate(placeholders) if p in accumulated]


def unwrap_position_caches(gm: fx.GraphModule, example_inputs: Sequence[object]) -> list[int]:
    """Make ``gm`` take each position cache's local tensor in its place (see module docstring);
    returns the positions of those inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    caches = [i for i, x in enumerate(example_inputs) if isinstance(x, PositionShardedCache)]
    for i in caches:
        cache = placeholders[i]
        views = [u for u in cache.users if u.op == "call_function" and u.target is local_positions]
        whole = example_inputs[i].dcp_layout.dcp_size == 1  # a group of one: the local tensor is the whole cache
        if len(views) != len(cache.users) and not whole:  # refused by the recognizing pass: never lower a
            # global-shaped use
            raise AssertionError(f"position cache {cache.name} is used whole: {list(cache.users)}")
        for view in views:
            cache.meta["example_value"] = view.meta.get("example_value")
            view.replace_all_uses_with(cache)
            gm.graph.erase_node(view)
    gm.recompile()
    return caches


def lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: DCPOptions) -> Callable:
    caches = unwrap_position_caches(gm, example_inputs)
    if caches:
        example_inputs = [local_positions(x) for x in example_inputs]
        return LocalCaches(_lower(gm, example_inputs, options, caches), caches)
    return _lower(gm, example_inputs, options)


class LocalCaches:
    """The lowered step, called with each position cache's local tensor in its place. What the
    benchmarks and the inspection tool ask of a CUDA-graph step (``graphs``, ``fn``,
    ``kernels_per_step``, ``uncaptured_calls``) is the step's own; nothing else is forwarded (dynamo
    looks at a compiled function's attributes)."""

    FORWARDED = ("graphs", "fn", "kernels_per_step", "uncaptured_calls")

    def __init__(self, step: Callable, caches: list[int]) -> None:
        self.step, self.caches = step, set(caches)

    def __call__(self, *args):
        return self.step(*(local_positions(a) if i in self.caches else a for i, a in enumerate(args)))

    def __getattr__(self, name: str):
        if name in LocalCaches.FORWARDED:
            return getattr(self.step, name)
        raise AttributeError(name)


def _lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: DCPOptions,
           caches: Sequence[int] = ()) -> Callable:
    written, accumulated = written_inputs(gm), accumulated_inputs(gm)  # before Inductor's passes see the graph
    on_cuda = runs_on_cuda(example_inputs)
    graphs = on_cuda if options.cuda_graphs is None else options.cuda_graphs
    if graphs and not on_cuda:  # refused by dsa_dcp.validate before the passes ran
        raise AssertionError("CUDA graphs for a CPU step")
    if options.lowering == "inductor":
        from torch._inductor.compile_fx import compile_fx

        fn = compile_fx(gm, list(example_inputs), config_patches=options.inductor_config())  # mode=max-autotune
    else:
        fn = gm.forward
    if graphs:
        return CudaGraphStep(fn, example_inputs, options.batch_sizes, written, accumulated, by_address=caches)
    return fn
