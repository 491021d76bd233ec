"""A Hugging Face transformers DSA model (GLM-5's or DeepSeek-V3.2's architecture) under decode
context parallelism on N CPU ranks, unmodified: a DCP-aware static cache, the model compiled in
place with ``backend="dsa_dcp"``, and ``model.generate`` as usual.

    python examples/transformers_dcp.py                     # GLM-5-shaped tiny model, 2 ranks
    python examples/transformers_dcp.py --model deepseek_v32 --ranks 3 --merge ag

The model is a tiny random one (``dsa_dcp.integrations.transformers.tiny_model``); with real
weights, load the model with ``from_pretrained`` on each rank instead. Rank 0 also generates with
the single-rank model and checks every token. Needs ``pip install -e ".[hf]"``.
"""

import argparse

import torch

from dsa_dcp.launch import run_on_ranks

PROMPT_LENS = (3, 5, 7)  # three requests of different lengths, left-padded as generate expects


def generate(model, dcp_size: int, new_tokens: int):
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts

    ids, mask = left_padded_prompts(PROMPT_LENS, model.config.vocab_size)
    # every rank allocates 1/N of the K/V positions; the indexer's keys stay whole on every rank
    cache = DCPStaticCache(model.config, max_cache_len=12, batch_size=len(PROMPT_LENS), dcp_size=dcp_size)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def rank_main(rank, world, model_type, merge, new_tokens):
    from dsa_dcp.integrations.transformers import tiny_model

    model = tiny_model(model_type, layers=2)  # the same weights on every rank (seeded)
    # in place: generate() calls the model itself, so a torch.compile wrapper would not be used
    model.compile(backend="dsa_dcp", options={"dcp_size": world, "merge": merge}, fullgraph=True)
    tokens = generate(model, world, new_tokens)
    if rank != 0:
        return None
    single = generate(tiny_model(model_type, layers=2), 1, new_tokens)  # one rank, eager, the whole cache
    return {"tokens": tokens, "single": single}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm_moe_dsa", choices=["glm_moe_dsa", "deepseek_v32"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--merge", default="a2a", choices=["ag", "a2a", "ag_rs", "fused_a2a"])
    parser.add_argument("--tokens", type=int, default=3, help="tokens to generate per request")
    args = parser.parse_args(argv)
    # run_on_ranks starts one process per rank, each importing this file again: keep the work
    # under `if __name__ == "__main__":`
    r0 = run_on_ranks(rank_main, args.ranks, args.model, args.merge, args.tokens)[0]
    print(f"{args.model} over {args.ranks} CPU ranks, merge={args.merge}: tokens match the single rank: "
          f"{r0['tokens'] == r0['single']} ({r0['tokens']})")
    return 0 if r0["tokens"] == r0["single"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
