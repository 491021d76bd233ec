"""``dsa-dcp bench step --mtp K``: a speculative decoding round against the plain decode step.

A round of greedy speculative decoding with the MTP draft (``dsa_dcp.models.speculative``) is one
draft *extend* step (``B * (K + 1)`` MTP rows: the positions the last verify accepted), ``K - 1``
chained draft steps (``B`` MTP rows) and one verify step (``B * (K + 1)`` target rows), and it yields
``accept length`` tokens a request (1 to ``K + 1``). The plain step yields one. So the time per
accepted token is ``round / accept length``, against ``plain step / 1``; the round pays off when the
accept length exceeds ``round / plain step`` (``breakeven_accept_length``). Random weights accept
almost nothing, so the accept length is not measured here: the rows give the time per token at
every accept length from 1 to ``K + 1`` (a trained checkpoint's accept length picks the column;
the reference serving numbers quote 4.05 for GLM-5.3 with 6 draft tokens).

Every step is compiled by the ``dsa_dcp`` backend at ``dcp_size = 1`` with the options a
speculative server uses (``replicated_modules=["mtp"]``, ``draft_length=K``; the plain step
without ``draft_length``), on caches filled with random values, every request at ``context``
tokens.
"""

from __future__ import annotations

from typing import Callable

import torch


def speculative_inputs(cfg, batch: int, context: int, k: int, device) -> tuple[dict[str, tuple], int]:
    """Step inputs of each step kind for ``batch`` requests at ``context`` cached tokens: ``plain``
    and ``chain`` (one row a request), ``verify`` and ``extend`` (``k + 1`` rows a request, positions
    ``context .. context + k``); and the slot pool's size."""
    page = cfg.page_size
    pages = -(-(context + k + 1) // page)
    page_table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)

    def rows(offsets) -> tuple:
        req_ids = torch.tensor([r for r in range(batch) for _ in offsets], dtype=torch.int64, device=device)
        positions = torch.tensor([context + o for _ in range(batch) for o in offsets], dtype=torch.int64,
                                 device=device)
        slots = page_table[req_ids, positions // page].long() * page + positions % page
        return torch.zeros_like(positions), positions, req_ids, slots, page_table

    one, all_rows = rows([0]), rows(range(k + 1))
    return {"plain": one, "chain": one, "verify": all_rows, "extend": all_rows}, batch * pages * page


def speculative_round_us(model: torch.nn.Module, cfg, batch: int, context: int, k: int,
                         timer: Callable[[Callable[[], object]], float], options: dict | None = None) -> dict:
    """The step times (us, by ``timer``) of a speculative round and of the plain step, on ``model``
    (a ``DSAModel`` with an MTP layer whose caches hold ``context`` tokens a request)."""
    device = model.embed.device
    inputs, _ = speculative_inputs(cfg, batch, context, k, device)
    base = dict(options or {})
    spec_options = {**base, "batch_sizes": sorted({batch, batch * (k + 1)}), "replicated_modules": ["mtp"],
                    "draft_length": k}
    plain = torch.compile(model, backend="dsa_dcp", options={**base, "batch_sizes": [batch]}, fullgraph=True,
                          dynamic=False)
    target = torch.compile(model, backend="dsa_dcp", options=spec_options, fullgraph=True, dynamic=False)
    draft = torch.compile(model.draft, backend="dsa_dcp", options=spec_options, fullgraph=True, dynamic=False)
    hidden = {kind: torch.randn(args[0].shape[0], cfg.hidden_size, device=device, dtype=model.embed.dtype)
              for kind, args in inputs.items()}
    with torch.no_grad():
        steps = {
            "plain": lambda: plain(*inputs["plain"]),
            "verify": lambda: target(*inputs["verify"], return_hidden=True),
            "extend": lambda: draft(*inputs["extend"], hidden["extend"]),
            "chain": lambda: draft(*inputs["chain"], hidden["chain"]),
        }
        us = {name: timer(step) for name, step in steps.items()}
    round_us = us["extend"] + (k - 1) * us["chain"] + us["verify"]
    row = {"mtp_k": k, "plain_step_us": us["plain"], "verify_us": us["verify"], "draft_extend_us": us["extend"],
           "draft_chain_us": us["chain"], "round_us": round_us, "breakeven_accept_length": round_us / us["plain"]}
    row |= {f"us_per_token_at_accept_{a}": round_us / a for a in range(1, k + 2)}
    return row


def format_speculative_table(rows: list[dict]) -> str:
    k = rows[0]["mtp_k"]
    accepts = list(range(1, k + 2))
    lines = ["| batch | K | plain step us | verify us | draft extend us | draft chain us | round us | breakeven accept "
             "length | " + " | ".join(f"us/token at accept {a}" for a in accepts) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(accepts)]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['mtp_k']} | {r['plain_step_us']:,.0f} | {r['verify_us']:,.0f} | "
                     f"{r['draft_extend_us']:,.0f} | {r['draft_chain_us']:,.0f} | {r['round_us']:,.0f} | "
                     f"{r['breakeven_accept_length']:.2f} | "
                     + " | ".join(f"{r[f'us_per_token_at_accept_{a}']:,.0f}" for a in accepts) + " |")
    return "\n".join(lines)
