"""``dsa-dcp``: demo, inspect and bench (also ``python -m dsa_dcp``).

Arguments are checked before any work starts (no rank is spawned for a bad one), and a refusal of
the compiler is printed once, in one message, however many ranks or layers hit it; long work
prints a line per stage with the time since the start on stderr (``--quiet`` turns them off).
Exit status: 0 done, 1 the demo's tokens differ, 2 bad arguments or a refusal.
"""

from __future__ import annotations

import argparse
import os
import sys

from dsa_dcp.config import MERGE_MODES


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _gpu(text: str) -> str:
    from dsa_dcp.inspection.capacity import GPUS

    if text.lower() in GPUS:
        return text.lower()
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(sorted(GPUS))} or a memory size in GB > 0, "
                                         f"got {text!r}")
    return text


# the capacity options (None when not given) and what each one needs --tp for
CAPACITY_ARGS = {"weight_dtype": "--weight-dtype", "gpu": "--gpu", "reserve_gb": "--reserve-gb",
                 "no_replicate_q": "--no-replicate-q", "capacity_only": "--capacity-only"}


def _capacity_options(args: argparse.Namespace) -> dict:
    """``capacity_plan`` keywords from the CLI's capacity options (their defaults where not given)."""
    from dsa_dcp.inspection.capacity import DEFAULT_GPU

    return {"weight_dtype": args.weight_dtype or "fp8", "replicate_q": not args.no_replicate_q,
            "gpu": args.gpu or DEFAULT_GPU, "reserve_gb": args.reserve_gb}


def _capacity_only(args: argparse.Namespace) -> int:
    """``--capacity-only``: the memory plan and the capacity, from the config; nothing compiled."""
    import json

    from dsa_dcp.inspection.capacity import LayoutError, capacity_plan
    from dsa_dcp.inspection.memory import memory_plan
    from dsa_dcp.inspection.render import capacity_lines

    try:
        cap = capacity_plan(args.target, args.tp, args.dcp, kv_dtype=args.kv_dtype, index_cache=args.index_cache,
                            **_capacity_options(args))
    except LayoutError as e:
        args.parser.error(str(e))
    mem = memory_plan(args.target, args.kv_dtype, args.dcp, slots=args.slots, gpu_mem_gib=args.gpu_mem,
                      interleave=args.interleave, index_cache=args.index_cache)
    if args.format == "json":
        print(json.dumps({"schema": CAPACITY_SCHEMA, "target": args.target, "memory": mem.as_dict(),
                          "capacity": cap.as_dict()}, sort_keys=True, indent=2))
        return 0
    rows = mem.rows()
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"dsa-dcp inspect {args.target} --capacity-only (from the config; nothing compiled or allocated)", "",
             "memory plan (from the config; nothing allocated)", *[f"  {k:<{width}}{v}" for k, v in rows], "",
             *capacity_lines(cap, compiled=False)]
    print("\n".join(lines))
    return 0


CAPACITY_SCHEMA = "dsa-dcp-capacity/1"


def _config_names() -> list[str]:
    from dsa_dcp.models import ALIASES, CONFIGS

    return sorted(CONFIGS) + sorted(ALIASES)


def _refusal(err: BaseException, command: str) -> int:
    """Print a refusal of the compiler in one message; exit status 2."""
    print(f"dsa-dcp {command}: {type(err).__name__}: {err}", file=sys.stderr)
    return 2


def _rank_refusals(err, command: str, world: int) -> int | None:
    """A ``RankError`` whose ranks refused: each distinct refusal once, with the ranks that hit it
    when not all did; ``None`` when no rank refused (a failure to show in full)."""
    from dsa_dcp.entry import dcp_errors

    ours = {f"{t.__module__}.{t.__qualname__}" for t in dcp_errors()}
    refused = {r: exc for r, exc in err.exceptions.items() if exc[0] in ours}
    if not refused:
        return None
    distinct: dict[tuple[str, str], list[int]] = {}
    for r, exc in sorted(refused.items()):
        distinct.setdefault(exc, []).append(r)
    lines = []
    for (qualname, message), ranks in distinct.items():
        who = "" if len(ranks) == world else f" (rank {', '.join(map(str, ranks))} of {world})"
        lines.append(f"dsa-dcp {command}: {qualname.rsplit('.', 1)[-1]}{who}: {message}")
    for r, state in sorted(err.ranks.items()):
        if r not in refused:
            lines.append(f"  rank {r} of {world}: {state}, stopped with the rank(s) that refused")
    print("\n".join(lines), file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    from dsa_dcp.demo import DemoSpec, format_demo, run_demo
    from dsa_dcp.launch import RankError
    from dsa_dcp.progress import Progress

    spec = DemoSpec(model=args.model, layers=args.layers or None, dcp=args.dcp, merge=args.merge,
                    interleave=args.interleave, steps=args.steps, rows=args.rows, seed=args.seed)
    problems = spec.problems()
    if problems:
        args.parser.error("; ".join(problems))
    try:
        results = run_demo(spec, Progress(enabled=not args.quiet))
    except RankError as e:
        status = _rank_refusals(e, "demo", spec.dcp)
        if status is None:
            raise
        return status
    print(format_demo(results))
    ok = all(r.tokens_match for r in results)
    return 0 if ok else 1


def _bench_step(args: argparse.Namespace) -> int:
    from dsa_dcp.bench.step import main as bench_step

    return _timed(args, "bench step", bench_step)


def _bench_hf(args: argparse.Namespace) -> int:
    from dsa_dcp.bench.hf import main as bench_hf

    return _timed(args, "bench hf", bench_hf)


def _timed(args: argparse.Namespace, name: str, run) -> int:
    from dsa_dcp.progress import Progress

    progress = Progress(f"{name}: ", enabled=not args.quiet)
    progress("started")
    status = run(args)
    progress("done")
    return status


def _inspect(args: argparse.Namespace) -> int:
    from dsa_dcp.entry import find_dcp_error
    from dsa_dcp.inspection import inspect_target
    from dsa_dcp.progress import Progress

    names = _config_names()
    if ":" not in args.target and args.target not in names:
        args.parser.error(f"TARGET {args.target!r} is neither a built-in config nor module:factory; "
                          f"built-in configs: {', '.join(names)}")
    given = [flag for key, flag in CAPACITY_ARGS.items() if getattr(args, key) not in (None, False)]
    if args.tp is None and given:
        args.parser.error(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --tp "
                          "(the TP size the capacity is computed for)")
    if args.tp is not None and args.target in names:
        from dsa_dcp.inspection.capacity import LayoutError, check_layout

        try:
            check_layout(args.target, args.tp, args.dcp)  # before anything is built
        except LayoutError as e:
            args.parser.error(str(e))
    if args.capacity_only:
        if args.target not in names:
            args.parser.error(f"--capacity-only needs a built-in config (nothing is built to find a config in), "
                              f"not {args.target!r}; built-in configs: {', '.join(names)}")
        if args.format == "html" or args.out:
            args.parser.error("--capacity-only prints text or json (nothing is compiled, so no report files)")
        return _capacity_only(args)
    from dsa_dcp.inspection.capacity import LayoutError

    capacity = {} if args.tp is None else {"tp_size": args.tp, **_capacity_options(args)}
    progress = Progress("inspect: ", enabled=not args.quiet)
    progress(f"compiling {args.target} for rank 0 of {args.dcp} (merge {args.merge}) in this process")
    try:
        inspection = inspect_target(args.target, dcp_size=args.dcp, merge=args.merge, interleave=args.interleave,
                                    kv_dtype=args.kv_dtype, slots=args.slots, gpu_mem_gib=args.gpu_mem,
                                    rows=args.rows, options={"index_cache": args.index_cache}, **capacity)
    except LayoutError as e:
        args.parser.error(str(e))
    except Exception as e:
        ours = find_dcp_error(e)
        if ours is None:
            raise
        return _refusal(ours, "inspect")
    progress("compiled and analysed")
    out = args.out or ("dsa-dcp-inspect" if args.format == "html" else None)
    paths = inspection.write(out) if out else {}
    if paths:
        progress(f"wrote {out}")
    if args.format == "json":
        print(inspection.to_json())
    elif args.format == "html":
        print(paths["html"])
    else:
        print(inspection.to_text())
    if paths and args.format != "json":
        print(f"\nwrote {', '.join(v for k, v in sorted(paths.items()) if not k.startswith('graph_'))} "
              f"and {sum(k.startswith('graph_') for k in paths)} graphs under {os.path.join(out, 'graphs')}",
              file=sys.stderr if args.format == "html" else sys.stdout)
    return 0


def _bench_merge(args: argparse.Namespace) -> int:
    from dsa_dcp.bench.merge import main as bench_merge

    return _timed(args, "bench merge", bench_merge)


def _bench_kernels(args: argparse.Namespace) -> int:
    from dsa_dcp.bench.kernels import main as bench_kernels

    return _timed(args, "bench kernels", bench_kernels)


def _bench_indexer(args: argparse.Namespace) -> int:
    from dsa_dcp.bench.indexer import main as bench_indexer

    return bench_indexer(args)


def main(argv: list[str] | None = None) -> int:
    from dsa_dcp import __version__

    parser = argparse.ArgumentParser(prog="dsa-dcp", description=__doc__.replace("``", "`"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dsa-dcp {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[common],
                          help="run the DCP program on N CPU ranks beside the single-rank model")
    demo.add_argument("--dcp", type=_at_least(1), default=2, help="DCP group size (CPU processes over gloo)")
    demo.add_argument("--merge", choices=MERGE_MODES, default="a2a")
    demo.add_argument("--interleave", type=_at_least(1), default=1)
    demo.add_argument("--model", default="glm5.2-tiny", metavar="NAME",
                      help=f"a built-in config: {', '.join(_config_names())}")
    demo.add_argument("--layers", type=_at_least(0), default=8, help="layers to build (0 = the config's own count)")
    demo.add_argument("--steps", type=_at_least(1), default=8, help="tokens to generate per request")
    demo.add_argument("--rows", type=_at_least(1), default=16, help="rows per engine step (padded)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo, parser=demo)

    bench = sub.add_parser("bench", help="measure speed on this machine's GPU")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    step = bench_sub.add_parser("step", parents=[common],
                                help="decode-step latency: eager, stock torch.compile, dsa_dcp (dcp_size 1)")
    step.add_argument("--layers", type=int, default=4)
    step.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    step.add_argument("--context", type=int, default=4096, help="cached tokens per request")
    step.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                      help="KV and index-key storage: bf16, or fp8 (E4M3 KV with a per-tensor scale, FP8 index keys "
                           "with a per-token scale)")
    step.add_argument("--mtp", type=_at_least(1), metavar="K",
                      help="also time a speculative round with the MTP draft of draft length K against the plain step")
    step.add_argument("--top-kernels", type=_at_least(1), default=0, metavar="N",
                      help="also list the N kernels of the dsa_dcp step with the most device time")
    step.add_argument("--json", help="also write the rows to this file")
    step.set_defaults(func=_bench_step)
    hf = bench_sub.add_parser("hf", parents=[common],
                              help="a transformers GLM-5-shaped model's decode token: eager, transformers' compiled "
                                   "static-cache decode, dsa_dcp (dcp_size 1)")
    hf.add_argument("--shapes", nargs="+", metavar="BATCHxPROMPT",
                    help="requests x cached positions (default 1x4096 8x4096 32x4096 1x16384 8x16384)")
    hf.add_argument("--layers", type=_at_least(1), default=4)
    hf.add_argument("--steps", type=_at_least(1), default=12, help="timed decode steps per variant")
    hf.add_argument("--json", help="also write the rows to this file")
    hf.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also print each variant's ROWS kernels with the most device time (stderr)")
    hf.set_defaults(func=_bench_hf)
    merge = bench_sub.add_parser("merge", parents=[common], help="fused a2a merge vs pack + exchange + combine (N ranks emulated on one GPU)")
    merge.add_argument("--dcp", type=int, nargs="+", default=[2, 4, 8])
    merge.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    merge.add_argument("--heads", type=int, default=64, help="attention heads H (each rank combines H/N)")
    merge.add_argument("--json", help="also write the rows to this file")
    merge.set_defaults(func=_bench_merge)
    kernels = bench_sub.add_parser("kernels", parents=[common], help="remap, combine and sparse MLA against torch eager and FlashInfer")
    kernels.add_argument("--json", help="also write the rows to this file")
    kernels.add_argument("--only", nargs="+", choices=["remap", "combine", "mla"], help="time only these kernels")
    kernels.add_argument("--kv", nargs="+", choices=["bf16", "fp8"], help="sparse_mla KV dtypes (default: both)")
    kernels.add_argument("--tune", action="store_true",
                         help="time sparse_mla tile candidates and backends per shape; print the dispatch table")
    kernels.add_argument("--write-table", metavar="PATH", help="with --tune: write the dispatch table here")
    kernels.add_argument("--update-table", metavar="PATH",
                         help="with --tune: replace the tuned shapes' entries in the table at PATH, keep the rest")
    kernels.add_argument("--heads", type=int, nargs="+", help="sparse_mla head counts (default 64 128)")
    kernels.add_argument("--batches", type=int, nargs="+", help="sparse_mla batch sizes (default 1 8 32 128)")
    kernels.add_argument("--ks", type=int, nargs="+",
                         help="sparse_mla top-k lengths (default 512 1024 2048; with --tune 512 2048)")
    kernels.add_argument("--candidates", choices=["all", "key-major", "dc-split", "hopper"],
                         help="with --tune: the Triton tile set timed beside the shipped choice (default all; "
                              "hopper: none, only the Hopper kernel's split counts)")
    kernels.set_defaults(func=_bench_kernels)
    indexer = bench_sub.add_parser("indexer", parents=[common], help="indexer scores + top-k, top-k, top-k + remap against torch and Inductor")
    indexer.add_argument("--json", help="also write the rows to this file")
    indexer.add_argument("--only", nargs="+", choices=["indexer", "topk", "remap", "tiles"],
                         help="time only these parts (default: indexer, topk, remap; tiles sweeps index_scores tiles)")
    topk_paths = ["resident", "row", "split", "sampled", "sampled_split"]  # bench.indexer.TOPK_PATHS
    indexer.add_argument("--topk-paths", nargs="*", choices=topk_paths, default=topk_paths,
                         help="forced top-k paths timed beside the default plan (none: the default only)")
    indexer.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    indexer.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    indexer.add_argument("--keys", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    indexer.add_argument("--heads", type=int, nargs="+", default=[32, 64], help="indexer heads Hi")
    indexer.add_argument("--inductor", choices=["dynamic", "static", "off"], default="dynamic",
                         help="compile the torch composition once for all shapes, once a shape, or not at all")
    indexer.set_defaults(func=_bench_indexer)
    insp = sub.add_parser("inspect", parents=[common], help="show what the compiler does to a model: passes, collectives, memory, dataflow",
                          description="Compile TARGET for rank 0 of an N-rank DCP group in this process (a fake "
                                      "process group stands in for the other ranks) and report what the passes did.")
    insp.add_argument("target", metavar="TARGET",
                      help="a built-in config (deepseek-v3.2, glm5, glm5.2, glm5.3, each also -tiny), hf:deepseek_v32 or "
                           "hf:glm_moe_dsa[:LAYERS] (a tiny transformers model), or module:factory returning "
                           "(model, example_inputs)")
    insp.add_argument("--dcp", type=_at_least(1), default=2, help="DCP group size N (compiled for rank 0)")
    insp.add_argument("--merge", choices=MERGE_MODES, default="a2a")
    insp.add_argument("--interleave", type=_at_least(1), default=1)
    insp.add_argument("--kv-dtype", choices=("bf16", "fp8", "fp8_block"), default="bf16",
                      help="KV dtype of the memory plan (fp8: per-tensor scale; fp8_block: per-128-column scales)")
    insp.add_argument("--index-cache", choices=("replicated", "sharded"), default="replicated",
                      help="the index cache option (built-in configs are allocated for it)")
    insp.add_argument("--format", choices=("text", "json", "html"), default="text")
    insp.add_argument("--out", help="write report.{txt,json,html}, dataflow.{svg,png} and graphs/*.py here "
                                    "(html default: ./dsa-dcp-inspect)")
    mem = insp.add_mutually_exclusive_group()
    mem.add_argument("--slots", type=_at_least(1), help="memory plan: bytes per rank for this many KV slots")
    mem.add_argument("--gpu-mem", type=_positive_float, metavar="GiB",
                     help="memory plan: tokens that fit in this much cache memory per rank")
    insp.add_argument("--rows", type=_at_least(1), default=4, help="decode rows of the example step (built-in configs)")
    tp = insp.add_argument_group("capacity under tensor parallelism (docs/capacity.md; from the config's shapes)")
    tp.add_argument("--tp", type=_at_least(1), help="TP size T (a multiple of --dcp): also report weights, bytes per "
                                                     "token and KV tokens per rank at tp T with dcp N inside it")
    tp.add_argument("--weight-dtype", choices=("fp8", "bf16"),
                    help="linear weights' storage (default fp8: e4m3 + 128x128 block scales, norms and embeddings bf16)")
    tp.add_argument("--gpu", type=_gpu, metavar="h200|b300|GB",
                    help="the GPU's memory: h200 (150.1 GB, measured), b300 (288 GB) or a size in GB (default h200)")
    tp.add_argument("--reserve-gb", type=_non_negative_float, metavar="GB",
                    help="memory per GPU kept for activations, CUDA graphs and buffers (default 10%% of the GPU's)")
    tp.add_argument("--no-replicate-q", action="store_true",
                    help="do not count the DCP group's other heads' wq_b and W_UK on each rank")
    tp.add_argument("--capacity-only", action="store_true",
                    help="print the memory plan and the capacity only; nothing is compiled")
    insp.set_defaults(func=_inspect, parser=insp)
    args = parser.parse_args(argv)
    if not getattr(args, "quiet", False):
        return args.func(args)
    before = os.environ.get("DSA_DCP_QUIET")
    os.environ["DSA_DCP_QUIET"] = "1"  # the backend's compile lines too, in this process and its ranks
    try:
        return args.func(args)
    finally:
        if before is None:
            del os.environ["DSA_DCP_QUIET"]
        else:
            os.environ["DSA_DCP_QUIET"] = before


if __name__ == "__main__":
    sys.exit(main())
