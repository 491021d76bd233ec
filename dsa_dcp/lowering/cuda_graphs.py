"""Replay a compiled step from CUDA graphs.

Dynamo compiles one graph per static input shape, so a step that an engine pads up to a few row
buckets (``options.batch_sizes``) compiles, and is captured, once per bucket. ``CudaGraphStep``
wraps the compiled callable:

- **A shape is captured on its second call.** The first call of an input signature runs the
  compiled step as it is (Triton compiles its kernels, the allocators settle); the second captures
  the step, then replays the capture. So every call runs the step exactly once: a step that
  advances state in place (transformers' static caches count their positions with ``add_``) is
  never run twice for one call, and a shape seen once only (a prefill, whose prompt length
  differs from request to request) never costs a capture and a graph's memory. Decode steps, which
  repeat one shape per bucket, are replayed from their second step on.
- Parameters are used in place. So are buffers and the tensors a model marks static (transformers'
  static caches and their position counters), the inputs the step writes in place (a KV cache
  passed as an argument) and position caches: their addresses are part of the graph's key, so
  another cache of the same shapes (a new ``StaticCache`` for the next ``generate``) gets its own
  graph and the step always reads and writes the caller's tensors. The remaining inputs (rows,
  page table) are copied into static buffers before each replay, so a caller that changes its
  tensors in place between steps is always seen.
- A shape whose leading dimension exceeds the largest bucket runs uncaptured.
- Outputs are copied out of the graph's static buffers, so a result stays valid after the next
  step.
- ``kernels_per_step()`` counts the kernels a graph replays by replaying it once more under the
  profiler, when first asked (benchmarks and inspection ask; a serving step never pays it). The
  inputs the step accumulates into (``add_`` and the like, found in the graph) are saved before
  that replay and put back after it, so the count changes no state; KV writes repeat the same rows
  into the same slots.

Everything inside the step must be capturable: no host syncs, no data-dependent shapes. The
``sparse_mla`` op uses its Triton kernel while a capture is under way (FlashInfer plans on the
host).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("dsa_dcp.lowering")


def _trusted_static(t: object) -> bool:
    """A parameter, or a tensor dynamo guards by address (it recompiles if another one comes)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) == "guarded"


def _marked_static(t: object) -> bool:
    """Buffers, and tensors marked with ``mark_static_address`` (transformers' static caches): fixed
    addresses by intent, but not guarded, so another cache of the same shapes reaches the same step."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list, copied: list[int], outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.copied = copied  # positions of the inputs copied in before each replay
        self.kernels: int | None = None  # counted when first asked


def device_kernels(fn: Callable, args: Sequence, runs: int = 1, starts: bool = False) -> list[tuple]:
    """``(name, us)`` of every CUDA kernel that ``runs`` eager runs of ``fn(*args)`` launch (what
    its graph replays; copies and memsets left out); ``(name, us, start us)`` with ``starts``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn(*args)
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) + ((float(e.time_range.start),) if starts else ())
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def count_kernels(fn: Callable, args: Sequence) -> int:
    """CUDA kernels one eager run of ``fn(*args)`` launches (what its graph replays)."""
    return len(device_kernels(fn, args))


class CudaGraphStep:
    """``fn`` replayed from one CUDA graph per input signature (see module docstring)."""

    def __init__(self, fn: Callable, example_inputs: Sequence, batch_sizes: Sequence[int], written: Sequence[int] = (),
                 accumulated: Sequence[int] = (), by_address: Sequence[int] = ()):
        """``written``: positions of the inputs ``fn`` writes in place (``lowering.written_inputs``);
        ``accumulated``: those among them whose new value depends on the old (``lowering.accumulated_inputs``);
        ``by_address``: other inputs to use in place, keyed by address (position caches)."""
        self.fn = fn
        self.max_rows = max(batch_sizes)
        # only these positions can change between calls; the per-call Python work loops over them
        self.varying = [i for i, t in enumerate(example_inputs) if not _trusted_static(t)]
        keyed = set(written) | set(by_address)
        # used where they are, never copied; their address is part of the signature
        self.in_place = {i for i in self.varying if i in keyed or _marked_static(example_inputs[i])}
        self.accumulated = list(accumulated)
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()  # signatures called once, uncaptured: the next call captures
        self.pool = torch.cuda.graph_pool_handle()
        self.uncaptured_calls = 0

    def _signature(self, args: Sequence) -> tuple:
        return tuple(
            ((tuple(a.shape), a.dtype, a.device) + ((a.data_ptr(),) if i in self.in_place else ()))
            if isinstance(a, torch.Tensor) else a
            for i, a in ((i, args[i]) for i in self.varying)
        )

    def _capturable(self, args: Sequence) -> bool:
        """The step's rows fit a bucket (the inputs used in place, caches among them, are not rows)."""
        return all(
            not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] <= self.max_rows
            for a in (args[i] for i in self.varying if i not in self.in_place)
        )

    def kernels_per_step(self) -> dict[tuple, int]:
        """Kernels each captured graph replays, counted by one more replay under the profiler (the
        accumulated inputs saved before it and restored after it: module docstring)."""
        for c in self.graphs.values():
            if c.kernels is None:
                saved = [(c.inputs[i], c.inputs[i].clone()) for i in self.accumulated]
                c.kernels = len(device_kernels(c.graph.replay, ()))
                for tensor, value in saved:
                    tensor.copy_(value)
        return {sig: c.kernels for sig, c in self.graphs.items()}

    def _capture(self, args: list) -> _Captured:
        """Capture ``fn`` on ``args`` (it has run on this signature before). A capture runs nothing:
        the replay that follows runs the step."""
        copied = [i for i in self.varying if isinstance(args[i], torch.Tensor) and i not in self.in_place]
        inputs = list(args)
        for i in copied:
            inputs[i] = args[i].clone()
        torch.cuda.synchronize()  # the capture stream must not overtake the first call's work
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
            if sig not in self.seen:  # the first call of this shape: run it as it is
                self.seen.add(sig)
                self.uncaptured_calls += 1
                return self.fn(*args)
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
