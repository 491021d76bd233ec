"""Replay a compiled step from CUDA graphs.

Dynamo compiles one graph per static input shape, so a step that an engine pads up to a few row
buckets (``options.batch_sizes``) compiles, and is captured, once per bucket. ``CudaGraphStep``
wraps the compiled callable:

- Inputs whose address never changes between calls (parameters and buffers, which dynamo marks
  static — the KV caches among them) are used in place. So are the other inputs the step writes
  in place (a KV cache passed as an argument): their address is part of the graph's key, so a
  different cache gets its own graph and the writes always land in the caller's tensor. The
  remaining inputs (rows, page table) are copied into static buffers before each replay, so a
  caller that changes its tensors in place between steps is always seen.
- The first call of a shape runs the step eagerly twice on a side stream (compiling every Triton
  kernel and letting allocators settle), then captures it once and replays it. KV writes repeat
  the same rows to the same slots, so the warm-up runs are harmless.
- A shape whose leading dimension exceeds the largest bucket runs uncaptured.
- Outputs are copied out of the graph's static buffers, so a result stays valid after the next
  step.
- ``kernels_per_step()`` counts the kernels a graph replays by running its step once more under
  the profiler, when first asked (benchmarks and inspection ask; a serving step never pays it).

Everything inside the step must be capturable: no host syncs, no data-dependent shapes. The
``sparse_mla`` op uses its Triton kernel while a capture is under way (FlashInfer plans on the
host).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("dsa_dcp.lowering")


def _is_static(t: object) -> bool:
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list, copied: list[int], outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.copied = copied  # positions of the inputs copied in before each replay
        self.kernels: int | None = None  # counted when first asked


def device_kernels(fn: Callable, args: Sequence, runs: int = 1) -> list[tuple[str, float]]:
    """``(name, us)`` of every CUDA kernel that ``runs`` eager runs of ``fn(*args)`` launch (what
    its graph replays; copies and memsets left out)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn(*args)
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def count_kernels(fn: Callable, args: Sequence) -> int:
    """CUDA kernels one eager run of ``fn(*args)`` launches (what its graph replays)."""
    return len(device_kernels(fn, args))


class CudaGraphStep:
    """``fn`` replayed from one CUDA graph per input signature (see module docstring)."""

    def __init__(self, fn: Callable, example_inputs: Sequence, batch_sizes: Sequence[int], written: Sequence[int] = ()):
        """``written``: positions of the inputs ``fn`` writes in place (see ``lowering.written_inputs``)."""
        self.fn = fn
        self.max_rows = max(batch_sizes)
        self.static = [_is_static(t) for t in example_inputs]
        # only these positions can change between calls; the per-call Python work loops over them
        self.varying = [i for i, static in enumerate(self.static) if not static]
        self.in_place = {i for i in self.varying if i in set(written)}  # used where they are, never copied
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.uncaptured_calls = 0

    def _signature(self, args: Sequence) -> tuple:
        return tuple(
            ((tuple(a.shape), a.dtype, a.device) + ((a.data_ptr(),) if i in self.in_place else ()))
            if isinstance(a, torch.Tensor) else a
            for i, a in ((i, args[i]) for i in self.varying)
        )

    def _capturable(self, args: Sequence) -> bool:
        return all(
            not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] <= self.max_rows
            for a in (args[i] for i in self.varying)
        )

    def kernels_per_step(self) -> dict[tuple, int]:
        """Kernels each captured graph replays. Counting runs each step once more, eagerly, on its
        last inputs (which repeats its KV writes: the same rows into the same slots)."""
        for c in self.graphs.values():
            if c.kernels is None:
                c.kernels = count_kernels(self.fn, c.inputs)
        return {sig: c.kernels for sig, c in self.graphs.items()}

    def _capture(self, args: list) -> _Captured:
        copied = [i for i in self.varying if isinstance(args[i], torch.Tensor) and i not in self.in_place]
        inputs = list(args)
        for i in copied:
            inputs[i] = args[i].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs)
        log.debug("captured a CUDA graph for %s", self._signature(args))
        return _Captured(graph, inputs, copied, outputs)

    def __call__(self, *args):
        if not self._capturable(args):
            self.uncaptured_calls += 1
            return self.fn(*args)
        sig = self._signature(args)
        captured = self.graphs.get(sig)
        if captured is None:
            captured = self.graphs[sig] = self._capture(list(args))
        for i in captured.copied:
            buf, a = captured.inputs[i], args[i]
            if buf.data_ptr() != a.data_ptr():
                buf.copy_(a)
        captured.graph.replay()
        outputs = captured.outputs
        if isinstance(outputs, torch.Tensor):
            return outputs.clone()
        return type(outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)
