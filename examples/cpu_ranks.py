"""Decode context parallelism on N CPU ranks (gloo), in one command: no GPU, no torchrun.

    python examples/cpu_ranks.py                    # 2 ranks, merge a2a
    python examples/cpu_ranks.py --ranks 4 --merge ag_rs --layers 2 --steps 2

Each rank holds 1/N of every request's KV cache (``DSAModel(..., dcp_size=N)`` allocates the
rank's share) and runs the step compiled with ``dcp_size=N``; rank 0 also runs the single-rank
model eagerly and checks that every token agrees. On GPUs, use ``examples/torchrun_dcp.py``.
"""

import argparse

import torch

import dsa_dcp
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch


def rank_main(rank, world, model_name, layers, steps, merge):
    """Runs in each rank's process, after the gloo process group of ``world`` ranks is up."""
    cfg = get_config(model_name, **({"n_layers": layers} if layers else {}))
    batch = standard_test_batch(cfg, max_new_tokens=steps)  # the same requests on every rank
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=0)  # this rank's 1/N of the KV cache
    step = dsa_dcp.compile(model, dcp_size=world, merge=merge)
    with torch.no_grad():
        out = generate(step, batch, steps, pad_to=16)
        if rank != 0:
            return None
        single = DSAModel(cfg, batch.num_slots, seed=0)  # the whole cache, one rank, eager
        ref = generate(single, batch, steps, pad_to=16)
    diff = max((a - b).abs().max().item() for a, b in zip(out.step_logits, ref.step_logits))
    return {"tokens_match": out.tokens == ref.tokens, "max_logit_diff": diff,
            "kv_rows_per_rank": model.kv_rows, "kv_rows_single": single.kv_rows,
            "summary": dsa_dcp.backend_report().summary}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--merge", default="a2a", choices=["ag", "a2a", "ag_rs", "fused_a2a"])
    parser.add_argument("--model", default="glm5.2-tiny")
    parser.add_argument("--layers", type=int, default=4, help="layers to build (0: the config's own count)")
    parser.add_argument("--steps", type=int, default=4, help="tokens to generate per request")
    args = parser.parse_args(argv)
    # run_on_ranks starts one process per rank (each imports this file again, which is
    # why everything that runs here sits under `if __name__ == "__main__":` below) and returns
    # rank_main's results in rank order; a rank that fails raises RankError with its traceback.
    results = run_on_ranks(rank_main, args.ranks, args.model, args.layers, args.steps, args.merge)
    r0 = results[0]
    print(f"{args.model} over {args.ranks} CPU ranks, merge={args.merge}: tokens match the single rank: "
          f"{r0['tokens_match']}, max |logit diff| {r0['max_logit_diff']:.2e}, KV rows per rank "
          f"{r0['kv_rows_per_rank']} of {r0['kv_rows_single']}")
    print("per step on rank 0:", r0["summary"])
    return 0 if r0["tokens_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
