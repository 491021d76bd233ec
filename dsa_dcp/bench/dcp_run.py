"""The DCP program on several GPUs (or CPU ranks): correctness, then speed, in one run.

Under ``torchrun --nproc-per-node N -m dsa_dcp.bench.dcp_run`` (NCCL, one GPU per rank) every
rank:

1. **correctness** — for each merge mode, GLM-5.2-shaped models (real attention dimensions with a
   few layers, and all 78 layers with tiny widths) generate greedily over a batch of requests of
   different lengths, once single-rank (eager, global KV cache, on this rank's GPU) and once as
   the DCP program; tokens must be identical and logits close; each rank's KV cache must hold
   ``ceil(S/N)`` rows;
2. **step latency** — a decode step with CUDA graphs at each batch size, for each merge mode with
   each index cache (``replicated``: every rank scores every candidate; ``sharded``: each rank
   scores its own and the group agrees on the top-k), and for DCP size 1 (this GPU alone), and
   its device time by kind of kernel (from graph replays under the profiler, every rank's replay
   started together);
3. **merge per layer** — ``fused_a2a_merge`` (one kernel, symmetric memory) against pack +
   all_to_all + combine over NCCL, replayed from CUDA graphs;
4. **transformers** — transformers' ``GlmMoeDsaForCausalLM`` and ``DeepseekV32ForCausalLM``,
   unmodified (tiny random weights), compiled in place and run by ``model.generate`` on a
   ``DCPStaticCache``, against the same model compiled for this rank's device alone (``dcp_size=1``,
   the single-rank program DCP must equal; bf16 and fp32 on a GPU).
5. **mtp** (``--mtp K``) — greedy speculative decoding with the MTP draft (draft length K,
   ``dsa_dcp.models.speculative``): GLM-5.2-shaped models with an MTP layer, the draft compiled with
   ``replicated_modules=["mtp"]`` (its caches whole on every rank) and the target split, against the
   same model run single-device; drafted tokens, accepted counts, tokens and accept length must be
   the single-device run's, each rank's draft cache the same bytes as rank 0's.

``--kv-dtype fp8`` gives the GLM-5.2-shaped models of the correctness, step latency and mtp parts
FP8 E4M3 KV caches (per-tensor scale, written by ``kv_store``) and FP8 index keys with an fp32 scale
a token (``DSAConfig.kv_dtype`` and ``index_key_dtype``, docs/models.md); the single-device
reference is the same FP8 model, so DCP must still give its tokens. Rows gain a ``kv_dtype`` column.

The topology: ``--tp T --dcp N`` runs the correctness and step latency parts on ``DSAModel``s that
are tensor-parallel over TP groups of ``T`` ranks, compiled with DCP over groups of ``N`` ranks
inside them (``dsa_dcp.topology.tp_dcp_groups``; ``--dcp`` defaults to ``T``), with
``--replicate-q`` (default) or ``--no-replicate-q``; the step latency part's ``dcp1`` rows are then
TP alone, so one run compares TP ``T`` + DCP ``N`` with TP ``T``. Correctness compares against the
unsharded single-device model. The merge, transformers and mtp parts run without TP only.

Rank 0 prints each row as it is measured (and timestamped progress on stderr), rewrites the JSON
(``--json``) after every row, and prints the tables at the end. ``--parts`` picks parts (on two
H200s correctness took about 5 minutes and step latency about 20 s per compiled step, so a
device call with a 10-minute limit takes one part). ``--device cpu`` runs parts 1 and 4 on gloo
CPU ranks with tiny models (how the script itself is tested in CI). ``--device cuda --backend gloo``
runs parts 1 and 4 on ranks that may share one GPU (NCCL refuses two ranks on one device): every
kernel runs on the GPU, the collectives go through the host, and the steps run without CUDA graphs
(a graph cannot capture gloo's collectives) and with ``a2a`` only (the others need symmetric memory
or an all-gather, which gloo cannot do on CUDA tensors): it checks the numbers, not the speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class RunSpec:
    device: str = "cuda"
    merges: tuple[str, ...] = ("ag", "a2a", "ag_rs", "fused_a2a")
    layers: int = 4  # real-dimension model
    batches: tuple[int, ...] = (1, 8, 32)
    steps: int = 8
    context: int = 4096
    tiny_only: bool = False
    lowering: str | None = None  # None: the backend's default (Inductor)
    index_caches: tuple[str, ...] = ("replicated", "sharded")  # step latency: DCP rows for each
    cuda_graphs: bool | None = None  # transformers part: None, the backend's default (graphs on CUDA)
    tiny_layers: int | None = None  # the tiny models' layers (None: all 78 of glm5.2-tiny, 4 of transformers')
    # the topology (correctness and step latency): TP groups of ``tp`` ranks, DCP groups of ``dcp``
    # ranks inside them (``dsa_dcp.topology``); tp 1 and dcp None: one DCP group over the world
    tp: int = 1
    dcp: int | None = None
    replicate_q: bool = True
    mtp: int | None = None  # draft length of the mtp part (None: the part does not run)
    # the DSAModel parts' KV and index-key storage: None keeps the model's dtype; "fp8" stores the KV
    # cache in E4M3 (per-tensor scale) and the index keys in E4M3 with a scale a token
    kv_dtype: str | None = None

    def fp8(self) -> dict:
        """``get_config`` keywords for ``kv_dtype``."""
        return {"kv_dtype": "fp8", "index_key_dtype": "fp8"} if self.kv_dtype == "fp8" else {}

    def dtype_columns(self, model) -> dict:
        """With ``kv_dtype``: it and the dtypes ``model``'s KV and index caches hold."""
        if not self.kv_dtype:
            return {}
        index = next(iter(model.index_caches().values()))
        return {"kv_dtype": self.kv_dtype, "kv_cache_dtype": str(model.kv_caches()[0].dtype).removeprefix("torch."),
                "index_cache_dtype": str(index.dtype).removeprefix("torch.")}

    def dcp_size(self, world: int) -> int:
        return self.dcp if self.dcp is not None else (world if self.tp == 1 else self.tp)


def topology_problem(world: int, tp: int, dcp: int | None) -> str | None:
    """Why ``--tp``/``--dcp`` cannot tile a world of ``world`` ranks (``None`` when they can)."""
    n = dcp if dcp is not None else (world if tp == 1 else tp)
    if tp < 1 or n < 1:
        return f"--tp and --dcp must be >= 1, got {tp} and {n}"
    if world % tp:
        return f"--tp {tp} does not divide the world of {world} rank(s)"
    if tp == 1 and n != world:
        return f"without TP the DCP group is the world: --dcp {n} in a world of {world}"
    if tp > 1 and tp % n:
        return f"--dcp {n} does not divide --tp {tp}: DCP groups split a TP group evenly"
    return None


def _groups(spec: RunSpec, world: int):
    """This rank's TP group (``None`` without TP) and DCP group (``None``: the world)."""
    if spec.tp == 1:
        return None, None
    from dsa_dcp.topology import tp_dcp_groups

    groups = tp_dcp_groups(spec.tp, spec.dcp_size(world))
    return groups.tp, groups.dcp


def _tp_args(spec: RunSpec, tp_group) -> dict:
    return {"tp_size": spec.tp, "tp_group": tp_group} if spec.tp > 1 else {}


def _dcp_options(spec: RunSpec, dcp_group) -> dict:
    return {"group": dcp_group, "replicate_q": spec.replicate_q} if spec.tp > 1 else {}


_T0 = time.monotonic()


def _progress(msg: str) -> None:
    """A timestamped line on rank 0's stderr, so a slow or stuck run shows where it is."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.monotonic() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


_CALLS_PER_GROUP = 20


def _median_call_us(fn, groups: int = 7, calls_per_group: int = _CALLS_PER_GROUP, warmup: int = 10) -> float:
    """Median over ``groups`` of the time per call of ``calls_per_group`` back-to-back calls (us).

    Every rank makes exactly the same number of calls: a step holds collectives, so a timer that
    picks its repetition count from a first measurement (as ``do_bench`` does) could leave one rank
    waiting for a collective the other never enters.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(groups):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_group):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_group)
    return statistics.median(times)


def check_correctness(rank: int, world: int, spec: RunSpec) -> Iterator[dict]:
    from dsa_dcp.kernels import fused_merge
    from dsa_dcp.merge import MERGES
    from dsa_dcp.models import DSAModel, generate, get_config, make_requests, standard_test_batch
    from dsa_dcp.slots import local_cache_rows

    tiny = get_config("glm5.2-tiny", **({"n_layers": spec.tiny_layers} if spec.tiny_layers else {}), **spec.fp8())
    configs = [("glm5.2-tiny", tiny)]
    if not spec.tiny_only:
        configs.insert(0, ("glm5.2 (real attention dims)", get_config(
            "glm5.2", n_layers=spec.layers, intermediate_size=2048, vocab_size=32768, page_size=64, **spec.fp8())))
    tp_group, dcp_group = _groups(spec, world)
    n = spec.dcp_size(world)
    for label, cfg in configs:
        if cfg.index_topk > 64:  # real top-k 2048: two requests shorter than it, two longer
            batch = make_requests(cfg, [3, 100, 2100, 2500], max_new_tokens=spec.steps, start_steps=[0, 0, 1, 2],
                                  prefill_chunk=512, seed=3)
            pad = 1024
        else:
            batch = standard_test_batch(cfg, max_new_tokens=spec.steps, seed=3)
            pad = 16
        with torch.no_grad():
            _progress(f"{label}: single-device reference")
            single = DSAModel(cfg, batch.num_slots, device=spec.device, seed=5)
            ref = generate(single, batch, spec.steps, pad_to=pad, device=spec.device)
            del single
            for merge in spec.merges:
                if (cfg.n_heads // spec.tp) % n and MERGES[merge].head_sharded and spec.tp == 1:
                    continue
                _progress(f"{label}: {merge} over {n} ranks" + (f" inside TP {spec.tp}" if spec.tp > 1 else ""))
                torch._dynamo.reset()
                # a TP model drawn from the seed holds its shard of the unsharded model of that seed
                model = DSAModel(cfg, batch.num_slots, dcp_size=n, device=spec.device, seed=5,
                                 **_tp_args(spec, tp_group))
                step = torch.compile(model, backend="dsa_dcp", fullgraph=True, dynamic=False,
                                     options={"dcp_size": n, "merge": merge, "cuda_graphs": False,
                                              **_dcp_options(spec, dcp_group),
                                              **({"lowering": spec.lowering} if spec.lowering else {})})
                out = generate(step, batch, spec.steps, pad_to=pad, device=spec.device)
                row = {
                    "model": label, "merge": merge, "N": n, **_topology_columns(spec), **spec.dtype_columns(model),
                    "tokens_match": out.tokens == ref.tokens,
                    "max_rel_logit_err": max(_relative_error(a, b) for a, b in zip(out.step_logits, ref.step_logits)),
                    "kv_rows_per_rank": model.kv_caches()[0].shape[0],
                    "kv_rows_expected": local_cache_rows(batch.num_slots, n),
                }
                if merge == "fused_a2a" and torch.device(spec.device).type == "cuda":
                    row["fused_kernel"] = fused_merge.has_workspace(dist.group.WORLD.group_name)
                yield row
                del model, step


def check_speculative(rank: int, world: int, spec: RunSpec) -> Iterator[dict]:
    """Greedy speculative decoding with the MTP draft (draft length ``spec.mtp``) under DCP against the
    same model single-device: the target split, the draft whole on every rank (``replicated_modules``)."""
    from dsa_dcp.merge import MERGES
    from dsa_dcp.models import DSAModel, get_config, make_requests
    from dsa_dcp.models.speculative import generate_speculative
    from dsa_dcp.slots import local_cache_rows

    k = spec.mtp
    configs = [("glm5.2-tiny + MTP", get_config("glm5.2-tiny", n_layers=spec.tiny_layers or 4, mtp_layers=1,
                                                         **spec.fp8()))]
    if not spec.tiny_only:
        configs.insert(0, ("glm5.2 (real attention dims) + MTP", get_config(
            "glm5.2", n_layers=spec.layers, intermediate_size=2048, vocab_size=32768, page_size=64, mtp_layers=1,
            **spec.fp8())))
    for label, cfg in configs:
        lens = [3, 100, 2100] if cfg.index_topk > 64 else [3, cfg.index_topk - 1, 3 * cfg.index_topk]
        batch = make_requests(cfg, lens, max_new_tokens=spec.steps + k, prefill_chunk=512 if cfg.index_topk > 64 else 8,
                              seed=3)
        with torch.no_grad():
            _progress(f"{label}: single-device speculative reference, draft length {k}")
            single = DSAModel(cfg, batch.num_slots, device=spec.device, seed=5)
            ref = generate_speculative(single, single.draft, batch, spec.steps, k, device=spec.device)
            del single
            for merge in spec.merges:
                if cfg.n_heads % world and MERGES[merge].head_sharded:
                    continue
                _progress(f"{label}: {merge} over {world} ranks, draft length {k}")
                torch._dynamo.reset()
                model = DSAModel(cfg, batch.num_slots, dcp_size=world, device=spec.device, seed=5)
                options = {"dcp_size": world, "merge": merge, "cuda_graphs": False, "replicated_modules": ["mtp"],
                           "draft_length": k, **({"lowering": spec.lowering} if spec.lowering else {})}
                target = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
                draft = torch.compile(model.draft, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
                start = time.perf_counter()
                out = generate_speculative(target, draft, batch, spec.steps, k, device=spec.device)
                seconds = time.perf_counter() - start
                draft_cache = model.draft_kv_cache()
                if draft_cache.element_size() == 1:  # FP8: its bytes (gloo cannot send float8)
                    draft_cache = draft_cache.view(torch.uint8)
                # rank 0's draft cache, over the group's own device (NCCL: CUDA; gloo: the host)
                first = draft_cache.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
                dist.broadcast(first, 0)
                yield {
                    "model": label, "merge": merge, "N": world, "draft_length": k, **spec.dtype_columns(model),
                    "tokens_match": out.tokens == ref.tokens,
                    "drafts_match": out.drafts == ref.drafts, "accepted_match": out.accepted == ref.accepted,
                    "accept_length": out.accept_length, "ref_accept_length": ref.accept_length,
                    "verify_steps": out.verify_steps,
                    "max_rel_logit_err": max(_relative_error(a, b) for a, b in zip(out.target_logits, ref.target_logits)),
                    "kv_rows_per_rank": model.kv_caches()[0].shape[0],
                    "kv_rows_expected": local_cache_rows(batch.num_slots, world),
                    "draft_kv_rows": draft_cache.shape[0], "draft_kv_rows_expected": batch.num_slots,
                    "draft_cache_same_as_rank0": bool(torch.equal(first.cpu(), draft_cache.cpu())),
                    "seconds_with_compile": seconds,
                }
                del model, target, draft


def _topology_columns(spec: RunSpec) -> dict:
    return {"tp": spec.tp, "replicate_q": spec.replicate_q} if spec.tp > 1 else {}


HF_PROMPT_LENS = (5, 17, 40)  # left-padded, as transformers' generate expects
HF_CACHE_LEN = 64  # the tiny models' max_position_embeddings


def _hf_generate(model, dcp_size: int, steps: int, device: str, dtype: torch.dtype):
    """Greedy ``model.generate`` over three requests on a ``DCPStaticCache``: tokens and the logits."""
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts

    ids, mask = left_padded_prompts(HF_PROMPT_LENS, model.config.vocab_size)
    cache = DCPStaticCache(model.config, max_cache_len=HF_CACHE_LEN, batch_size=len(HF_PROMPT_LENS),
                           dcp_size=dcp_size, dtype=dtype, device=device)
    with torch.no_grad():
        # disable_compile: on CUDA, generate would otherwise wrap the model in its own torch.compile
        # (the reference would not run eagerly, and the DCP model would be compiled twice)
        out = model.generate(ids.to(device), attention_mask=mask.to(device), past_key_values=cache,
                             max_new_tokens=steps, do_sample=False, return_dict_in_generate=True, output_logits=True,
                             disable_compile=True)
    return out.sequences[:, ids.shape[1]:].tolist(), torch.stack(out.logits).float().cpu()


def check_transformers(rank: int, world: int, spec: RunSpec) -> Iterator[dict]:
    """transformers' DSA models, unmodified (tiny random weights, ``spec.tiny_layers`` or 4 layers: GLM-5's
    indexers at layers 0 and 3, layers 1 and 2 sharing layer 0's top-k): ``generate`` with the
    model compiled in place under DCP against the same model compiled for this rank's device alone
    (``dcp_size=1``, whole cache: the single-rank program), in bf16 on a GPU and in fp32
    everywhere, for each merge mode. The reference is compiled, not eager, because the indexer
    kernels break exact ties at the K-th index score by position where ``torch.topk`` leaves the
    order open (``docs/dcp.md``); with tiny random weights a row whose K-th score is an exact 0
    (every head's relu 0) is common, and eager's pick among those positions is its own. On a GPU a
    first row compiles the model with stock ``torch.compile`` on the GPU alone: how far compiled
    rounding alone moves it from eager, the yardstick for the DCP rows in bf16."""
    from dsa_dcp.integrations.transformers import TINY_MODEL_TYPES, tiny_model
    from dsa_dcp.merge import MERGES

    on_cuda = torch.device(spec.device).type == "cuda"
    dtypes = (torch.bfloat16, torch.float32) if on_cuda else (torch.float32,)
    layers = spec.tiny_layers or 4
    for model_type in TINY_MODEL_TYPES:
        for dtype in dtypes:
            _progress(f"transformers {model_type} {dtype}: single-device reference")
            torch._dynamo.reset()
            single = tiny_model(model_type, layers=layers).to(device=spec.device, dtype=dtype)
            heads = single.config.num_attention_heads
            single.compile(backend="dsa_dcp", fullgraph=True, options={
                "dcp_size": 1, **({"lowering": spec.lowering} if spec.lowering else {}),
                **({"cuda_graphs": spec.cuda_graphs} if spec.cuda_graphs is not None else {})})
            ref_tokens, ref_logits = _hf_generate(single, 1, spec.steps, spec.device, dtype)
            del single
            runs = [("stock dcp1", None)] if on_cuda else []  # None: stock torch.compile, this device alone
            runs += [(merge, {"dcp_size": world, "merge": merge, **({"lowering": spec.lowering} if spec.lowering else {}),
                              **({"cuda_graphs": spec.cuda_graphs} if spec.cuda_graphs is not None else {})})
                     for merge in spec.merges if not (heads % world and MERGES[merge].head_sharded)]
            for label, options in runs:
                n = 1 if options is None else world
                _progress(f"transformers {model_type} {dtype}: {label}" + (f" over {n} ranks" if options else ""))
                torch._dynamo.reset()
                model = tiny_model(model_type, layers=layers).to(device=spec.device, dtype=dtype)
                if options is None:
                    model.compile(fullgraph=True)
                else:
                    model.compile(backend="dsa_dcp", fullgraph=True, options=options)
                tokens, logits = _hf_generate(model, n, spec.steps, spec.device, dtype)
                yield {"model": model_type, "dtype": str(dtype).removeprefix("torch."), "merge": label, "N": n,
                       "tokens_match": tokens == ref_tokens,
                       "rel_logit_err": _relative_error(logits, ref_logits), "tokens": tokens,
                       **_first_divergence(tokens, ref_tokens, logits, ref_logits)}
                del model


def _first_divergence(tokens, ref_tokens, logits, ref_logits) -> dict:
    """Where generation first left the reference: the step, the logits' relative error at each step
    up to it (where both runs still saw the same tokens), and the reference's margin there (its
    top-1 logit over its top-2, least over the rows that left it): a small margin is a near-tie
    that rounding may flip."""
    steps = logits.shape[0]
    first = next((t for t in range(steps) if any(a[t] != b[t] for a, b in zip(tokens, ref_tokens))), None)
    upto = steps if first is None else first + 1
    out = {"first_diverging_step": first,
           "step_rel_errs": [_relative_error(logits[t], ref_logits[t]) for t in range(upto)]}
    if first is not None:
        rows = [i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a[first] != b[first]]
        top2 = ref_logits[first, rows].topk(2, dim=-1).values
        out["ref_margin_there"] = (top2[:, 0] - top2[:, 1]).min().item()
    return out


def step_latency(rank: int, world: int, spec: RunSpec) -> Iterator[dict]:
    from dsa_dcp.report import last_report
    from dsa_dcp.models.runner import decode_step_inputs
    from dsa_dcp.models import DSAModel, get_config

    cfg = get_config("glm5.2", n_layers=spec.layers, intermediate_size=2048, vocab_size=32768, **spec.fp8())
    cpu_group = dist.new_group(backend="gloo")  # barriers that put no kernel in the profile
    host_barrier = lambda: dist.barrier(group=cpu_group)  # noqa: E731
    _release_compiled()  # what an earlier part compiled
    tp_group, dcp_group = _groups(spec, world)
    for batch in spec.batches:
        inputs, num_slots = decode_step_inputs(cfg, batch, spec.context, spec.device)
        runs = [("stock", "replicated"), ("single", "replicated")] + \
            [(merge, index_cache) for merge in spec.merges for index_cache in spec.index_caches]
        for merge, index_cache in runs:
            n = 1 if merge in ("stock", "single") else spec.dcp_size(world)
            _progress(f"step latency: batch {batch}, {merge}" + (f", {index_cache} index cache" if n > 1 else ""))
            model = DSAModel(cfg, num_slots, dcp_size=n, dtype=torch.bfloat16, device=spec.device, seed=0,
                             index_cache=index_cache, **_tp_args(spec, tp_group))
            with torch.no_grad():
                for cache in model.kv_caches() + list(model.index_caches().values()):
                    cache.normal_()
                if merge == "stock":  # stock torch.compile on one GPU: what a user runs without DCP
                    step = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
                else:
                    options = {"batch_sizes": [batch]} if n == 1 else \
                        {"dcp_size": n, "merge": merge, "batch_sizes": [batch], "index_cache": index_cache,
                         **_dcp_options(spec, dcp_group)}
                    step = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
                step(*inputs)
                us = _median_call_us(lambda: step(*inputs))
                row = {"batch": batch, "merge": {"stock": "stock dcp1", "single": "dcp1"}.get(merge, merge), "N": n,
                       **_topology_columns(spec), **spec.dtype_columns(model),
                       "index_cache": index_cache if n > 1 else "whole", "layers": spec.layers, "step_us": us}
                if merge == "stock":
                    row |= _stock_kernel_split(model, inputs, host_barrier)
                else:
                    row |= _kernel_split(last_report().lowered, host_barrier)
            step = model = None
            _release_compiled()
            yield row


def _kernel_split(lowered, host_barrier, runs: int = 3) -> dict:
    """Where a step's device time goes: its captured graph replayed ``runs`` times under the
    profiler on every rank, each replay started together (a CPU barrier, which launches no
    kernel), so a collective's time is its own and not a wait for a rank still starting.

    Falls back to the step run eagerly on its captured inputs if the profiler sees no kernel
    inside graph replays; there a collective's time also holds the wait for the other ranks'
    host launches (``profiled`` says which).
    """
    from dsa_dcp.bench.kinds import kernel_us_by_kind
    from dsa_dcp.lowering.cuda_graphs import device_kernels

    (captured,) = lowered.graphs.values()

    def replay():
        torch.cuda.synchronize()
        host_barrier()
        captured.graph.replay()

    kernels, profiled = device_kernels(replay, (), runs=runs), "graph replay"
    if not kernels:
        host_barrier()
        kernels, profiled = device_kernels(lowered.fn, captured.inputs, runs=runs), "eager"
    return kernel_us_by_kind(kernels, runs=runs) | {"profiled": profiled}


def _stock_kernel_split(model, inputs, host_barrier, runs: int = 3) -> dict:
    """The stock step's device time by kind: its Inductor code without graph trees, run eagerly
    (the kernels its graph replays)."""
    from dsa_dcp.bench.kinds import kernel_us_by_kind
    from dsa_dcp.lowering.cuda_graphs import device_kernels

    plain = torch.compile(model, fullgraph=True, dynamic=False)
    plain(*inputs)
    host_barrier()
    return kernel_us_by_kind(device_kernels(plain, inputs, runs=runs), runs=runs) | {"profiled": "eager"}


def _release_compiled() -> None:
    """Drop every compiled step and its CUDA graphs (memory pool included) before the next one."""
    import gc

    from dsa_dcp.backend import forget_last_report

    torch._dynamo.reset()
    forget_last_report()
    gc.collect()
    torch.cuda.synchronize()


def merge_per_layer(rank: int, world: int, spec: RunSpec, heads: int = 64, d: int = 512) -> Iterator[dict]:
    from dsa_dcp.kernels import fused_merge
    from dsa_dcp.ops import _composed_a2a_merge

    group = dist.group.WORLD.group_name
    for b in spec.batches:
        _progress(f"merge per layer: batch {b}")
        out = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.randn(b, heads, device="cuda")
        fused = lambda: torch.ops.dsa_dcp.fused_a2a_merge(out, lse, world, rank, group)  # noqa: E731
        unfused = lambda: _composed_a2a_merge(out, lse, world, group)  # noqa: E731
        ref, got = unfused(), fused()
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
        row = {"batch": b, "N": world, "heads_per_rank": heads // world}
        row["fused_kernel"] = fused_merge.has_workspace(group)
        for name, fn in (("fused", fused), ("unfused", unfused)):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(_CALLS_PER_GROUP):
                    fn()
            row[f"{name}_us"] = _median_call_us(graph.replay, calls_per_group=1) / _CALLS_PER_GROUP
        row["unfused_over_fused"] = row["unfused_us"] / row["fused_us"]
        yield row


PARTS = ("correctness", "latency", "merge", "transformers", "mtp")
# What needs NCCL on CUDA (not run over gloo there): the speed parts (CUDA graphs), the fused merge
# (symmetric memory) and the merges that all-gather (gloo's all-gather of CUDA tensors crashes).
NCCL_PARTS, NCCL_MERGES = ("latency", "merge"), ("fused_a2a", "ag", "ag_rs")


def run(rank: int, world: int, spec: RunSpec, parts: tuple[str, ...] = PARTS, report=None) -> dict:
    """The parts asked for (the speed parts on CUDA only); ``report(name, rows)`` is called after
    each row, so a run cut short still leaves what it measured."""
    results = {}
    on_cuda = torch.device(spec.device).type == "cuda"
    steps = [("correctness", check_correctness, "correctness" in parts),
             ("step_latency", step_latency, on_cuda and "latency" in parts),
             ("merge_per_layer", merge_per_layer,
              on_cuda and "merge" in parts and "fused_a2a" in spec.merges and spec.tp == 1),
             ("transformers", check_transformers, "transformers" in parts and spec.tp == 1),
             ("mtp", check_speculative, "mtp" in parts and spec.mtp is not None and spec.tp == 1)]
    for name, fn, wanted in steps:
        if wanted:
            results[name] = []
            for row in fn(rank, world, spec):
                results[name].append(row)
                if report is not None:
                    report(name, results[name])
    return results


# What a row must show, by part: name -> the check (rank 0 prints every rank's failures).
CHECKS = {
    "correctness": {"tokens_match": lambda r: r["tokens_match"],
                    "kv_rows": lambda r: r["kv_rows_per_rank"] == r["kv_rows_expected"],
                    "fused_kernel": lambda r: r.get("fused_kernel", True)},
    "mtp": {"tokens_match": lambda r: r["tokens_match"], "drafts_match": lambda r: r["drafts_match"],
            "accepted_match": lambda r: r["accepted_match"],
            "draft_cache_same_as_rank0": lambda r: r["draft_cache_same_as_rank0"],
            "kv_rows": lambda r: r["kv_rows_per_rank"] == r["kv_rows_expected"]},
}


def failed_checks(results: dict) -> list[str]:
    """``"part row i (model, merge): check"`` for every check a row of ``results`` fails."""
    return [f"{part} row {i} ({row.get('model')}, {row.get('merge')}): {name}"
            for part, checks in CHECKS.items() for i, row in enumerate(results.get(part, []))
            for name, check in checks.items() if not check(row)]


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    cols = list(dict.fromkeys(c for r in rows for c in r))  # rows may lack a column (e.g. no divergence)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (r.get(c, "") for c in cols)
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dsa_dcp.launch import init_from_env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--merges", nargs="+", choices=list(RunSpec.merges), help="default: every merge the backend runs")
    p.add_argument("--backend", choices=["nccl", "gloo"],
                   help="the process group's (default: nccl on cuda, gloo on cpu); gloo on cuda lets ranks share a "
                        "GPU (module docstring)")
    p.add_argument("--layers", type=int, default=RunSpec.layers)
    p.add_argument("--batches", type=int, nargs="+", default=list(RunSpec.batches))
    p.add_argument("--steps", type=int, default=RunSpec.steps, help="tokens each request generates (correctness)")
    p.add_argument("--parts", nargs="+", choices=PARTS, help="default: every part the backend runs")
    p.add_argument("--lowering", choices=["inductor", "fx"], help="correctness part (default: the backend's)")
    p.add_argument("--index-caches", nargs="+", choices=["replicated", "sharded"], default=list(RunSpec.index_caches),
                   help="step latency: the index caches of the DCP rows")
    p.add_argument("--tp", type=int, default=1, help="TP size: the models run tensor-parallel in groups of this "
                   "many ranks (correctness and step latency; the other parts need --tp 1)")
    p.add_argument("--dcp", type=int, help="DCP size inside each TP group (default: the TP size; without TP, the world)")
    p.add_argument("--replicate-q", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tp: hold the DCP group's query weights (default) or all-gather the query each layer")
    p.add_argument("--mtp", type=int, metavar="K",
                   help="also run the mtp part: speculative decoding with the MTP draft, draft length K")
    p.add_argument("--kv-dtype", choices=["fp8"],
                   help="the GLM-5.2-shaped models' KV cache and index keys (correctness, latency and mtp parts; "
                        "default: the model's dtype): fp8 stores E4M3 KV (per-tensor scale) and E4M3 index keys "
                        "with a scale a token; the transformers part keeps its checkpoints' cache")
    p.add_argument("--json")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="seconds")
    args = p.parse_args(argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if backend == "nccl" and args.device == "cpu":
        p.error("--backend nccl needs --device cuda")
    host_collectives = args.device == "cuda" and backend == "gloo"  # ranks may share a GPU; no graphs
    if args.mtp is not None and args.mtp < 1:
        p.error(f"--mtp needs a draft length >= 1, got {args.mtp}")
    if args.parts and "mtp" in args.parts and args.mtp is None:
        p.error("--parts mtp needs --mtp K (the draft length)")
    parts = args.parts or [x for x in PARTS if not (host_collectives and x in NCCL_PARTS)
                           and (x != "mtp" or args.mtp is not None)]
    merges = args.merges or [m for m in RunSpec.merges if not (host_collectives and m in NCCL_MERGES)]
    needs_nccl = [x for x in parts + merges if x in NCCL_PARTS + NCCL_MERGES]
    if host_collectives and needs_nccl:
        p.error(f"--device cuda --backend gloo runs the a2a merge without CUDA graphs: {needs_nccl} need NCCL "
                f"(one GPU per rank)")
    faulthandler.register(signal.SIGTERM, chain=True)  # a run stopped from outside shows its stacks
    if host_collectives:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    # A collective that waits this long fails the run instead of hanging it.
    rank, world = init_from_env(backend, timeout=args.collective_timeout)
    problem = topology_problem(world, args.tp, args.dcp)
    if problem:
        p.error(problem)
    spec = RunSpec(device=args.device, merges=tuple(merges), layers=args.layers, batches=tuple(args.batches),
                   steps=args.steps, tiny_only=args.device == "cpu", lowering=args.lowering,
                   index_caches=tuple(args.index_caches), cuda_graphs=False if host_collectives else None,
                   tp=args.tp, dcp=args.dcp, replicate_q=args.replicate_q, mtp=args.mtp,
                   kv_dtype=args.kv_dtype)
    if args.device == "cuda":
        spec = dataclasses.replace(spec, device=f"cuda:{torch.cuda.current_device()}")
    written = {}

    def report(name: str, rows: list[dict]) -> None:
        if rank != 0:
            return
        print(f"{name}: {json.dumps(rows[-1])}", flush=True)
        written[name] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(written, f, indent=1)

    results = run(rank, world, spec, tuple(parts), report)
    if rank == 0:
        for name, rows in results.items():
            where = f"TP {spec.tp}, N = {spec.dcp_size(world)}" if spec.tp > 1 else f"N = {world}"
            print(f"\n{name} ({where})\n{_table(rows)}")
    # every rank's failed checks, printed by rank 0; the run fails on every rank if one failed
    failed = [None] * world
    dist.all_gather_object(failed, failed_checks(results))
    if rank == 0:
        for r, checks in enumerate(failed):
            for check in checks:
                print(f"FAILED on rank {r}: {check}", flush=True)
    ok = not any(failed)
    dist.barrier()
    if args.device == "cuda" and "latency" in parts:
        # On two H200s (torch 2.11, NCCL 2.28.9) both ranks hung in destroy_process_group after
        # the latency part, even with every compiled step and graph released first. Everything is
        # reported by now, so such a run leaves without tearing NCCL down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
