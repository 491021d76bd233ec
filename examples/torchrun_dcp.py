"""Decode context parallelism across the GPUs of one host, one process per GPU, under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_dcp.py                 # 2 GPUs, NCCL
    torchrun --standalone --nproc-per-node 4 examples/torchrun_dcp.py --merge ag_rs
    torchrun --standalone --nproc-per-node 2 examples/torchrun_dcp.py --device cpu    # no GPU: gloo

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address;
``dsa_dcp.launch.init_from_env`` joins the default process group (NCCL, one GPU per local rank;
gloo with ``--device cpu``). Every rank builds the model with its share of the KV cache and
compiles the step with ``dcp_size=WORLD_SIZE``; rank 0 also runs the single-rank model eagerly
and prints whether every token agrees. On a GPU the step is replayed from CUDA graphs.
"""

import argparse
import os

import torch
import torch.distributed as dist

import dsa_dcp
from dsa_dcp.launch import init_from_env
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--merge", default="a2a", choices=["ag", "a2a", "ag_rs", "fused_a2a"])
    parser.add_argument("--model", default="glm5.2-tiny")
    parser.add_argument("--layers", type=int, default=4, help="layers to build (0: the config's own count)")
    parser.add_argument("--steps", type=int, default=4, help="tokens to generate per request")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    # a collective that waits longer than this fails the run instead of hanging it
    rank, world = init_from_env("nccl" if on_gpu else "gloo", timeout=300)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")

    cfg = get_config(args.model, **({"n_layers": args.layers} if args.layers else {}))
    batch = standard_test_batch(cfg, max_new_tokens=args.steps)  # the same requests on every rank
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, device=device, seed=0)  # 1/N of the KV cache
    step = dsa_dcp.compile(model, dcp_size=world, merge=args.merge)
    with torch.no_grad():
        out = generate(step, batch, args.steps, pad_to=16, device=device)
        if rank == 0:
            single = DSAModel(cfg, batch.num_slots, device=device, seed=0)  # the whole cache, eager
            ref = generate(single, batch, args.steps, pad_to=16, device=device)
            diff = max((a - b).abs().max().item() for a, b in zip(out.step_logits, ref.step_logits))
            print(f"{cfg.name} over {world} ranks ({device.type}), merge={args.merge}: tokens match the single "
                  f"rank: {out.tokens == ref.tokens}, max |logit diff| {diff:.2e}", flush=True)
    ok = torch.tensor([rank != 0 or out.tokens == ref.tokens], dtype=torch.int32)
    dist.broadcast(ok, src=0)  # every rank exits with rank 0's verdict
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
