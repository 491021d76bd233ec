"""``dsa-dcp bench step``: one decode step, ``dsa_dcp`` against what a user would otherwise run.

The model has the real GLM-5 attention dimensions (64 heads, q_lora 2048, Dc 512, Dr 64,
nope 192, v 256, indexer 32 x 128, top-k 2048) and a configurable number of layers; the MLP and
the vocabulary are shrunk (``--intermediate``, ``--vocab``) because they are not what DCP
changes. Every row is one decoding request with ``--context`` tokens already cached (the caches
are filled with random values rather than prefilled). ``dcp_size = 1`` on one GPU. ``--kv-dtype fp8``
stores the KV in E4M3 with a per-tensor scale and the index keys in E4M3 with a per-token scale
(``DSAConfig.kv_dtype`` / ``index_key_dtype``, docs/models.md); the weights stay bf16.

Columns, all in one process on the same model and inputs, CUDA graphs where named:

- ``eager``: the model as written;
- ``stock``: ``torch.compile(model, mode="reduce-overhead")`` — stock Inductor with its CUDA graph
  trees, what a user runs without this project;
- ``dsa_dcp``: ``torch.compile(model, backend="dsa_dcp")`` with its defaults (Inductor, CUDA graphs);
- ``dsa_dcp fx``: the same with ``lowering="fx"`` (the rewritten graph as Python, in CUDA graphs);
- the HBM floor: what the step must read once, at this GPU's measured copy bandwidth: the weights
  it uses (of the embedding only the batch's rows; not the MTP draft's layer), the top-k KV rows
  of every layer and the index keys of every indexer layer.

``--mtp K`` adds a speculative decoding round with the MTP draft (draft length K) to each row: its
step times and the time per accepted token at every accept length, against the plain step
(``bench/speculative.py``).

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm) in microseconds. Kernels per
step are counted with the profiler over one step run eagerly (what its graph replays), and the
``dsa_dcp`` step's device time is split by kind of kernel (``bench/kinds.py``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StepBenchSpec:
    layers: int = 4
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 4096
    intermediate: int = 2048
    vocab: int = 32768
    dtype: str = "bfloat16"
    kv_dtype: str = "bf16"  # or "fp8"
    mtp: int | None = None  # draft length of the speculative round (None: not measured)
    top_kernels: int = 0  # kernels listed by device time (0: none)
    warmup_ms: int = 100
    rep_ms: int = 500


def hbm_floor_bytes(model: torch.nn.Module, cfg, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step must read at least, by what reads them: ``weights`` (every weight the
    step multiplies by, and the embedding's rows of the batch's tokens: a lookup, not the table),
    ``kv`` (the top-k KV rows of every layer) and ``keys`` (the index keys of every indexer layer).
    The MTP draft's own weights are not read by the step (``--mtp`` rounds are timed per token,
    not against this floor)."""
    unread = {id(model.embed)} | ({id(p) for p in model.mtp.parameters()} if model.mtp is not None else set())
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in unread)
    embedded = batch * model.embed.shape[1] * model.embed.element_size()
    kv_elem = model.kv_caches()[0].element_size()
    key_bytes = cfg.index_head_dim * next(iter(model.index_caches().values())).element_size() + \
        (4 if cfg.index_key_dtype == "fp8" else 0)
    return {"weights": weights + embedded,
            "kv": batch * cfg.n_layers * min(cfg.index_topk, context + 1) * cfg.kv_dim * kv_elem,
            "keys": batch * len(cfg.indexer_layers) * (context + 1) * key_bytes}


# Which floor the step's kernels answer to, by kind (bench/kinds.py): the dense products and the
# rest Inductor emits (``other``) read the weights, the indexer the index keys, the attention and
# the merge of its splits (``combine``) the KV rows. DCP's collectives and remap read none of
# these bytes, nor does the time between kernels.
FLOOR_PARTS = (("dense and the rest", ("other",), "weights"), ("indexer", ("indexer",), "keys"),
               ("attention", ("attention", "combine"), "kv"),
               ("DCP's collectives and remap", ("nccl", "fused_merge", "remap"), None))


def floor_split(row: dict) -> list[tuple[str, float, float | None]]:
    """``(part, us, its floor us or None)`` of a measured ``bench step`` row: the device time of
    each part of the ``dsa_dcp`` step (``FLOOR_PARTS``) beside the bytes it must read; where kernels
    ran side by side (``dsa_dcp_overlap_us``), that time, counted in two parts, taken off once; then
    the step's time when no kernel ran. The parts sum to the step's time."""
    floors = row["hbm_floor_parts_us"]
    parts = [(name, sum(row.get(f"dsa_dcp_{kind}_us", 0.0) for kind in kinds), floors[part] if part else None)
             for name, kinds, part in FLOOR_PARTS]
    overlap = row.get("dsa_dcp_overlap_us", 0.0)
    side_by_side = [("kernels side by side (counted twice above)", -overlap, None)] if overlap > 0 else []
    return parts + side_by_side + [("between kernels", row["dsa_dcp_us"] - row["dsa_dcp_kernels_us"] + overlap, None)]


def run_step_bench(spec: StepBenchSpec):
    """Yields one row per batch size (so a run cut short keeps the rows it measured)."""
    import triton

    from dsa_dcp.bench.kinds import kernel_us_by_kind, overlap_us, top_kernels
    from dsa_dcp.bench.measure import device_limits
    from dsa_dcp.lowering.cuda_graphs import count_kernels, device_kernels
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.runner import decode_step_inputs
    from dsa_dcp.report import last_report

    device = torch.device("cuda")
    dtype = getattr(torch, spec.dtype)
    fp8 = {"kv_dtype": "fp8", "index_key_dtype": "fp8"} if spec.kv_dtype == "fp8" else {}
    cfg = get_config("glm5", n_layers=spec.layers, intermediate_size=spec.intermediate, vocab_size=spec.vocab, **fp8)
    if spec.mtp is not None:
        cfg = get_config("glm5", n_layers=spec.layers, intermediate_size=spec.intermediate, vocab_size=spec.vocab,
                         mtp_layers=1, **fp8)
    copy_GBps = device_limits()["copy_GBps"]  # this GPU's, so the floor holds on any card
    for batch in spec.batches:
        inputs, num_slots = decode_step_inputs(cfg, batch, spec.context, device)
        torch.manual_seed(0)
        model = DSAModel(cfg, num_slots, dtype=dtype, device=device, seed=0)
        with torch.no_grad():
            for cache in model.kv_caches() + list(model.index_caches().values()):
                cache.copy_(torch.randn(cache.shape, device=device).to(cache.dtype))  # normal_ has no FP8 form
            for layer in model.layers:
                if layer.attn.indexer is not None and layer.attn.indexer.key_scale.numel():
                    layer.attn.indexer.key_scale.fill_(1.0)
        row = {"batch": batch, "layers": spec.layers, "context": spec.context, "kv_dtype": spec.kv_dtype,
               "device": torch.cuda.get_device_name(device), "copy_GBps": copy_GBps,
               # bytes at the copy bandwidth (bytes read + written, as device_limits measures it)
               "hbm_floor_parts_us": {part: b / (copy_GBps * 1e3) for part, b in
                                      hbm_floor_bytes(model, cfg, batch, spec.context).items()}}
        row["hbm_floor_us"] = sum(row["hbm_floor_parts_us"].values())

        def timed(fn):
            return 1e3 * triton.testing.do_bench(lambda: fn(*inputs), warmup=spec.warmup_ms, rep=spec.rep_ms,
                                                 return_mode="median")

        with torch.no_grad():
            reference = model(*inputs)
            variants = {
                "eager": model,
                "stock": torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False),
                "dsa_dcp": torch.compile(model, backend="dsa_dcp", options={"batch_sizes": [batch]},
                                         fullgraph=True, dynamic=False),
            }
            for name, fn in variants.items():
                out = fn(*inputs)
                # bf16 logits: compiled code rounds differently from eager, and the indexer kernels'
                # scores may pick other slots among near-equal ones; recorded, not asserted
                row[f"{name}_max_logit_diff"] = (out.float() - reference.float()).abs().max().item()
                row[f"{name}_us"] = timed(fn)
                if name == "dsa_dcp":
                    lowered = last_report().lowered
                    row["dsa_dcp_kernels"] = next(iter(last_report().kernels_per_step().values()))
                    (captured,) = lowered.graphs.values()
                    timed_kernels = device_kernels(captured.graph.replay, (), runs=3, starts=True)
                    if not timed_kernels:  # no kernel records inside graph replays: the same step, eagerly
                        timed_kernels = device_kernels(lowered.fn, captured.inputs, runs=3, starts=True)
                    kernels = [(name, us) for name, us, _ in timed_kernels]
                    row["dsa_dcp_overlap_us"] = overlap_us(timed_kernels, runs=3)
                    row |= {f"dsa_dcp_{k}": v for k, v in kernel_us_by_kind(kernels, runs=3).items()}
                    if spec.top_kernels:
                        row["dsa_dcp_top_kernels"] = top_kernels(kernels, runs=3, n=spec.top_kernels)
            torch._dynamo.reset()
            stock_plain = torch.compile(model, fullgraph=True, dynamic=False)  # its kernels, without graph trees
            stock_plain(*inputs)
            row["stock_kernels"] = count_kernels(stock_plain, inputs)
            row["eager_kernels"] = count_kernels(model, inputs)
            fx = torch.compile(model, backend="dsa_dcp", options={"batch_sizes": [batch], "lowering": "fx"},
                               fullgraph=True, dynamic=False)
            row["dsa_dcp_fx_max_logit_diff"] = (fx(*inputs).float() - reference.float()).abs().max().item()
            row["dsa_dcp_fx_us"] = timed(fx)
        row["dsa_dcp_over_stock"] = row["dsa_dcp_us"] / row["stock_us"]
        del variants, model, stock_plain, fx
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        if spec.mtp is not None:
            row |= _speculative_row(spec, cfg, batch, device, dtype, timed_us)
        yield row


def timed_us(fn, spec: StepBenchSpec) -> float:
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=spec.warmup_ms, rep=spec.rep_ms, return_mode="median")


def _speculative_row(spec: StepBenchSpec, cfg, batch: int, device, dtype, timer) -> dict:
    """``bench/speculative.py``'s round on a model whose caches (target and draft) hold random values."""
    from dsa_dcp.bench.speculative import speculative_inputs, speculative_round_us
    from dsa_dcp.models import DSAModel

    _, num_slots = speculative_inputs(cfg, batch, spec.context, spec.mtp, device)
    model = DSAModel(cfg, num_slots, dtype=dtype, device=device, seed=0)
    with torch.no_grad():
        for attn in model.attention_layers():
            caches = [attn.kv_cache] + ([attn.indexer.index_cache] if attn.indexer is not None else [])
            for cache in caches:
                cache.copy_(torch.randn(cache.shape, device=device).to(cache.dtype))
            if attn.indexer is not None and attn.indexer.key_scale.numel():
                attn.indexer.key_scale.fill_(1.0)
    row = speculative_round_us(model, cfg, batch, spec.context, spec.mtp, lambda fn: timer(fn, spec))
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def format_step_table(rows: list[dict]) -> str:
    lines = [
        "| batch | layers | context | KV | eager us | stock reduce-overhead us | dsa_dcp us | dsa_dcp / stock | "
        "dsa_dcp fx us | HBM floor us | dsa_dcp / floor | kernels (stock / dsa_dcp) | "
        "dsa_dcp device us: attention / indexer / other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['layers']} | {r['context']} | {r.get('kv_dtype', 'bf16')} | {r['eager_us']:,.0f} | {r['stock_us']:,.0f} | "
            f"{r['dsa_dcp_us']:,.0f} | {r['dsa_dcp_over_stock']:.2f}x | {r['dsa_dcp_fx_us']:,.0f} | "
            f"{r['hbm_floor_us']:,.0f} | {r['dsa_dcp_us'] / r['hbm_floor_us']:.2f}x | "
            f"{r['stock_kernels']} / {r['dsa_dcp_kernels']} | "
            f"{r.get('dsa_dcp_attention_us', 0):,.0f} / {r.get('dsa_dcp_indexer_us', 0):,.0f} / "
            f"{r.get('dsa_dcp_other_us', 0):,.0f} |"
        )
    if rows and "device" in rows[0]:
        lines += ["", f"{rows[0]['device']}; HBM floor at its copy bandwidth, {rows[0]['copy_GBps']:,.0f} GB/s "
                      "(bytes read + written)"]
    split = [r for r in rows if "hbm_floor_parts_us" in r and "dsa_dcp_kernels_us" in r]
    if split:
        lines += ["", "dsa_dcp step against its floor, by the bytes each part reads (dense and the rest: the "
                      "weights; indexer: the index keys; attention: the KV rows):", "",
                  "| batch | part | us | its floor us | over its floor |", "|---|---|---|---|---|"]
        for r in split:
            lines += [f"| {r['batch']} | {part} | {us:,.0f} | " + (f"{floor:,.0f} | {us / floor:.2f}x |" if floor else "- | - |")
                      for part, us, floor in floor_split(r)]
    for r in rows:
        if r.get("dsa_dcp_top_kernels"):
            lines += ["", f"dsa_dcp kernels with the most device time, batch {r['batch']} (us a step, launches a step):"]
            lines += [f"  {us:8.1f} {count:5.1f}  {name[:110]}" for name, us, count in r["dsa_dcp_top_kernels"]]
    if rows and "mtp_k" in rows[0]:
        from dsa_dcp.bench.speculative import format_speculative_table

        lines += ["", "speculative round with the MTP draft (docs/benchmarks.md, \"Speculative decoding\")",
                  format_speculative_table(rows)]
    return "\n".join(lines)


def main(args) -> int:
    spec = StepBenchSpec(layers=args.layers, batches=tuple(args.batches), context=args.context,
                         kv_dtype=getattr(args, "kv_dtype", "bf16"), mtp=getattr(args, "mtp", None),
                         top_kernels=getattr(args, "top_kernels", 0))
    from dsa_dcp.bench.measure import print_rows

    print_rows(run_step_bench(spec), args.json, format_step_table)
    return 0
