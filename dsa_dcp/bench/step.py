"""``dsa-dcp bench step``: decode-step latency, eager vs compiled vs compiled + CUDA graphs.

The model has the real GLM-5 attention dimensions (64 heads, q_lora 2048, Dc 512, Dr 64,
nope 192, v 256, indexer 32 x 128, top-k 2048) and a configurable number of layers; the MLP and
the vocabulary are shrunk (``--intermediate``, ``--vocab``) because they are not what DCP
changes. Every row is one decoding request with ``--context`` tokens already cached (the caches
are filled with random values rather than prefilled). ``dcp_size = 1`` on one GPU.

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm) in microseconds; kernels per
step are counted with the profiler over one eager step and, for the graph, over the captured
step.
"""

from __future__ import annotations

import dataclasses
import json

import torch


@dataclasses.dataclass(frozen=True)
class StepBenchSpec:
    layers: int = 8
    batches: tuple[int, ...] = (1, 8, 32, 64)
    context: int = 4096
    intermediate: int = 2048
    vocab: int = 32768
    dtype: str = "bfloat16"
    warmup_ms: int = 100
    rep_ms: int = 500


def run_step_bench(spec: StepBenchSpec) -> list[dict]:
    import triton

    from dsa_dcp.backend import last_report
    from dsa_dcp.lowering.cuda_graphs import count_kernels
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.runner import decode_step_inputs

    device = torch.device("cuda")
    dtype = getattr(torch, spec.dtype)
    cfg = get_config("glm5", n_layers=spec.layers, intermediate_size=spec.intermediate, vocab_size=spec.vocab)
    rows = []
    for batch in spec.batches:
        inputs, num_slots = decode_step_inputs(cfg, batch, spec.context, device)
        torch.manual_seed(0)
        model = DSAModel(cfg, num_slots, dtype=dtype, device=device, seed=0)
        with torch.no_grad():
            for cache in model.kv_caches() + list(model.index_caches().values()):
                cache.normal_()
        row = {"batch": batch, "layers": spec.layers, "context": spec.context}
        with torch.no_grad():
            variants = {
                "eager": model,
                "compiled": torch.compile(model, backend="dsa_dcp", options={"cuda_graphs": False},
                                          fullgraph=True, dynamic=False),
                "graph": torch.compile(model, backend="dsa_dcp", options={"batch_sizes": [batch]},
                                       fullgraph=True, dynamic=False),
            }
            reference = model(*inputs)
            for name, fn in variants.items():
                out = fn(*inputs)
                torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
                row[f"{name}_us"] = 1e3 * triton.testing.do_bench(lambda: fn(*inputs), warmup=spec.warmup_ms,
                                                                  rep=spec.rep_ms, return_mode="median")
                if name == "graph":
                    row["graph_kernels"] = next(iter(last_report().kernels_per_step().values()))
            row["eager_kernels"] = count_kernels(model, inputs)
        row["eager_over_graph"] = row["eager_us"] / row["graph_us"]
        rows.append(row)
        del variants, model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def format_step_table(rows: list[dict]) -> str:
    lines = [
        "| batch | layers | eager us | compiled us | compiled + CUDA graph us | eager / graph | kernels per step (eager) | kernels per step (graph) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['layers']} | {r['eager_us']:.1f} | {r['compiled_us']:.1f} | {r['graph_us']:.1f} | "
            f"{r['eager_over_graph']:.1f}x | {r['eager_kernels']} | {r['graph_kernels']} |"
        )
    return "\n".join(lines)


def main(args) -> int:
    spec = StepBenchSpec(layers=args.layers, batches=tuple(args.batches), context=args.context)
    rows = run_step_bench(spec)
    print(format_step_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
