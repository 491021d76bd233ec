"""Lowering: turn the rewritten FX graph into what runs each step.

``fx`` runs the graph as generated Python code (the default; every custom op dispatches to its
CPU or CUDA kernel). ``inductor`` hands the graph to Inductor (AOT autograd + codegen); the
``dsa_dcp`` custom ops stay fallback kernels there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx

from dsa_dcp.config import DCPOptions


def lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: DCPOptions) -> Callable:
    if options.lowering == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    return gm.forward
