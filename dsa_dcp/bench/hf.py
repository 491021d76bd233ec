"""``dsa-dcp bench hf``: a transformers DSA model's decode token, ``dsa_dcp`` against what its
users run (GPU).

The model is transformers' own ``GlmMoeDsaForCausalLM`` with GLM-5's attention (hidden 6144, 64
heads, q_lora 2048, Dc 512, Dr 64, nope 192, v 256, an indexer of 32 x 128 per layer, top-k 2048)
and ``--layers`` layers; the MLP is dense and shrunk (``--intermediate``) and the vocabulary too
(``--vocab``): DCP changes neither. bf16, random weights.

Each shape is ``batch`` requests with ``prompt`` positions already cached: the caches are filled
with random values and their position counters set to ``prompt`` (a prefill of that length would
only put other numbers there; it is not what is measured). Then every variant decodes the same
``--steps`` greedy tokens from the same first token, its caches rewound to ``prompt`` first, in one
process:

- ``eager``: the model as written, on transformers' ``StaticCache``;
- ``transformers compiled``: ``model.get_compiled_call()``, the ``torch.compile(mode=
  "reduce-overhead")`` that ``generate`` wraps a static-cache decode in, on the same cache;
- ``dsa_dcp``: ``torch.compile(model, backend="dsa_dcp", options={"dcp_size": 1})`` (Inductor,
  CUDA graphs) on a ``DCPStaticCache`` holding the same positions: the attention reads the top-k
  positions only.

A token's time is the median over the decode steps after ``--warmup`` untimed ones (compilation,
CUDA-graph capture), each step between CUDA events. Tokens are compared with eager's; bf16
rounding differs between eager and compiled code, so a greedy token may flip where the top two
logits are within that rounding (the first step's largest logit difference is recorded).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch


@dataclasses.dataclass(frozen=True)
class HFBenchSpec:
    shapes: tuple[tuple[int, int], ...] = ((1, 4096), (8, 4096), (32, 4096), (1, 16384), (8, 16384))
    layers: int = 4
    intermediate: int = 2048
    vocab: int = 32768
    steps: int = 12
    warmup: int = 3
    profile: int = 0  # > 0: print each variant's top kernels by device time over the timed steps


def glm5_config(layers: int, intermediate: int, vocab: int, max_positions: int):
    """transformers' ``GlmMoeDsaConfig`` with GLM-5's attention and a dense, shrunk MLP."""
    import transformers

    return transformers.GlmMoeDsaConfig(
        vocab_size=vocab, hidden_size=6144, intermediate_size=intermediate, num_hidden_layers=layers,
        first_k_dense_replace=layers, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_topk=2048,
        index_head_dim=128, index_n_heads=32, indexer_types=["full"] * layers,
        max_position_embeddings=max_positions, pad_token_id=0)


def _static_cache_over(dcp_cache, config, length: int):
    """transformers' own ``StaticCache`` over the memory of a ``DCPStaticCache(dcp_size=1)`` (the same
    positions, plain tensors), with its own position counters."""
    import transformers

    from dsa_dcp.integrations.transformers import initialize_layers

    cache = transformers.StaticCache(config, max_cache_len=length)
    batch = dcp_cache.layers[0].keys.shape[0]
    dtype, device = dcp_cache.layers[0].keys.dtype, dcp_cache.layers[0].keys.device
    initialize_layers(cache, config, batch, dtype, device)  # then pointed at the shared memory
    for mine, theirs in zip(cache.layers, dcp_cache.layers):
        mine.keys, mine.values = theirs.keys.local, theirs.values.local
        if getattr(theirs, "indexer_keys", None) is not None:
            mine.indexer_keys = theirs.indexer_keys
    return cache


def _rewind(cache, length: int) -> None:
    """Every layer's position counters back to ``length`` (later positions are masked, then rewritten)."""
    for layer in cache.layers:
        for name in ("cumulative_length", "indexer_cumulative_length"):
            counter = getattr(layer, name, None)
            if isinstance(counter, torch.Tensor):
                counter.fill_(length)


def _decode(call, cache, first: torch.Tensor, start: int, steps: int) -> tuple[list[float], list, torch.Tensor]:
    """``steps`` greedy tokens from ``first`` at position ``start``: (ms per step, tokens, first logits)."""
    _rewind(cache, start)
    batch = first.shape[0]
    token, tokens, events, first_logits = first, [], [], None
    for s in range(steps):
        pos = start + s
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        logits = call(input_ids=token, past_key_values=cache, use_cache=True,
                      position_ids=torch.full((batch, 1), pos, device=first.device),
                      cache_position=torch.tensor([pos], device=first.device)).logits[:, -1]
        end.record()
        events.append((begin, end))
        if first_logits is None:
            first_logits = logits.float().clone()
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
    torch.cuda.synchronize()
    return [b.elapsed_time(e) for b, e in events], torch.cat(tokens, 1).tolist(), first_logits


def _kernel_table(call, cache, first: torch.Tensor, start: int, steps: int, rows: int) -> str:
    """The ``rows`` kernels with the most device time over ``steps`` decode steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _decode(call, cache, first, start, steps)
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)


def run_hf_bench(spec: HFBenchSpec):
    """Yields one row per (batch, prompt) shape."""
    import transformers

    from dsa_dcp.integrations.transformers import DCPStaticCache
    from dsa_dcp.report import last_report

    device, dtype = torch.device("cuda"), torch.bfloat16
    longest = max(p for _, p in spec.shapes) + spec.steps + spec.warmup
    config = glm5_config(spec.layers, spec.intermediate, spec.vocab, longest)
    config._attn_implementation = "eager"  # decode reads one query row: eager attention fits
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config).to(device, dtype).eval()
    for batch, prompt in spec.shapes:
        torch._dynamo.reset()
        length = prompt + spec.warmup + spec.steps
        dcp_cache = DCPStaticCache(config, max_cache_len=length, batch_size=batch, dcp_size=1, dtype=dtype,
                                   device=device)
        gen = torch.Generator(device=device).manual_seed(batch * 131 + prompt)
        with torch.no_grad():
            for layer in dcp_cache.layers:
                for t in (layer.keys.local, layer.values.local):
                    t.normal_(generator=gen)
                if getattr(layer, "indexer_keys", None) is not None:
                    layer.indexer_keys.normal_(generator=gen)
        static = _static_cache_over(dcp_cache, config, length)
        first = torch.randint(1, spec.vocab, (batch, 1), generator=gen, device=device)
        row = {"batch": batch, "prompt": prompt, "layers": spec.layers, "steps": spec.steps,
               "transformers": transformers.__version__}
        variants = {
            "eager": (model, static),
            "transformers_compiled": (model.get_compiled_call(None), static),
            "dsa_dcp": (torch.compile(model, backend="dsa_dcp", options={"dcp_size": 1}, fullgraph=True), dcp_cache),
        }
        reference = None
        with torch.no_grad():
            for name, (call, cache) in variants.items():
                if spec.warmup:
                    _decode(call, cache, first, prompt, spec.warmup)
                times, tokens, logits = _decode(call, cache, first, prompt, spec.steps)
                if spec.profile:
                    import sys

                    print(f"== {name}, batch {batch}, prompt {prompt}: kernels over {spec.steps} decode steps",
                          file=sys.stderr)
                    print(_kernel_table(call, cache, first, prompt, spec.steps, spec.profile), file=sys.stderr)
                row[f"{name}_ms"] = statistics.median(times)
                if reference is None:
                    reference = (tokens, logits)
                row[f"{name}_tokens_equal"] = sum(a == b for ra, rb in zip(tokens, reference[0]) for a, b in zip(ra, rb))
                row[f"{name}_first_logit_diff"] = (logits - reference[1]).abs().max().item()
                if name == "dsa_dcp":
                    stats = last_report().stats().get("recognize_sparse_attention", {})
                    row["dsa_dcp_attention_recognized"] = stats.get("attention_recognized", 0)
                    row["dsa_dcp_graphs"] = len(getattr(last_report().lowered, "graphs", {}))
        row["tokens"] = batch * spec.steps
        row["dsa_dcp_over_transformers_compiled"] = row["dsa_dcp_ms"] / row["transformers_compiled_ms"]
        del variants, static, dcp_cache
        torch.cuda.empty_cache()
        yield row


def format_hf_table(rows: list[dict]) -> str:
    lines = ["| batch | prompt | eager ms | transformers compiled ms | dsa_dcp ms | dsa_dcp / compiled | "
             "tokens equal to eager (compiled / dsa_dcp) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['eager_ms']:.2f} | {r['transformers_compiled_ms']:.2f} | "
                     f"{r['dsa_dcp_ms']:.2f} | {r['dsa_dcp_over_transformers_compiled']:.2f}x | "
                     f"{r['transformers_compiled_tokens_equal']} / {r['dsa_dcp_tokens_equal']} of {r['tokens']} |")
    return "\n".join(lines)


def main(args) -> int:
    shapes = tuple((b, p) for b, p in (s.split("x") for s in args.shapes)) if args.shapes else HFBenchSpec.shapes
    spec = HFBenchSpec(shapes=tuple((int(b), int(p)) for b, p in shapes), layers=args.layers, steps=args.steps,
                       profile=args.profile)
    from dsa_dcp.bench.measure import print_rows

    print_rows(run_hf_bench(spec), args.json, format_hf_table)
    return 0
