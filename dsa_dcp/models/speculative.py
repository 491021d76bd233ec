"""Greedy speculative decoding with the MTP draft: draft a chain of k tokens, verify them in one step.

``generate_speculative(target, draft, requests, steps, draft_length=k)`` drives a ``DSAModel`` with
an MTP layer (``mtp_layers=1``), eager, compiled, or a DCP program, through rounds of

1. **draft**: k chained MTP steps (top-k 1). The first is the *extend* step: one MTP row for each
   position the last verify step accepted (each with the target's hidden state there), so the MTP
   cache holds rows computed from the target's hidden states at every accepted position; its last
   row drafts the first token. Each further step is one row a request, fed the token and hidden
   state the step before drafted.
2. **verify**: one target step of ``k + 1`` rows a request at positions ``n .. n + k``: the last
   accepted token ``x_n`` and the k drafted ones. The model writes every row's KV before it
   attends, and each row's indexer and attention see the positions up to its own, so row ``j``
   has its own top-k over a causal view of the drafted positions before it.
3. **accept**: the drafted tokens that equal the target's greedy tokens, from the first on
   (``a`` of them), then the target's token after them: ``a + 1`` new tokens a round (the accept
   length). **Rollback**: the request's length becomes ``n + a + 1``; the KV rows the rejected
   positions wrote (target and MTP) stay in their slots, unread: every later row reads positions up
   to its own, and the step that reaches a position writes its slot before any row reads it.

Row layout (MTP convention, as DeepSeek-V3's MTP is served): the MTP row at position ``p`` holds
the token at ``p + 1`` and the target's hidden state at ``p``, writes the MTP cache at the slot of
``p`` and predicts the token at ``p + 2``. Prefill runs every prompt in chunks, a target step and
then an MTP step over the same positions (tokens shifted by one), so the first draft comes from the
prefill's last MTP row.

Every target step (prefill chunk or verify) has ``B * (k + 1)`` rows (B requests; padding rows:
token 0, position -1, request 0, slot -1), so a compiled target is one graph and each step's row
count is a multiple of ``k + 1`` (``draft_length`` compile option). MTP steps have ``B * (k + 1)``
rows (prefill, extend) or ``B`` rows (the chain). Every request starts at once (``start_step`` is
not used); each is prefilled in chunks of its ``prefill_chunk`` (whole prompt when ``None``) within
the step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .runner import RequestBatch, pad_rows

__all__ = ["SpeculativeResult", "generate_speculative"]

TargetFn = Callable[..., tuple[Tensor, Tensor]]
"""``target(input_ids, positions, req_ids, slots, page_table, return_hidden=True) -> (logits, hidden)``."""
DraftFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``draft(input_ids, positions, req_ids, slots, page_table, hidden) -> (logits, hidden)`` (``DSAModel.draft``)."""


@dataclass
class SpeculativeResult:
    """``tokens[r]``: the ``steps`` greedy tokens request r generated. Per request and verify round:
    ``drafts[r][i]`` the k drafted tokens, ``accepted[r][i]`` how many of them the target accepted.
    ``target_logits[i]``: the real rows' logits of target step i (prefill chunks and verify steps,
    fp32, CPU), ``target_rows[i]`` their ``(request, position)``."""

    tokens: list[list[int]]
    drafts: list[list[list[int]]]
    accepted: list[list[int]]
    target_logits: list[Tensor] = field(default_factory=list)
    target_rows: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def verify_steps(self) -> int:
        return max((len(a) for a in self.accepted), default=0)

    @property
    def accept_length(self) -> float:
        """Mean tokens a verify row-set yields, the target's own token included (``a + 1``), over
        every request's rounds: 1 when no draft is accepted, ``k + 1`` when every one is."""
        rounds = [a + 1 for per_request in self.accepted for a in per_request]
        return sum(rounds) / len(rounds) if rounds else 0.0


def _rows(requests: RequestBatch, rows: list[tuple[int, int, int]], pad_to: int, device) -> dict[str, Tensor]:
    """``(request, position, token)`` rows as step inputs, padded to ``pad_to`` rows."""
    out = {
        "input_ids": torch.tensor([t for _, _, t in rows], dtype=torch.int64),
        "positions": torch.tensor([p for _, p, _ in rows], dtype=torch.int64),
        "req_ids": torch.tensor([r for r, _, _ in rows], dtype=torch.int64),
        "slots": torch.tensor([requests.slot(r, p) for r, p, _ in rows], dtype=torch.int64),
    }
    out = pad_rows(out, pad_to)
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def _args(rows: dict[str, Tensor], page_table: Tensor) -> tuple[Tensor, ...]:
    return rows["input_ids"], rows["positions"], rows["req_ids"], rows["slots"], page_table


def _pad_hidden(hidden: list[Tensor], pad_to: int, like: Tensor) -> Tensor:
    out = like.new_zeros(pad_to, like.shape[-1])
    if hidden:
        out[: len(hidden)] = torch.stack(hidden)
    return out


def generate_speculative(target: TargetFn, draft: DraftFn, requests: RequestBatch, steps: int, draft_length: int,
                         device: str | torch.device | None = None) -> SpeculativeResult:
    """Greedy speculative decoding (module docstring) until every request has ``steps`` tokens."""
    k = draft_length
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"draft_length must be an int >= 1, got {k!r}")
    if steps < 1 or requests.max_new_tokens < steps + k:
        raise ValueError(f"steps must be >= 1 and the pages must hold steps + draft_length = {steps + k} new "
                         f"positions (a verify step writes k positions past the last accepted token); "
                         f"got steps={steps}, max_new_tokens={requests.max_new_tokens}")
    reqs = requests.requests
    b = len(reqs)
    rows_per_step = b * (k + 1)
    page_table = requests.page_table.to(device) if device is not None else requests.page_table
    tokens: list[list[int]] = [[] for _ in reqs]
    result = SpeculativeResult(tokens, [[] for _ in reqs], [[] for _ in reqs])
    chain: list[tuple[int, Tensor]] = [None] * b  # each request's last draft: (token, its hidden state)

    def run_target(rows: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
        logits, hidden = target(*_args(_rows(requests, rows, rows_per_step, device), page_table), return_hidden=True)
        logits = logits[: len(rows)].detach().float().cpu()
        result.target_logits.append(logits)
        result.target_rows.append([(r, p) for r, p, _ in rows])
        return logits, hidden[: len(rows)].detach()

    def run_draft(rows: list[tuple[int, int, int]], hidden: list[Tensor], pad_to: int) -> tuple[Tensor, Tensor]:
        inputs = _rows(requests, rows, pad_to, device)
        logits, out = draft(*_args(inputs, page_table), _pad_hidden(hidden, pad_to, hidden[0]))
        return logits[: len(rows)].detach().float().cpu(), out[: len(rows)].detach()

    def extend(rows: list[tuple[int, int, int]], hidden: list[Tensor]) -> None:
        """An MTP step over target rows (token at p + 1, target hidden at p); each request's last row drafts."""
        logits, out = run_draft(rows, hidden, rows_per_step)
        last = {r: i for i, (r, _, _) in enumerate(rows)}
        for r, i in last.items():
            if rows[i][1] == len(reqs[r].prompt) + len(tokens[r]) - 2:  # the row of the last known token
                chain[r] = (int(logits[i].argmax()), out[i])

    # prefill: chunks of the prompts, a target step then an MTP step over the same positions
    prefilled = [0] * b
    while any(prefilled[r] < len(q.prompt) for r, q in enumerate(reqs)):
        budget, plan = rows_per_step, []
        for r, q in enumerate(reqs):
            n = min(q.prefill_chunk or len(q.prompt), len(q.prompt) - prefilled[r], budget)
            if n > 0:
                plan += [(r, p, q.prompt[p]) for p in range(prefilled[r], prefilled[r] + n)]
                prefilled[r] += n
                budget -= n
        logits, hidden = run_target(plan)
        shifted = []
        for i, (r, p, _) in enumerate(plan):
            prompt = reqs[r].prompt
            if p == len(prompt) - 1:
                tokens[r].append(int(logits[i].argmax()))
            shifted.append((r, p, prompt[p + 1] if p + 1 < len(prompt) else tokens[r][0]))
        extend(shifted, list(hidden))

    while any(len(t) < steps for t in tokens):
        active = [r for r in range(b) if len(tokens[r]) < steps]
        start = {r: len(reqs[r].prompt) + len(tokens[r]) - 1 for r in active}  # position n of x_n
        drafted = {r: [chain[r][0]] for r in active}
        for i in range(1, k):  # the chain: one row a request at position n + i - 1
            rows = [(r, start[r] + i - 1, drafted[r][-1]) for r in active]
            logits, out = run_draft(rows, [chain[r][1] for r in active], b)
            for j, r in enumerate(active):
                drafted[r].append(int(logits[j].argmax()))
                chain[r] = (drafted[r][-1], out[j])
        rows = [(r, start[r] + j, ([tokens[r][-1]] + drafted[r])[j]) for r in active for j in range(k + 1)]
        logits, hidden = run_target(rows)
        accepted_rows, accepted_hidden = [], []
        for idx, r in enumerate(active):
            greedy = [int(logits[idx * (k + 1) + j].argmax()) for j in range(k + 1)]
            a = 0
            while a < k and drafted[r][a] == greedy[a]:
                a += 1
            result.drafts[r].append(drafted[r])
            result.accepted[r].append(a)
            new = greedy[: a + 1]  # the accepted drafts equal the target's tokens, then its next one
            tokens[r].extend(new)
            # the next extend step: MTP rows at positions n .. n + a with the target's hidden states
            accepted_rows += [(r, start[r] + j, new[j]) for j in range(a + 1)]
            accepted_hidden += [hidden[idx * (k + 1) + j] for j in range(a + 1)]
        still = [i for i, (r, _, _) in enumerate(accepted_rows) if len(tokens[r]) < steps]
        if still:
            extend([accepted_rows[i] for i in still], [accepted_hidden[i] for i in still])
    for r in range(b):
        del tokens[r][steps:]
    return result
