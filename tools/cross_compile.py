"""Compile the index-score gather kernel and the top-k remap for a GPU target on a machine without one.

``triton.compile`` runs every stage (TTIR, TTGIR, LLVM IR, PTX, ptxas) for the target named,
without a driver, so a compiler failure at a kernel's layouts shows here as it would on the GPU.
Each case is one specialization a launcher picks: for ``index_scores_triton`` the key dtype, the
sharded cache's (N, I) and the candidate tile; for ``topk_remap_triton`` the top-k dtype, (N, I)
and the columns a program. With the GPU machine's Triton on the path, e.g.

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python tools/cross_compile.py

it prints one line a case and exits 1 if any fails (docs/validation.md).
"""

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile the kernels: interpreted ones have nothing to compile
import triton  # noqa: E402
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsa_dcp.kernels.index_scores import _index_scores_kernel, _score_dot  # noqa: E402
from dsa_dcp.kernels.topk_remap import _topk_remap_kernel  # noqa: E402

POINTERS = ("q_ptr", "w_ptr", "k_ptr", "ks_ptr", "pt_ptr", "req_ptr", "pos_ptr", "out_ptr")
ALIGNED = POINTERS + ("D", "stride_qt", "stride_qh", "stride_k", "stride_ot")  # multiples of 16 at launch


def specialization(keys: str, n: int, interleave: int, block_c: int, heads: int = 32, dim: int = 128):
    """(signature, constexprs, attrs) of the launch ``index_scores_triton`` makes for FP8 E4M3 keys
    with E4M3 queries and per-token scales, or bf16 keys and queries."""
    fp8 = keys == "fp8"
    elem = "fp8e4nv" if fp8 else "bf16"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    dot_dtype, dot_ieee, prescale = _score_dot(dtype, dtype, interpreted=False)  # the launcher's choice
    types = {"q_ptr": elem, "k_ptr": elem, "pt_ptr": "i32", "req_ptr": "i64", "pos_ptr": "i64"}
    consts = dict(PAGE=64, DCP_SIZE=n, INTERLEAVE=interleave, KEY_SCALE=2 if fp8 else 0, Q_PRESCALE=prescale != 1.0,
                  BLOCK_C=block_c, BLOCK_H=max(16, triton.next_power_of_2(heads)),
                  BLOCK_D=max(32 if fp8 else 16, triton.next_power_of_2(dim)),
                  DOT_DTYPE=dot_dtype, DOT_IEEE=dot_ieee, UPCAST=False, FP8_DOT=fp8)
    names = _index_scores_kernel.arg_names
    signature = {}
    for name in names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + types.get(name, "fp32")
        else:
            signature[name] = "fp32" if name == "q_prescale" else "i32"
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    return signature, consts, attrs


def remap_specialization(ids: str, n: int, interleave: int, block: int, k: int = 2048):
    """(signature, constexprs, attrs) of ``topk_remap_triton``'s launch for a ``[B, k]`` top-k."""
    consts = dict(DCP_SIZE=n, INTERLEAVE=interleave, ROW_BLOCK=triton.next_power_of_2(k), BLOCK_K=block)
    types = {"topk_ptr": "*" + ids, "local_ptr": "*i32", "count_ptr": "*i32"}
    names = _topk_remap_kernel.arg_names
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in (*types, "K")}
    return signature, consts, attrs


LAYOUTS = ((1, 1), (2, 1), (4, 1), (2, 16), (4, 16), (2, 64))  # (N, I)


def cases():
    """(description, kernel, specialization) of every case."""
    for keys in ("bf16", "fp8"):
        for n, interleave in LAYOUTS:
            for block_c in (64, 128):
                yield (f"index_scores: {keys} keys, N {n}, I {interleave}, block_c {block_c}", _index_scores_kernel,
                       specialization(keys, n, interleave, block_c))
    for ids in ("i32", "i64"):
        for n, interleave in LAYOUTS[1:]:
            for block in (256, 2048):
                yield (f"topk_remap: {ids} top-k, N {n}, I {interleave}, {block} columns a program", _topk_remap_kernel,
                       remap_specialization(ids, n, interleave, block))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90: Hopper)")
    parser.add_argument("--only", default="", help="compile only the cases whose description contains this text")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    chosen = [c for c in cases() if args.only in c[0]]
    if not chosen:
        parser.error(f"no case matches --only {args.only!r}")
    for case, kernel, spec in chosen:
        try:
            triton.compile(ASTSource(kernel, *spec), target=target, options={"num_warps": 4, "num_stages": 2})
            print(f"ok    {case}")
        except Exception as e:  # the compiler's own error, last line
            failed += 1
            print(f"FAIL  {case}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
