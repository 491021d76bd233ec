"""``dsa-dcp bench indexer``: the lightning indexer's kernels against the model's torch code.

Every timing is a median over replays of a CUDA graph that holds the calls back to back (time
per call), in one process (40 ms of replays a timing, so that the default run should take about four minutes on an
H200, an estimate not yet measured, much of it Inductor compiling the composition; ``--inductor
off`` skips that column). Each
variant is checked against the references on the same inputs
before it is timed. Parts (``--only``):

- ``indexer``: one layer's indexer, scores + top-k, from the paged index cache to int32 slots:
  ours (``index_scores_triton`` then ``topk_select_triton``) against the model's composition
  (:func:`indexer_torch`: gather every candidate's key as fp32, two einsums, relu, mask,
  ``torch.topk``) run eagerly and as compiled by stock Inductor (``torch.compile`` of the same
  function: the code ``mode="reduce-overhead"`` would replay, captured in our graph so that no
  input copy is counted; ``--inductor dynamic`` compiles once for all shapes, ``static`` once a
  shape). B in {1, 8, 32, 128}, contexts {4K, 32K, 128K}, bf16 and FP8 keys (per-row fp32
  scales; with FP8 keys the queries are E4M3 too, as the reference models quantize them),
  Hi in {32, 64}, Di = 128, page size 64, K = 2048. Ours is also timed in its two parts, the
  scores by each path of ``index_scores`` beside its default (``gather_us``, ``pages_us``: keys
  read a row or a page at a time), and the keys' bytes alone at copy bandwidth (``key_floor_us``).
  Where one call's keys fit twice in L2, the graph rotates over disjoint page tables so every
  call reads keys from HBM.
- ``topk``: ``topk_select_triton`` alone (its default, and each path forced: ``resident``, one
  program a row holding the row in registers, timed up to ``RESIDENT_LIMIT`` = 32K candidates;
  ``row``, one program a row reading the row in tiles; ``split``, the chunked passes;
  ``sampled``, one program a row compacting the candidates above a sample's threshold;
  ``sampled_split``, the same with the row's count and compaction split as ``split`` splits it) against
  ``torch.topk`` on the same fp32 scores ``[B, C]`` (randn), K = 2048. ``--topk-paths`` names the
  forced paths to time (default all; ``--topk-paths`` alone times the default plan only: most of a
  full grid's time is compiling and timing the forced paths).
- ``remap``: the fused top-k + remap (N = 2, rank 0) against the top-k alone and against the
  top-k followed by ``topk_remap_triton``.
- ``tiles`` (only when asked for): ``index_scores`` at B = 32, 32K for every tile candidate
  (path x ``block_c`` x warps x stages), to choose the launcher's defaults.

Bytes (the least a call must move) and the achieved GB/s stand beside each time: for the indexer
the keys (and their scales) of the valid candidates, the queries and weights, the fp32 scores
written and read once, and the top-k written; for the top-k the scores read and the top-k
written. ``floor_us`` is those bytes at the device-to-device copy bandwidth measured in the same
process.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

from dsa_dcp.bench.measure import L2_BYTES, device_limits, in_graph_us, versions
from dsa_dcp.kernels.kv_store import quantize_rows

PAGE = 64
DI = 128
K = 2048
GRAPH_CALLS = 10
REP = 40  # ms of replays a timing


def copy_GBps() -> float:
    """Device-to-device copy bandwidth (read + write bytes), as ``bench kernels`` measures it (a
    2 GiB bf16 copy: a byte-wise copy of uint8 ran at 2.8 TB/s on the H200, not its 4.3)."""
    return device_limits()["copy_GBps"]


def indexer_torch(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size: int, k: int):
    """The reference models' indexer after its projections (dsa_dcp/models/dsa.py), FP8 keys
    dequantized after the gather: what a model author writes."""
    pages = page_table.index_select(0, req_ids.clamp(min=0)).long()
    offs = torch.arange(page_size, device=pages.device)
    cand = (pages.unsqueeze(-1) * page_size + offs).flatten(1)
    capacity = cand.shape[1]
    pos = torch.arange(capacity, device=cand.device)
    valid = (pos.unsqueeze(0) <= positions.unsqueeze(1)) & (cand >= 0)
    keys = index_cache[cand.clamp(min=0)].float()
    if key_scale is not None:
        keys = keys * key_scale[cand.clamp(min=0)].unsqueeze(-1)
    logits = torch.einsum("thd,tcd->thc", q.float(), keys).relu()
    score = torch.einsum("thc,th->tc", logits, w)
    score = score.masked_fill(~valid, float("-inf"))
    top_score, top_idx = torch.topk(score, min(k, capacity), dim=-1)
    top_slots = cand.gather(1, top_idx)
    return torch.where(top_score == float("-inf"), torch.full_like(top_slots, -1), top_slots).to(torch.int32)


class KeyCache:
    """One index cache for every shape: bf16 keys, their FP8 E4M3 copy and per-row scales."""

    def __init__(self, slots: int):
        self.slots = slots
        self.bf16 = torch.randn(slots, DI, device="cuda", dtype=torch.bfloat16)
        self.scale = self.bf16.abs().amax(dim=1).float().div_(448.0)
        self.fp8 = torch.empty(slots, DI, device="cuda", dtype=torch.float8_e4m3fn)
        for s in range(0, slots, 1 << 22):  # in slices: no fp32 copy of the whole cache
            self.fp8[s:s + (1 << 22)] = (self.bf16[s:s + (1 << 22)].float() / self.scale[s:s + (1 << 22), None]).to(
                torch.float8_e4m3fn)

    def get(self, keys: str):
        return (self.bf16, None) if keys == "bf16" else (self.fp8, self.scale)


class IndexerCase:
    """One step's indexer inputs; ``views`` page tables over disjoint pages (the same shape)."""

    def __init__(self, cache: KeyCache, b: int, ctx: int, keys: str, hi: int):
        self.b, self.ctx, self.keys, self.hi = b, ctx, keys, hi
        self.cache, self.key_scale = cache.get(keys)
        pages = ctx // PAGE
        self.key_bytes = key_bytes = b * ctx * (DI * self.cache.element_size() + (4 if keys == "fp8" else 0))
        self.views = max(1, min(64, math.ceil(2 * L2_BYTES / key_bytes), cache.slots // (b * ctx)))
        perm = torch.randperm(cache.slots // PAGE, device="cuda")[: self.views * b * pages]
        self.page_tables = list(perm.view(self.views, b, pages).int())
        self.req_ids = torch.arange(b, device="cuda")
        self.positions = torch.full((b,), ctx - 1, device="cuda", dtype=torch.int64)
        self.q = torch.randn(b, hi, DI, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(b, hi, device="cuda") * (hi * DI) ** -0.5
        if keys == "fp8":  # E4M3 queries with FP8 keys, as the reference models quantize them
            q8, q_scale = quantize_rows(self.q.view(b * hi, DI), block=True)
            self.q, self.w = q8.view(b, hi, DI), self.w * q_scale.view(b, hi)
        self.bytes = key_bytes + self.q.numel() * self.q.element_size() + self.w.numel() * 4 + 2 * b * ctx * 4 + b * K * 4

    def args(self, view: int = 0):
        return (self.q, self.w, self.cache, self.key_scale, self.page_tables[view], self.req_ids, self.positions, PAGE)

    def scores(self, view: int = 0, path: str | None = None):
        from dsa_dcp.kernels import index_scores_triton

        return index_scores_triton(*self.args(view), path=path)

    def ours(self, view: int = 0):
        from dsa_dcp.kernels import topk_select_triton

        return topk_select_triton(self.scores(view), K, self.page_tables[view], self.req_ids, PAGE)


def _check_indexer(case: IndexerCase, inductor) -> None:
    from dsa_dcp.kernels import index_scores_reference, topk_select_reference

    scores = case.scores()
    ref = index_scores_reference(*case.args())
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref))
    rel = ((scores - ref)[fin].abs().max() / ref[fin].abs().max()).item()
    assert rel < 1e-3, ("index_scores", rel)
    assert torch.equal(case.ours(), topk_select_reference(scores, K, case.page_tables[0], case.req_ids, PAGE))
    # the composition selects from its own fp32 scores: the same set but for near-ties
    theirs = indexer_torch(*case.args(), K)
    overlap = _overlap(case.ours(), theirs)
    assert overlap > 0.99, ("torch composition", overlap)
    if inductor is not None:
        assert _overlap(case.ours(), inductor(*case.args(), K)) > 0.99, "inductor"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the valid slots of ``a`` also in the same row of ``b``."""
    a_sorted, b_sorted = a.long().sort(dim=1).values, b.long().sort(dim=1).values
    hit = torch.searchsorted(b_sorted, a_sorted)
    found = b_sorted.gather(1, hit.clamp(max=b.shape[1] - 1)) == a_sorted
    valid = a_sorted >= 0
    return (found & valid).sum().item() / max(valid.sum().item(), 1)


def bench_indexer(batches, contexts, keys, heads, inductor_mode: str, copy_bw: float, out: list,
                  after_row=lambda: None) -> None:
    max_slots = max(batches) * max(contexts)
    cache = KeyCache(max_slots)
    compiled = {}

    def inductor_fn(shape_key):
        if inductor_mode == "off":
            return None
        key = shape_key if inductor_mode == "static" else "dynamic"
        if key not in compiled:
            if inductor_mode == "static":  # one code object: past dynamo's recompile limit it would run eagerly
                torch._dynamo.reset()
                compiled.clear()
            compiled[key] = torch.compile(indexer_torch, dynamic=inductor_mode == "dynamic")
        return compiled[key]

    for kd, hi, b, ctx in itertools.product(keys, heads, batches, contexts):
        case = IndexerCase(cache, b, ctx, kd, hi)
        row = {"part": "indexer", "keys": kd, "Hi": hi, "B": b, "ctx": ctx, "K": K, "bytes": case.bytes}
        fn = inductor_fn((kd, hi, b, ctx))
        try:
            _check_indexer(case, fn)
        except torch.OutOfMemoryError:
            fn = None  # the composition's fp32 [B, C, Di] copy did not fit: time ours only
        from dsa_dcp.kernels import topk_select_triton

        row["ours_us"] = in_graph_us([lambda v=v: case.ours(v) for v in range(case.views)]
                                     * max(1, GRAPH_CALLS // case.views), REP)  # fmt: skip
        row["scores_us"] = in_graph_us([lambda v=v: case.scores(v) for v in range(case.views)]
                                       * max(1, GRAPH_CALLS // case.views), REP)  # fmt: skip
        scores = case.scores()
        fin = torch.isfinite(scores)
        for path in ("gather", "pages"):
            try:
                other = case.scores(path=path)
            except ValueError:  # the pages path cannot read these keys
                continue
            assert torch.equal(fin, torch.isfinite(other)) and (
                (other - scores)[fin].abs().max() <= 1e-5 * scores[fin].abs().max()), f"{path} and default scores differ"
            del other
            row[f"{path}_us"] = in_graph_us([lambda v=v: case.scores(v, path) for v in range(case.views)]
                                            * max(1, GRAPH_CALLS // case.views), REP)  # fmt: skip
        row["key_floor_us"] = case.key_bytes / copy_bw / 1e3
        row["scores_over_key_floor"] = row["scores_us"] / row["key_floor_us"]
        row["topk_us"] = in_graph_us([lambda: topk_select_triton(scores, K, case.page_tables[0], case.req_ids, PAGE)]
                                     * GRAPH_CALLS, REP)  # fmt: skip
        row["ours_GBps"] = case.bytes / row["ours_us"] / 1e3
        row["floor_us"] = case.bytes / copy_bw / 1e3
        row["ours_over_floor"] = row["ours_us"] / row["floor_us"]
        calls = 1 if b * ctx >= 32 * 32768 else 3
        for name, f in (("torch", indexer_torch), ("inductor", fn)):
            if f is None:
                continue
            try:
                row[f"{name}_us"] = in_graph_us([lambda f=f: f(*case.args(), K)] * calls, rep=25)
                row[f"{name}_over_ours"] = row[f"{name}_us"] / row["ours_us"]
            except torch.OutOfMemoryError:
                row[f"{name}_us"] = None
            torch.cuda.empty_cache()
        out.append(row)
        after_row()
        print(f"# indexer {kd} Hi={hi} B={b} ctx={ctx}: ours {row['ours_us']:.1f} us", file=sys.stderr)
    del cache
    torch.cuda.empty_cache()


def _topk_inputs(b: int, ctx: int):
    scores = torch.randn(b, ctx, device="cuda")
    page_table = torch.randperm(b * (ctx // PAGE), device="cuda").view(b, ctx // PAGE).int()
    return scores, page_table, torch.arange(b, device="cuda")


TOPK_PATHS = ("resident", "row", "split", "sampled", "sampled_split")  # forced, beside the default ("ours")


def bench_topk(batches, contexts, out: list, forced=TOPK_PATHS, after_row=lambda: None) -> None:
    """``--only topk``: the default plan and each ``forced`` path of :data:`TOPK_PATHS` against
    ``torch.topk``; ``after_row`` runs after each shape (saving the rows of a run cut short)."""
    from dsa_dcp.kernels import topk_select_reference, topk_select_triton
    from dsa_dcp.kernels.topk_select import RESIDENT_LIMIT, split_programs

    for b, ctx in itertools.product(batches, contexts):
        scores, pt, req = _topk_inputs(b, ctx)
        ref = topk_select_reference(scores, K, pt, req, PAGE)
        split = split_programs(b, ctx, scores.device)
        row = {"part": "topk", "B": b, "ctx": ctx, "K": K, "bytes": b * ctx * 4 + b * K * 4, "split_chunks": split}
        paths = {"ours": {}, "resident": {"path": "resident"}, "row": {"path": "row"}, "split": {"chunks": split},
                 "sampled": {"path": "sampled", "chunks": 1}, "sampled_split": {"path": "sampled", "chunks": split}}
        paths = {name: kw for name, kw in paths.items() if name == "ours" or name in forced}
        for name, kw in paths.items():
            if name == "resident" and ctx > RESIDENT_LIMIT:
                continue
            assert torch.equal(topk_select_triton(scores, K, pt, req, PAGE, **kw), ref), (name, b, ctx)
            row[f"{name}_us"] = in_graph_us([lambda kw=kw: topk_select_triton(scores, K, pt, req, PAGE, **kw)]
                                            * GRAPH_CALLS, REP)  # fmt: skip
        row["torch_us"] = in_graph_us([lambda: torch.topk(scores, K, dim=-1)] * GRAPH_CALLS, REP)
        row["ours_GBps"] = row["bytes"] / row["ours_us"] / 1e3
        row["torch_over_ours"] = row["torch_us"] / row["ours_us"]
        out.append(row)
        times = ", ".join(f"{name} {row[name + '_us']:.1f}" for name in [*paths, "torch"] if name + "_us" in row)
        print(f"# topk B={b} ctx={ctx} (us): {times}", file=sys.stderr)  # each path, for a run cut short
        after_row()


def bench_remap(batches, contexts, out: list, n: int = 2) -> None:
    from dsa_dcp.kernels import topk_remap_reference, topk_remap_triton, topk_select_remap_triton, topk_select_triton

    for b, ctx in itertools.product(batches, contexts):
        scores, pt, req = _topk_inputs(b, ctx)
        topk = topk_select_triton(scores, K, pt, req, PAGE)
        want = topk_remap_reference(topk, n, 0, 1)
        got = topk_select_remap_triton(scores, K, n, 0, 1, pt, req, PAGE)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (b, ctx)
        row = {"part": "remap", "B": b, "ctx": ctx, "K": K, "N": n}
        row["topk_us"] = in_graph_us([lambda: topk_select_triton(scores, K, pt, req, PAGE)] * GRAPH_CALLS, REP)
        row["fused_us"] = in_graph_us([lambda: topk_select_remap_triton(scores, K, n, 0, 1, pt, req, PAGE)]
                                      * GRAPH_CALLS, REP)  # fmt: skip
        row["composed_us"] = in_graph_us(
            [lambda: topk_remap_triton(topk_select_triton(scores, K, pt, req, PAGE), n, 0, 1)] * GRAPH_CALLS, REP)
        row["fused_over_topk"] = row["fused_us"] / row["topk_us"]
        out.append(row)


SCORE_TILES = [dict(path=path, block_c=bc, num_warps=wp, num_stages=st)
               for path, tiles in (("gather", (32, 64, 128)), ("pages", (64, 128, 256)))
               for bc in tiles for wp in (4, 8) for st in (2, 3, 4)]  # fmt: skip


def bench_score_tiles(keys, heads, out: list, b: int = 32, ctx: int = 32768) -> None:
    """``--only tiles``: index_scores at one shape for each tile candidate (the default first)."""
    from dsa_dcp.kernels import index_scores_reference, index_scores_triton

    cache = KeyCache(b * ctx * 2)
    for kd, hi in itertools.product(keys, heads):
        case = IndexerCase(cache, b, ctx, kd, hi)
        ref = index_scores_reference(*case.args())
        fin = torch.isfinite(ref)
        for tiles in [{}] + SCORE_TILES:
            got = index_scores_triton(*case.args(), **tiles)
            assert ((got - ref)[fin].abs().max() / ref[fin].abs().max()).item() < 1e-3, tiles
            us = in_graph_us([lambda v=v: index_scores_triton(*case.args(v), **tiles) for v in range(case.views)]
                             * max(1, GRAPH_CALLS // case.views), REP)  # fmt: skip
            key_bytes = b * ctx * (DI * case.cache.element_size() + (4 if kd == "fp8" else 0))
            out.append({"part": "tiles", "keys": kd, "Hi": hi, "B": b, "ctx": ctx, "tiles": str(tiles or "default"),
                        "us": us, "key_GBps": key_bytes / us / 1e3})  # fmt: skip
        del ref
    del cache
    torch.cuda.empty_cache()


COLUMNS = {
    "indexer": ["keys", "Hi", "B", "ctx", "ours_us", "scores_us", "gather_us", "pages_us", "key_floor_us", "scores_over_key_floor",
                "topk_us", "floor_us", "ours_over_floor",
                "ours_GBps", "torch_us", "inductor_us", "torch_over_ours", "inductor_over_ours"],
    "topk": ["B", "ctx", "ours_us", "resident_us", "row_us", "split_us", "split_chunks", "sampled_us",
             "sampled_split_us", "torch_us", "torch_over_ours",
             "ours_GBps"],
    "remap": ["B", "ctx", "N", "topk_us", "fused_us", "composed_us", "fused_over_topk"],
    "tiles": ["keys", "Hi", "B", "ctx", "tiles", "us", "key_GBps"],
}  # fmt: skip


def format_tables(rows: list[dict]) -> str:
    out = []
    for part, cols in COLUMNS.items():
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        out.append(f"\n{part}\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in sel:
            cells = [("-" if r.get(c) is None else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])) for c in cols]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(args) -> int:
    torch.manual_seed(0)
    only = set(args.only or ("indexer", "topk", "remap"))
    rows: list[dict] = []
    bw = copy_GBps()

    def save():
        if args.json:  # after each row or part, so a run stopped by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "versions": versions(), "copy_GBps": bw,
                           "rows": rows}, f, indent=1)  # fmt: skip

    if "topk" in only:
        bench_topk(args.batches, args.contexts, rows, forced=args.topk_paths, after_row=save)
        save()
    if "remap" in only:
        bench_remap(args.batches, args.contexts, rows)
        save()
    if "indexer" in only:
        bench_indexer(args.batches, args.contexts, args.keys, args.heads, args.inductor, bw, rows, after_row=save)
        save()
    if "tiles" in only:
        bench_score_tiles(args.keys, args.heads, rows)
        save()
    print(f"device {torch.cuda.get_device_name()}, {versions()}, copy {bw:.0f} GB/s")
    print(format_tables(rows))
    return 0
