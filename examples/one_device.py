"""One device, no context parallelism: compile a DSA model with the dsa_dcp backend.

    python examples/one_device.py                   # the GPU if there is one, else the CPU
    python examples/one_device.py --device cpu --layers 2 --steps 2

With ``dcp_size=1`` (the default) the backend keeps the graph as written and lowers it: on a GPU
the step is replayed from CUDA graphs, one per row bucket (``docs/lowering.md``). The script
generates greedily with the compiled step and with the model run eagerly, and checks that they
agree. Replace ``DSAModel`` by your model: its decode step must call the ``dsa_dcp`` ops or a
function decorated with ``@dsa_dcp.sparse_attention`` (``docs/ops.md``).
"""

import argparse

import torch

import dsa_dcp
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--model", default="glm5.2-tiny", help="a built-in config (dsa_dcp.models.CONFIGS)")
    parser.add_argument("--layers", type=int, default=4, help="layers to build (0: the config's own count)")
    parser.add_argument("--steps", type=int, default=4, help="tokens to generate per request")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    cfg = get_config(args.model, **({"n_layers": args.layers} if args.layers else {}))
    # four requests of different lengths; an engine step mixes prefill chunks and decode rows
    batch = standard_test_batch(cfg, max_new_tokens=args.steps)
    model = DSAModel(cfg, batch.num_slots, device=device, seed=0)
    step = dsa_dcp.compile(model)  # options are checked here: dsa_dcp.compile(model, merge="x") fails at once

    # The backend compiles inference steps: run it under no_grad (or inference_mode).
    with torch.no_grad():
        # generate() calls step(input_ids, positions, req_ids, slots, page_table) -> logits per
        # engine step, rows padded to 16 so every step has one shape (one compilation)
        compiled = generate(step, batch, args.steps, pad_to=16, device=device)
        model.reset_caches()
        eager = generate(model, batch, args.steps, pad_to=16, device=device)

    diff = max((a - b).abs().max().item() for a, b in zip(compiled.step_logits, eager.step_logits))
    print(f"{cfg.name} ({cfg.n_layers} layers) on {device}: {sum(map(len, compiled.tokens))} tokens, "
          f"match eager: {compiled.tokens == eager.tokens}, max |logit diff| {diff:.2e}")
    print("per step:", dsa_dcp.backend_report().summary)
    return 0 if compiled.tokens == eager.tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
