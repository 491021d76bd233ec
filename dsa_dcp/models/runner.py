"""A small paged-request engine: builds batches of rows for a step function and decodes greedily.

Used by tests and the demo to drive ``DSAModel`` (eager, compiled, or a DCP program) through a
realistic schedule: requests with different prompt lengths join at different steps, prefill in
chunks (several rows of one request in a step) while other requests decode (one row each), and
their pages are scattered over a shared slot pool so no request's slots are contiguous.

Schedule of one engine step (deterministic):
  1. every decoding request (prompt done, fewer than ``steps`` tokens generated) gets one row:
     its last generated token at position ``len(prompt) + generated - 1``;
  2. every started request still in prefill gets its next chunk of the prompt:
     ``min(prefill_chunk, rest of prompt, row budget left)`` rows;
  3. rows are laid out in request order (each request's rows contiguous, positions ascending),
     then padded with padding rows up to ``pad_to``.
The budget (``rows_per_step``, default ``pad_to``, default unlimited) is spent on decode rows
first, then on prefill chunks in request order. A request's next token is the argmax of the
logits of its last row in the step when that row is a decode row or ends its prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from .config import DSAConfig

__all__ = ["Request", "RequestBatch", "GenerationResult", "StepFn", "make_requests", "standard_test_batch",
           "generate", "pad_rows"]

StepFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``step_fn(input_ids, positions, req_ids, slots, page_table) -> logits[T, vocab]``."""

_KEEP = object()


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    start_step: int = 0  # engine step at which the request joins
    prefill_chunk: int | None = None  # prompt rows per step; None -> whole prompt at once

    def __post_init__(self) -> None:
        if not self.prompt or self.start_step < 0 or (self.prefill_chunk is not None and self.prefill_chunk < 1):
            raise ValueError(f"need a non-empty prompt, start_step >= 0, prefill_chunk >= 1 or None; got "
                             f"{len(self.prompt)} tokens, {self.start_step}, {self.prefill_chunk}")


@dataclass(frozen=True)
class RequestBatch:
    """Requests plus their pages. ``page_table[r, j]`` = page of positions ``[j*P, (j+1)*P)``
    of request r (int32, ``-1`` = not allocated); the pool has ``num_slots`` slots."""

    requests: tuple[Request, ...]
    page_table: Tensor
    page_size: int
    num_slots: int
    max_new_tokens: int

    def slot(self, req: int, pos: int) -> int:
        page = int(self.page_table[req, pos // self.page_size])
        if page < 0:
            raise IndexError(f"request {req} has no page for position {pos}")
        return page * self.page_size + pos % self.page_size

    def with_schedule(self, *, start_steps: Sequence[int] | None = None,
                      prefill_chunk: object = _KEEP) -> "RequestBatch":
        """Same prompts and pages, another schedule. ``prefill_chunk``: an int or None for every
        request, or one per request; left out, each request keeps its own."""
        reqs = list(self.requests)
        if start_steps is not None:
            reqs = [dataclasses.replace(r, start_step=s) for r, s in zip(reqs, start_steps, strict=True)]
        if prefill_chunk is not _KEEP:
            chunks = prefill_chunk if isinstance(prefill_chunk, (list, tuple)) else [prefill_chunk] * len(reqs)
            reqs = [dataclasses.replace(r, prefill_chunk=c) for r, c in zip(reqs, chunks, strict=True)]
        return dataclasses.replace(self, requests=tuple(reqs))


@dataclass
class GenerationResult:
    """``tokens[r]``: the greedy tokens request r generated. ``step_logits[i]``: logits of the
    real rows of engine step i (padding rows dropped, fp32, CPU); ``step_rows[i]``: the
    ``(request, position)`` of each of those rows."""

    tokens: list[list[int]]
    step_logits: list[Tensor] = field(default_factory=list)
    step_rows: list[list[tuple[int, int]]] = field(default_factory=list)

    def logits_at(self, req: int, pos: int) -> Tensor:
        """Logits of the row of request ``req`` at position ``pos``."""
        for logits, rows in zip(self.step_logits, self.step_rows):
            if (req, pos) in rows:
                return logits[rows.index((req, pos))]
        raise KeyError(f"no row for request {req} at position {pos}")


def make_requests(cfg: DSAConfig, prompt_lens: Sequence[int], *, max_new_tokens: int,
                  start_steps: Sequence[int] | None = None, prefill_chunk: int | None | Sequence[int | None] = None,
                  num_slots: int | None = None, seed: int = 0) -> RequestBatch:
    """Random prompts (from ``seed``) and a page table over a shuffled slot pool.

    Each request gets ``ceil((len + max_new_tokens) / P)`` pages, handed out round-robin over
    the requests from a random permutation of the pool's pages, so the pages of different
    requests interleave. ``num_slots`` defaults to the pages needed plus a quarter spare.
    """
    n = len(prompt_lens)
    if n == 0 or min(prompt_lens) < 1 or max_new_tokens < 1:
        raise ValueError(f"need >= 1 request, prompt lengths >= 1, max_new_tokens >= 1; "
                         f"got {prompt_lens}, {max_new_tokens}")
    page = cfg.page_size
    need = [-(-(length + max_new_tokens) // page) for length in prompt_lens]
    total = sum(need)
    if num_slots is None:
        num_slots = (total + max(1, total // 4)) * page
    pool_pages = num_slots // page
    if pool_pages < total:
        raise ValueError(f"{num_slots} slots hold {pool_pages} pages of {page}; the requests need {total}")

    gen = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist()) for length in prompt_lens]
    order = iter(torch.randperm(pool_pages, generator=gen).tolist())
    page_table = torch.full((n, max(need)), -1, dtype=torch.int32)
    for j in range(max(need)):  # round-robin: page j of every request, then page j + 1, ...
        for r in range(n):
            if j < need[r]:
                page_table[r, j] = next(order)

    starts = list(start_steps) if start_steps is not None else [0] * n
    chunks = list(prefill_chunk) if isinstance(prefill_chunk, (list, tuple)) else [prefill_chunk] * n
    reqs = tuple(Request(p, s, c) for p, s, c in zip(prompts, starts, chunks, strict=True))
    return RequestBatch(reqs, page_table, page, num_slots, max_new_tokens)


def standard_test_batch(cfg: DSAConfig, *, max_new_tokens: int = 4, seed: int = 0) -> RequestBatch:
    """Four requests around ``K = index_topk``: lengths ``3, K - 1, K + 3, 3K``.

    Two are shorter than K (their top-k rows end in ``-1``), one is long (3K, prefilled in
    chunks of K while the others decode). Requests join at steps 0, 0, 1, 2, so the schedule
    mixes extend rows of one request with decode rows of others.
    """
    k = cfg.index_topk
    return make_requests(cfg, [3, k - 1, k + 3, 3 * k], max_new_tokens=max_new_tokens,
                         start_steps=[0, 0, 1, 2], prefill_chunk=k, seed=seed)


def decode_step_inputs(cfg: DSAConfig, batch: int, context: int, device) -> tuple[tuple, int]:
    """One decode step of ``batch`` requests, each at position ``context`` with its own pages
    (token ids 0): ``((input_ids, positions, req_ids, slots, page_table), num_slots)``."""
    page = cfg.page_size
    pages_per_req = -(-(context + 1) // page)
    page_table = torch.arange(batch * pages_per_req, dtype=torch.int32, device=device).view(batch, pages_per_req)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    req_ids = torch.arange(batch, dtype=torch.int64, device=device)
    slots = page_table[req_ids, positions // page].long() * page + positions % page
    input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
    return (input_ids, positions, req_ids, slots, page_table), batch * pages_per_req * page


def pad_rows(rows: dict[str, Tensor], pad_to: int) -> dict[str, Tensor]:
    """Append padding rows (token 0, position -1, request 0, slot -1) up to ``pad_to`` rows."""
    t = rows["slots"].shape[0]
    if t > pad_to:
        raise ValueError(f"step has {t} rows, more than pad_to={pad_to}; lower rows_per_step")
    fill = {"input_ids": 0, "positions": -1, "req_ids": 0, "slots": -1}
    return {k: torch.cat([v, v.new_full((pad_to - t,), fill[k])]) for k, v in rows.items()}


def generate(step_fn: StepFn, requests: RequestBatch, steps: int, rows_per_step: int | None = None,
             pad_to: int | None = None, device: str | torch.device | None = None) -> GenerationResult:
    """Run the schedule (module docstring) until every request generated ``steps`` tokens.

    ``rows_per_step`` caps the real rows of a step (default: ``pad_to``, else unlimited);
    ``pad_to`` pads every step to that many rows so a compiled step sees one static shape.
    Inputs go to ``device`` (default CPU); the page table is the same tensor every step.
    """
    if not 1 <= steps <= requests.max_new_tokens:
        raise ValueError(f"steps must be in [1, {requests.max_new_tokens}] (pages were sized for that), got {steps}")
    budget_cap = rows_per_step if rows_per_step is not None else pad_to
    if budget_cap is not None and budget_cap < 1:
        raise ValueError(f"rows_per_step/pad_to must be >= 1, got {budget_cap}")
    if pad_to is not None and rows_per_step is not None and rows_per_step > pad_to:
        raise ValueError(f"rows_per_step={rows_per_step} > pad_to={pad_to}")

    reqs = requests.requests
    prefilled = [0] * len(reqs)
    tokens: list[list[int]] = [[] for _ in reqs]
    page_table = requests.page_table.to(device) if device is not None else requests.page_table
    result = GenerationResult(tokens)
    step = 0
    while any(len(t) < steps for t in tokens):
        active = [r for r, q in enumerate(reqs) if q.start_step <= step and len(tokens[r]) < steps]
        if not active:  # nobody has started yet: jump to the next arrival
            step = min(q.start_step for r, q in enumerate(reqs) if len(tokens[r]) < steps)
            continue
        budget = budget_cap if budget_cap is not None else 1 << 62
        plan: dict[int, list[tuple[int, int]]] = {}  # request -> [(token, position)]
        for r in active:  # decode rows first
            if prefilled[r] == len(reqs[r].prompt) and budget > 0:
                plan[r] = [(tokens[r][-1], len(reqs[r].prompt) + len(tokens[r]) - 1)]
                budget -= 1
        for r in active:  # then prefill chunks, in request order
            q = reqs[r]
            if prefilled[r] < len(q.prompt) and budget > 0:
                n = min(q.prefill_chunk or len(q.prompt), len(q.prompt) - prefilled[r], budget)
                plan[r] = [(q.prompt[p], p) for p in range(prefilled[r], prefilled[r] + n)]
                prefilled[r] += n
                budget -= n

        row_meta = [(r, pos) for r in sorted(plan) for _, pos in plan[r]]
        rows = {
            "input_ids": torch.tensor([tok for r in sorted(plan) for tok, _ in plan[r]], dtype=torch.int64),
            "positions": torch.tensor([pos for _, pos in row_meta], dtype=torch.int64),
            "req_ids": torch.tensor([r for r, _ in row_meta], dtype=torch.int64),
            "slots": torch.tensor([requests.slot(r, pos) for r, pos in row_meta], dtype=torch.int64),
        }
        if pad_to is not None:
            rows = pad_rows(rows, pad_to)
        if device is not None:
            rows = {k: v.to(device) for k, v in rows.items()}
        logits = step_fn(rows["input_ids"], rows["positions"], rows["req_ids"], rows["slots"], page_table)
        logits = logits[: len(row_meta)].detach().float().cpu()

        result.step_logits.append(logits)
        result.step_rows.append(row_meta)
        last = {r: i for i, (r, _) in enumerate(row_meta)}
        for r, i in last.items():
            if prefilled[r] == len(reqs[r].prompt):  # a decode row, or the chunk that ends the prompt
                tokens[r].append(int(logits[i].argmax()))
        step += 1
    return result
