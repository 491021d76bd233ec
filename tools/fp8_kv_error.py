"""The logit error FP8 KV costs: the reference model with FP8 caches against the same model (same
weights, fp32 compute) with full-precision caches, fed the same inputs every step.

    PYTHONPATH=. python tools/fp8_kv_error.py [--families deepseek-v3.2-tiny glm5.2-tiny] [--steps 16]

Both models run the standard test batch (prefill and decode); the full-precision model chooses the
tokens and the FP8 model is fed the same rows (teacher forcing), so every step's logits compare
one to one. Prints, per FP8 form, the largest |logit difference|, that over the largest |logit|,
and the largest per-step relative norm ``||a - b|| / ||b||``; the bf16-KV row (the caches rounded to
bf16, compute in fp32) is the yardstick: how far the same model moves for a smaller perturbation of
the same rows.
"""

from __future__ import annotations

import argparse

import torch

from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

FORMS = {
    "bf16 KV (yardstick)": dict(kv_dtype="bf16"),
    "fp8 KV, per-tensor scale 1.0": dict(kv_dtype="fp8"),
    "fp8 KV, per-128 scales": dict(kv_dtype="fp8", kv_scales="block"),
    "fp8 KV + fp8 index keys": dict(kv_dtype="fp8", index_key_dtype="fp8"),
}


def measure(family: str, form: dict, steps: int, layers: int | None) -> dict:
    over = {"n_layers": layers} if layers else {}
    ref_cfg = get_config(family, **over)
    cfg = get_config(family, **over, **form)
    batch = standard_test_batch(ref_cfg, max_new_tokens=steps, seed=7)
    ref = DSAModel(ref_cfg, batch.num_slots, seed=11)
    fp8 = DSAModel(cfg, batch.num_slots, seed=11)
    pairs = []

    def both(*inputs):
        a = ref(*inputs)
        pairs.append((fp8(*inputs), a))
        return a

    with torch.no_grad():
        generate(both, batch, steps)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    scale = max(b.abs().max().item() for _, b in pairs)
    norm = max(((a - b).norm() / b.norm()).item() for a, b in pairs)
    same_top = sum(bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in pairs)
    return {"max_abs": diff, "max_abs_over_max": diff / scale, "max_rel_norm": norm,
            "steps_same_argmax": f"{same_top}/{len(pairs)}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["deepseek-v3.2-tiny", "glm5.2-tiny"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="truncate the model (default: all its layers)")
    args = parser.parse_args()
    print(f"{'family':20} {'form':32} {'max |a-b|':>10} {'/ max |b|':>10} {'rel norm':>10} {'same argmax':>12}")
    for family in args.families:
        for name, form in FORMS.items():
            r = measure(family, form, args.steps, args.layers)
            print(f"{family:20} {name:32} {r['max_abs']:10.4f} {r['max_abs_over_max']:10.4f} "
                  f"{r['max_rel_norm']:10.4f} {r['steps_same_argmax']:>12}")


if __name__ == "__main__":
    main()
