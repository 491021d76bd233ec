"""Lowering: turn the rewritten FX graph into what runs each step.

``fx`` runs the graph as generated Python code (the default; every custom op dispatches to its
CPU or CUDA kernel). ``inductor`` hands the graph to Inductor (AOT autograd + codegen); the
``dsa_dcp`` custom ops stay fallback kernels there. On CUDA the result is then replayed from CUDA
graphs (``cuda_graphs.CudaGraphStep``), unless ``options.cuda_graphs`` is ``False``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx

from dsa_dcp.config import DCPOptions
from dsa_dcp.lowering.cuda_graphs import CudaGraphStep
from dsa_dcp.passes.dataflow import mutated_args
from dsa_dcp.passes.graph import alias_base


def runs_on_cuda(example_inputs: Sequence[object]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the graph's inputs that it writes in place (through views too)."""
    written = {alias_base(a) for node in gm.graph.nodes for a in mutated_args(node)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, p in enumerate(placeholders) if p in written]


def lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: DCPOptions) -> Callable:
    written = written_inputs(gm)  # before Inductor's passes see the graph
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
        return CudaGraphStep(fn, example_inputs, options.batch_sizes, written)
    return fn
