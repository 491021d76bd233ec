"""Compile the Triton kernels' launches for a GPU target on a machine without one.

Each case calls a launcher of ``dsa_dcp.kernels`` on small CPU tensors, with the options its GPU
defaults pick (the tile, the path, the sharded cache's N and I, the key dtype). Every
``kernel[grid](...)`` it makes is compiled for the target instead of launched: Triton's own
binder derives the specialization from the arguments (argument types, 16-byte alignment, the
constexprs, ``num_warps``), as it does on the GPU, and ``triton.compile`` runs every stage (TTIR,
TTGIR, LLVM IR, PTX, ptxas) without a driver. So a compiler failure at a launch shows here as it
would on the GPU. Nothing runs: the outputs are left unwritten. With the GPU machine's Triton on
the path, e.g.

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python tools/cross_compile.py

it prints one line a case (with the kernels it compiled) and exits 1 if any fails
(docs/validation.md).
"""

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile the kernels: interpreted ones have nothing to compile
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import dsa_dcp.kernels as K  # noqa: E402
from dsa_dcp.kernels import fused_merge, index_scores, kv_store, lse_combine, sparse_mla, sparse_positions  # noqa: E402
from dsa_dcp.kernels import sparse_mla_hopper, topk_remap, topk_select  # noqa: E402
from dsa_dcp.kernels.kv_store import quantize_rows  # noqa: E402

MODULES = (fused_merge, index_scores, kv_store, lse_combine, sparse_mla, sparse_mla_hopper, sparse_positions, topk_remap,
           topk_select)  # fmt: skip
HOPPER_SMS = 132  # what sm_count says on an H100 or H200: the split top-k's one-launch choice and the splits use it


class LaunchCompiler:
    """Stands in for the GPU: compiles each launch for ``target`` (once a specialization) and
    launches nothing. ``launches`` holds (kernel, error or None, resources) of the current case;
    resources (registers a thread, spilled bytes, shared memory, programs an SM holds) when
    ``resources`` is set."""

    def __init__(self, target: GPUTarget, resources: bool = False, bind_only: bool = False):
        self.target = target
        self.backend = make_backend(target)
        self.want_resources = resources
        self.bind_only = bind_only  # specialize the launches, compile none
        self.compiled: dict = {}
        self.resources: dict = {}
        self.launches: list = []

    def launch(self, kernel: JITFunction, args, kwargs) -> None:
        kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode)  # as JITFunction.run adds them
        binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
        name = kernel.fn.__name__
        key = (name, repr(signature), repr(constexprs), repr(attrs), repr(sorted(options.__dict__.items())))
        if self.bind_only:
            self.compiled[key] = None
        if key not in self.compiled:
            source = (_gluon_source() if kernel.is_gluon() else ASTSource)(kernel, signature, constexprs, attrs)
            with tempfile.TemporaryFile(mode="w+") as log:
                try:
                    with _stderr_to(log):  # the MLIR passes' diagnostics, written by C++ to fd 2
                        compiled = triton.compile(source, target=self.target, options=options.__dict__)
                    self.compiled[key] = None
                    if self.want_resources:
                        self.resources[key] = _resources(compiled, options.num_warps)
                except Exception as e:  # the compiler's own error, and the first diagnostic line
                    log.seek(0)
                    first = next((line.strip() for line in log if " error: " in line), "")
                    self.compiled[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}" + (
                        f" ({first[:300]})" if first else "")
        self.launches.append((name, self.compiled[key], self.resources.get(key)))


def _resources(compiled, warps: int) -> str:
    """What the cubin asks of an SM: registers a thread, spills (local memory a thread) and shared
    memory (static, from ``cuobjdump``, plus the dynamic bytes Triton launches with), and the
    tensor-core instructions it got (the SASS opcodes: e.g. ``HMMA.16816.F32`` is a warp's
    mma.sync on fp16/bf16, ``HGMMA``/``QGMMA`` a warp group's wgmma on fp16/bf16 or FP8)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", cubin.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
    if "REG" not in fields:
        return f"{warps} warps, no resource usage from cuobjdump"
    shared = int(fields.get("SHARED", 0)) + compiled.metadata.shared
    mma = _mma_opcodes(sass)
    regs = int(fields["REG"])
    return (f"{warps} warps, {regs} registers, {fields.get('LOCAL', 0)} bytes spilled, {shared} bytes shared, "
            f"{resident_programs(regs, shared, warps)} programs an SM" + (f", {mma}" if mma else ""))


def resident_programs(registers: int, shared: int, warps: int) -> int:
    """How many programs (CTAs) of a kernel one Hopper SM holds at once, as the CUDA occupancy
    calculator counts for compute capability 9.0: each of the SM's 4 schedulers has 16,384
    registers, given out a warp at a time in units of 256 (a thread's count rounded up to 8); 228 KiB
    of shared memory, of which a program takes ``shared`` (what the cubin and the launch ask) and
    the 1 KiB the system keeps for each; at most 64 warps and 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 4 * (16384 // per_warp) // warps if registers else 32
    return min(by_registers, 233472 // (shared + 1024), 64 // warps, 32)


def _mma_opcodes(sass: str) -> str:
    """The tensor-core opcodes in a SASS listing with how often each is written (not executed)."""
    counts = collections.Counter(re.findall(r"\b([HQI]G?MMA(?:\.[0-9A-Zx]+)*)", sass))
    return " ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


def _gluon_source():
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


@contextlib.contextmanager
def _stderr_to(file):
    """File descriptor 2 (C++'s stderr too) into ``file`` while within."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def compiling_launches(compiler: LaunchCompiler, sms: int):
    """Within it, ``kernel[grid](...)`` compiles for the compiler's target, the launchers take CPU
    tensors, and ``sm_count`` says ``sms``."""
    saved = [(JITFunction, "__getitem__", JITFunction.__getitem__)]
    JITFunction.__getitem__ = lambda kernel, grid: lambda *a, **kw: compiler.launch(kernel, a, kw)
    for module in MODULES:
        for name, value in (("check_launchable", lambda *a, **kw: None), ("sm_count", lambda device: sms),
                            ("unavailable_reason", lambda device=None: None)):  # fmt: skip
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    try:
        yield compiler
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# ---- the cases: (description, call); each call makes the launches of one launcher call --------

PAGE = 64
LAYOUTS = ((1, 1), (2, 1), (4, 1), (2, 16), (4, 16), (2, 64))  # the sharded cache's (N, I)


def _paged(T: int, C: int):
    """A page table of T rows over C candidates (distinct pages), req ids, positions."""
    pages = C // PAGE
    return (torch.randperm(T * pages).view(T, pages).int(), torch.arange(T), torch.full((T,), C - 1))


def _scores_call(keys: str, n: int, interleave: int, block_c: int, path: str = "gather", T=2, H=32, D=128, C=256):
    def call():
        q = torch.randn(T, H, D, dtype=torch.bfloat16)
        w = torch.randn(T, H)
        cache = torch.randn(T * C, D, dtype=torch.bfloat16)
        scale = None
        if keys == "fp8":  # E4M3 queries and keys, per-token key scales (the reference models' form)
            cache, scale = quantize_rows(cache, block=True)
            scale = scale.view(-1).contiguous()
            q8, q_scale = quantize_rows(q.view(T * H, D), block=True)
            q, w = q8.view(T, H, D), w * q_scale.view(T, H)
        shard = (n, n - 1, interleave) if n > 1 else None
        K.index_scores_triton(q, w, cache, scale, *_paged(T, C), PAGE, path=path, block_c=block_c, shard=shard)

    return call


def _topk_call(path: str, C: int, chunks: int | None, remap, paged: bool, T: int = 2, k: int = 2048):
    def call():
        scores = torch.randn(T, C)
        pt, req, _ = _paged(T, C) if paged else (None, None, None)
        size = PAGE if paged else 1
        if remap is None:
            K.topk_select_triton(scores, k, pt, req, size, path=path, chunks=chunks)
        else:
            K.topk_select_remap_triton(scores, k, remap[0], remap[0] - 1, remap[1], pt, req, size, path=path,
                                       chunks=chunks)  # fmt: skip

    return call


def _remap_call(ids: torch.dtype, n: int, interleave: int, block: int, T: int = 4, k: int = 2048):
    return lambda: K.topk_remap_triton(torch.randint(0, 1 << 20, (T, k), dtype=ids), n, n - 1, interleave,
                                       block_k=block)  # fmt: skip


def _mla_inputs(H: int, B: int, k: int, kv: str, slots: int = 4096):
    q_nope = torch.randn(B, H, 512, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, 64, dtype=torch.bfloat16)
    cache = torch.randn(slots, 576, dtype=torch.bfloat16)
    topk = torch.randint(0, slots, (B, k), dtype=torch.int32)
    if kv == "fp8":
        return q_nope, q_pe, cache.to(torch.float8_e4m3fn), topk, 0.07, 0.5
    return q_nope, q_pe, cache, topk, 0.07, None


def _mla_call(H: int, B: int, k: int, kv: str, tiles: dict, form: str = ""):
    """``form``: "" (one slot pool), "block scales" (FP8 with a scale a 128 columns of each row, the
    published checkpoints' form) or "pe apart" (the rope columns in a cache of their own, as
    ``sparse_mla_positions`` passes transformers' caches)."""

    def call():
        q_nope, q_pe, cache, topk, sm_scale, kv_scale = _mla_inputs(H, B, k, kv)
        if form == "block scales":
            cache, scales = quantize_rows(cache.to(torch.bfloat16), block=True)
            return K.sparse_mla_triton(q_nope, q_pe, cache, topk, sm_scale, block_scales=scales, **tiles)
        if form == "pe apart":
            return K.sparse_mla_triton(q_nope, q_pe, cache[:, :512], topk, sm_scale, kv_scale,
                                       pe=cache[:, 512:].contiguous(), **tiles)  # fmt: skip
        return K.sparse_mla_triton(q_nope, q_pe, cache, topk, sm_scale, kv_scale, **tiles)

    return call


def _mha_positions_call(R: int, H: int, splits: int | None, B: int = 2, T: int = 1024, k: int = 512):
    def call():
        q_nope = torch.randn(R, H, 128, dtype=torch.bfloat16)
        q_pe = torch.randn(R, H, 64, dtype=torch.bfloat16)
        caches = [torch.randn(B, H, T, 192, dtype=torch.bfloat16), torch.randn(B, H, T, 128, dtype=torch.bfloat16)]
        topk = torch.randint(0, B * T, (R, k), dtype=torch.int32)
        sparse_positions.sparse_mha_positions_triton(q_nope, q_pe, caches, topk, 0.07, num_splits=splits)

    return call


def _mla_table_cases():
    """Every (kv, H, tiles) the measured dispatch table can pick for the Triton kernel."""
    table = json.loads((Path(sparse_mla.__file__).parent / "sparse_mla_table.json").read_text())
    seen = set()
    for e in table["entries"]:
        tiles = dict(e["tiles"])
        tiles_key = (e["kv"], e["H"], json.dumps({k: v for k, v in tiles.items() if k != "num_splits"}, sort_keys=True),
                     tiles.get("num_splits", 1) > 1)  # fmt: skip
        if tiles_key in seen:
            continue
        seen.add(tiles_key)
        text = ", ".join(f"{k} {v}" for k, v in sorted(tiles.items()))
        yield (f"sparse_mla: {e['kv']} KV, H {e['H']}, B {e['B']}, K {e['K']}, {text}",
               _mla_call(e["H"], min(e["B"], 4), e["K"], e["kv"], tiles))  # fmt: skip


def cases():
    """(description, call) of every case."""
    for keys in ("bf16", "fp8"):
        for n, interleave in LAYOUTS:
            for block_c in (64, 128):
                yield (f"index_scores: {keys} keys, N {n}, I {interleave}, block_c {block_c}",
                       _scores_call(keys, n, interleave, block_c))  # fmt: skip
        bc = 128 if keys == "fp8" else 64
        yield f"index_scores: {keys} keys, pages path, block_c {bc}", _scores_call(keys, 1, 1, bc, path="pages")
    paths = (("resident", 4096, None), ("resident", 4160, None), ("resident", 16384, None), ("sampled", 32768, None),
             ("sampled", 131072, 8), ("sampled", 131072, 64), ("row", 8192, None), ("chunked", 32768, 4),
             ("chunked", 32832, 32))  # fmt: skip
    for path, C, chunks in paths:
        for remap, paged in ((None, False), (None, True), ((2, 16), True), ((4, 1), True)):
            T = 64 if chunks == 64 else 2  # 64 rows of 64 chunks: over the one-launch limit of the split sampled form
            where = (f"remap N {remap[0]}, I {remap[1]}" if remap else "no remap") + (", paged" if paged else "")
            yield (f"topk_select: {path}, C {C}, {chunks or 1} programs a row, {T} rows, {where}",
                   _topk_call(path, C, chunks, remap, paged, T=T))  # fmt: skip
    for ids in (torch.int32, torch.int64):
        for n, interleave in LAYOUTS[1:]:
            for block in (256, 2048):
                yield (f"topk_remap: {str(ids)[6:]} top-k, N {n}, I {interleave}, {block} columns a program",
                       _remap_call(ids, n, interleave, block))  # fmt: skip
    yield from _mla_table_cases()
    for kv, form in (("bf16", ""), ("fp8", ""), ("fp8", "block scales"), ("bf16", "pe apart")):
        for H, B in ((64, 1), (128, 32)):
            yield (f"sparse_mla: {kv} KV{', ' + form if form else ''}, H {H}, B {B}, K 2048, the heuristic tiles",
                   _mla_call(H, B, 2048, kv, dict(zip(("block_h", "block_k", "num_warps"),
                                                     sparse_mla._default_tiles(B, H, torch.device("cuda")))),
                             form))  # fmt: skip
    for R, H, splits in ((1, 16, None), (64, 16, 1)):
        yield f"sparse_mha_positions: R {R}, H {H}, {'split K' if splits is None else 'one split'}", _mha_positions_call(
            R, H, splits)
    for kv, block in (("bf16", False), ("fp8", False), ("fp8", True)):
        yield f"kv_store: {kv} cache{', block scales' if block else ''}", _kv_store_call(kv, block)
    for n, bh in ((2, 64), (4, 2048), (8, 8192)):
        yield f"lse_combine: N {n}, B*H {bh}", _lse_call(n, bh)
    for n, heads in ((2, 64), (4, 128), (8, 128)):
        yield f"fused_a2a_merge: N {n}, H {heads}", _merge_call(n, heads)
    for kv in ("bf16", "fp8"):
        for block_k in (64, 32):
            for more in (dict(), dict(prefetch=0, early_s=False)):
                text = ", ".join(f"{k} {v}" for k, v in more.items()) or "prefetch and early_s by default"
                yield (f"sparse_mla_hopper: {kv} KV, H 128, B 2, K 2048, block_k {block_k}, 4 splits, {text}",
                       _hopper_call(kv, 128, 2, block_k=block_k, num_splits=4, **more))  # fmt: skip


def _kv_store_call(kv: str, block: bool, rows: int = 8, D: int = 576):
    def call():
        slots = torch.randperm(256)[:rows]
        x = torch.randn(rows, D, dtype=torch.bfloat16)
        if kv == "bf16":
            return K.kv_store_triton(torch.empty(256, D, dtype=torch.bfloat16), slots, x)
        cache = torch.empty(256, D, dtype=torch.float8_e4m3fn)
        if block:
            scales = torch.empty(256, kv_store.block_scale_groups(D), dtype=torch.float32)
            return K.kv_store_triton(cache, slots, x, block_scales=scales)
        return K.kv_store_triton(cache, slots, x, kv_scale=0.5)

    return call


def _lse_call(n: int, bh: int, D: int = 512):
    return lambda: K.lse_combine_triton(torch.randn(n, bh, 1, D, dtype=torch.bfloat16), torch.randn(n, bh, 1))


def _hopper_call(kv: str, H: int, B: int, **tiles):
    return lambda: sparse_mla_hopper.sparse_mla_hopper(*_mla_inputs(H, B, 2048, kv), **tiles)


def _merge_call(n: int, heads: int, rows: int = 8, d: int = 512):
    """The fused all-to-all merge of rank 0 over n ranks' buffers (peer addresses: plain CPU ones)."""

    def call():
        Workspace = fused_merge.MergeWorkspace
        ws = Workspace.from_buffers(0, [Workspace.buffers(n, rows, heads, d, torch.bfloat16, "cpu") for _ in range(n)])
        fused_merge.fused_a2a_merge_triton(torch.randn(rows, heads, d, dtype=torch.bfloat16), torch.randn(rows, heads),
                                           ws)  # fmt: skip

    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90: Hopper)")
    parser.add_argument("--sms", type=int, default=HOPPER_SMS, help="what sm_count says (default 132: an H100 or H200)")
    parser.add_argument("--only", nargs="+", default=[""], metavar="TEXT",
                        help="compile only the cases whose description contains one of these texts")
    parser.add_argument("--list", action="store_true", help="print the cases' descriptions and compile nothing")
    parser.add_argument("--bind-only", action="store_true",
                        help="make every launch and specialize it as the GPU would, but compile nothing (seconds)")
    parser.add_argument("--resources", action="store_true",
                        help="also print each kernel's registers, spilled bytes and shared memory (cuobjdump)")
    args = parser.parse_args(argv)
    chosen = [c for c in cases() if any(text in c[0] for text in args.only)]
    if not chosen:
        parser.error(f"no case matches --only {' '.join(map(repr, args.only))}")
    if args.list:
        print("\n".join(case for case, _ in chosen))
        return 0
    print(f"triton {triton.__version__}, target sm_{args.arch}, {args.sms} SMs")
    # the Gluon kernel compiles with one Triton release's Gluon API, and binds with any that imports it
    if not (sparse_mla_hopper._IMPORT_ERROR is None if args.bind_only else sparse_mla_hopper._version_ok()):
        for case in [case for case, _ in chosen if case.startswith("sparse_mla_hopper")]:
            print(f"skip  {case}: {sparse_mla_hopper.unavailable_reason()}")
        chosen = [c for c in chosen if not c[0].startswith("sparse_mla_hopper")]
    compiler = LaunchCompiler(GPUTarget("cuda", args.arch, 32), resources=args.resources, bind_only=args.bind_only)
    failed = 0
    torch.manual_seed(0)
    with compiling_launches(compiler, args.sms):
        for case, call in chosen:
            compiler.launches = []
            try:
                call()
            except Exception as e:  # a launcher's refusal: the case is wrong, not the kernel
                compiler.launches.append(("launcher", f"{type(e).__name__}: {e}", None))
            errors = [f"{name}: {err}" for name, err, _ in compiler.launches if err]
            names = ", ".join(dict.fromkeys(name for name, _, _ in compiler.launches)) or "no launch"
            if errors or not compiler.launches:
                failed += 1
                print(f"FAIL  {case} ({names}): {'; '.join(errors) or 'nothing launched'}")
            else:
                print(f"ok    {case} ({names})")
                for name, usage in dict.fromkeys((name, usage) for name, _, usage in compiler.launches if usage):
                    print(f"        {name}: {usage}")
    done = "bound" if args.bind_only else "compiled"
    print(f"{failed} of {len(chosen)} failed" if failed else f"all {len(chosen)} {done} ({len(compiler.compiled)} kernels)"
          if chosen else f"nothing {done}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
