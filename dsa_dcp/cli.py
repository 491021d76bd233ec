"""``dsa-dcp``: demo (and, as they land, inspect and bench)."""

from __future__ import annotations

import argparse
import sys

from dsa_dcp.config import MERGE_MODES


def _demo(args: argparse.Namespace) -> int:
    from dsa_dcp.demo import DemoSpec, format_demo, run_demo

    spec = DemoSpec(model=args.model, layers=args.layers or None, dcp=args.dcp, merge=args.merge,
                    interleave=args.interleave, steps=args.steps, rows=args.rows, seed=args.seed)
    results = run_demo(spec)
    print(format_demo(results))
    ok = all(r.tokens_match for r in results)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa-dcp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the DCP program on N CPU ranks beside the single-rank model")
    demo.add_argument("--dcp", type=int, default=2, help="DCP group size (CPU processes over gloo)")
    demo.add_argument("--merge", choices=MERGE_MODES, default="a2a")
    demo.add_argument("--interleave", type=int, default=1)
    demo.add_argument("--model", default="glm5.2-tiny", help="a built-in config, e.g. glm5.2-tiny, deepseek-v3.2-tiny")
    demo.add_argument("--layers", type=int, default=8, help="layers to build (0 = the config's own count)")
    demo.add_argument("--steps", type=int, default=8, help="tokens to generate per request")
    demo.add_argument("--rows", type=int, default=16, help="rows per engine step (padded)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
