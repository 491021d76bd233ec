"""``dsa-dcp demo``: the DCP program on N CPU ranks beside the single-rank model.

Every rank builds the same tiny model from one seed: once as written (single rank, eager, global
KV cache) and once with a KV cache of ``ceil(S/N)`` rows compiled with ``backend="dsa_dcp"``.
Both generate greedily over the same batch of requests (different lengths, extend and decode rows
mixed); rank 0 reports whether every token matches, the largest logit difference, KV bytes per
token per rank, and what the compiled step does (remaps, before and after sharing, merges, collectives).
While it runs, rank 0 prints a line per stage with the time since the start (stderr).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dsa_dcp.config import MERGE_MODES
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.progress import Progress

HEAD_SHARDED_MERGES = ("a2a", "ag_rs", "fused_a2a")  # their epilogue splits the heads over the group


@dataclasses.dataclass(frozen=True)
class DemoSpec:
    model: str = "glm5.2-tiny"
    layers: int | None = 8
    dcp: int = 2
    merge: str = "a2a"
    interleave: int = 1
    steps: int = 8
    rows: int = 16
    seed: int = 0

    def problems(self) -> list[str]:
        """What is wrong with this spec, each with the valid values (checked before any rank starts)."""
        from dsa_dcp.models import ALIASES, CONFIGS

        names = sorted(CONFIGS) + sorted(ALIASES)
        p = []
        for name, low in (("dcp", 1), ("interleave", 1), ("steps", 1), ("rows", 1), ("layers", 0)):
            value = getattr(self, name)
            if name == "layers" and value is None:
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                p.append(f"--{name} must be an integer >= {low}, got {value!r}")
        if self.merge not in MERGE_MODES:
            p.append(f"--merge must be one of {', '.join(MERGE_MODES)}; got {self.merge!r}")
        if self.model not in names:
            p.append(f"--model {self.model!r} is not a built-in config; valid: {', '.join(names)}")
        elif not p and self.merge in HEAD_SHARDED_MERGES:
            from dsa_dcp.models import get_config

            heads = get_config(self.model).n_heads
            if heads % self.dcp:
                sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
                p.append(f"--dcp {self.dcp} with --merge {self.merge}: {self.model} has {heads} attention heads, "
                         f"which this merge splits evenly over the group; valid --dcp: {sizes} (or --merge ag)")
        return p


@dataclasses.dataclass
class DemoResult:
    spec: DemoSpec
    tokens_match: bool
    max_logit_diff: float
    max_logit: float
    kv_bytes_per_token_single: float
    kv_bytes_per_token_rank: float
    index_bytes_per_token: float
    summary: dict
    compile_s: float
    steps_run: int
    tokens: list
    remaps_before_sharing: int | None = None  # topk_remap nodes before share_remaps (None: pass not run)


class _FirstCallReported:
    """A step function that reports once its first call (the compilation) has returned."""

    def __init__(self, step, progress: Progress):
        self.step, self.progress, self.called = step, progress, False

    def __call__(self, *args):
        out = self.step(*args)
        if not self.called:
            self.called = True
            self.progress("compiled (the first DCP step ran)")
        return out


def _demo_rank(rank: int, world: int, spec: DemoSpec, progress: Progress | None = None) -> DemoResult:
    import dsa_dcp
    from dsa_dcp.backend import last_report
    from dsa_dcp.kv_cache import bytes_per_token
    from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

    progress = (progress or Progress(enabled=False)).child(f"rank {rank}: ", enabled=rank == 0)
    progress(f"joined the process group of {world}")
    overrides = {"n_layers": spec.layers} if spec.layers else {}
    cfg = get_config(spec.model, **overrides)
    batch = standard_test_batch(cfg, max_new_tokens=spec.steps, seed=spec.seed)
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        single = DSAModel(cfg, batch.num_slots, seed=spec.seed)
        ref = generate(single, batch, spec.steps, pad_to=spec.rows)
        progress(f"single-rank reference generated ({len(ref.step_logits)} engine steps, eager)")
        model = DSAModel(cfg, batch.num_slots, dcp_size=world, interleave=spec.interleave, seed=spec.seed)
        step = dsa_dcp.compile(model, dcp_size=world, merge=spec.merge, interleave=spec.interleave)
        t0 = time.perf_counter()
        out = generate(_FirstCallReported(step, progress), batch, spec.steps, pad_to=spec.rows)
        compile_s = time.perf_counter() - t0
        progress(f"DCP steps done ({len(out.step_logits)} engine steps)")
    diff = max((a - b).abs().max().item() for a, b in zip(ref.step_logits, out.step_logits))
    peak = max(a.abs().max().item() for a in ref.step_logits)
    report = last_report()
    return DemoResult(
        spec=spec,
        tokens_match=ref.tokens == out.tokens,
        max_logit_diff=diff,
        max_logit=peak,
        kv_bytes_per_token_single=bytes_per_token(single.kv_caches()),
        kv_bytes_per_token_rank=bytes_per_token(model.kv_caches()),
        index_bytes_per_token=bytes_per_token(list(model.index_caches().values())),
        summary=dict(report.summary) if report else {},
        compile_s=compile_s,
        steps_run=len(out.step_logits),
        tokens=out.tokens,
        remaps_before_sharing=report.stats().get("share_remaps", {}).get("remaps_before") if report else None,
    )


def run_demo(spec: DemoSpec, progress: Progress | None = None) -> list[DemoResult]:
    """Run the demo on ``spec.dcp`` gloo ranks; ``ValueError`` (before any rank starts) for a bad spec."""
    problems = spec.problems()
    if problems:
        raise ValueError("; ".join(problems))
    progress = progress or Progress(enabled=False)
    progress(f"starting {spec.dcp} CPU rank(s) over gloo")
    results = run_on_ranks(_demo_rank, spec.dcp, spec, progress)
    progress("every rank finished")
    return results


def format_demo(results: list[DemoResult]) -> str:
    r0 = results[0]
    s = r0.spec
    ok = all(r.tokens_match for r in results) and all(r.tokens == r0.tokens for r in results)
    lines = [
        f"dsa-dcp demo: {s.model} ({s.layers or 'all'} layers), DCP over {s.dcp} CPU ranks (gloo), merge={s.merge}, "
        f"interleave={s.interleave}",
        f"  engine steps run            {r0.steps_run} (up to {s.rows} rows each, extend and decode rows mixed)",
        f"  tokens match single rank    {'yes' if ok else 'NO'} ({sum(len(t) for t in r0.tokens)} tokens, every rank)",
        f"  max |logit diff|            {max(r.max_logit_diff for r in results):.3e} (max |logit| {r0.max_logit:.2f})",
        f"  KV bytes/token, single rank {r0.kv_bytes_per_token_single:.0f}",
        f"  KV bytes/token, per rank    {r0.kv_bytes_per_token_rank:.0f} (+ {r0.index_bytes_per_token:.0f} of replicated index keys)",
    ]
    sm = r0.summary
    if sm:
        before = r0.remaps_before_sharing
        shared = f" ({before} before sharing)" if before is not None else ""
        lines += [
            f"  per step: {sm['sparse_attention_nodes']} sparse attention nodes, {sm['remaps']} remaps{shared}, "
            f"{sm['merges']} merges, {sm['collectives']} collectives, {sm['kv_writes']} KV writes",
        ]
    lines.append(f"  compile + generate          {r0.compile_s:.1f} s")
    return "\n".join(lines)
