"""tools/cross_compile.py: the kernels' launches specialized and compiled for sm_90 without a GPU
(docs/validation.md, "Kernels compiled for the GPU on a CPU")."""

import os
import re
import subprocess
import sys
from pathlib import Path

from dsa_dcp.kernels.index_scores import FP8_MAX_REGISTERS

ROOT = Path(__file__).resolve().parents[1]


def _tool(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))  # the tool compiles whatever TRITON_INTERPRET says
    return subprocess.run([sys.executable, "tools/cross_compile.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_every_case_makes_its_launches(tmp_path):
    """Every case's launcher call passes the launcher's checks and each launch binds as it would on
    the GPU (the tool cannot drift from the launchers unnoticed); nothing is compiled."""
    done = _tool("--bind-only", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    ok = [line for line in lines if line.startswith("ok")]
    assert lines[-1].startswith(f"all {len(ok)} bound (") and len(ok) > 100, done.stdout  # none failed, none skipped
    launched = {name for line in ok for name in line[line.rindex("(") + 1:-1].split(", ")}
    for kernel in ("_index_scores_kernel", "_index_scores_pages_kernel", "_topk_resident_kernel", "_topk_sampled_kernel",
                   "_topk_sample_kernel", "_topk_segment_kernel", "_topk_finish_segments_kernel", "_topk_row_kernel",
                   "_topk_pass_kernel", "_topk_write_kernel", "_topk_remap_kernel", "_sparse_mla_kernel",
                   "_sparse_mha_positions_kernel", "_kv_store_kernel", "_lse_combine_kernel", "_fused_a2a_merge_kernel",
                   "_sparse_mla_hopper_kernel", "_combine_kernel"):  # fmt: skip
        assert kernel in launched, (kernel, sorted(launched))


def test_the_sharded_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """tools/cross_compile.py compiles the launches for sm_90 with the installed Triton, down to
    ptxas: the sharded gather at I 16 with 64-candidate tiles, where a select on the slots once
    failed Triton 3.6's layout pass (docs/kernels.md), and the top-k remap at the same layout (the
    same ownership test). A fresh Triton cache, so it compiles."""
    remap = "topk_remap: int32 top-k, N 2, I 16, 256 columns a program"
    fp8_gpu_tile = "index_scores: fp8 keys, N 2, I 16, block_c 128"
    done = _tool("--resources", "--only", "N 2, I 16, block_c 64", fp8_gpu_tile, remap, tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # which MMA each score product became: warp-group wgmma on bf16, a warp's mma.sync on the FP8
    # keys widened to fp16 (E4M3 x E4M3 with 16-term accumulation gets no FP8 wgmma)
    usage = [line.strip() for line in done.stdout.splitlines() if line.startswith("        _index_scores_kernel")]
    assert len(usage) == 3 and "HGMMA.64x32x16.F32.BF16" in usage[0], done.stdout
    assert all("HMMA.16816.F32" in u and "GMMA" not in u for u in usage[1:]), done.stdout
    # the E4M3 kernel at its GPU tile takes the launcher's register cap (114-119 a thread without
    # it, by the Triton version) and spills nothing
    regs = int(re.search(r"(\d+) registers, 0 bytes spilled", usage[2]).group(1))
    assert regs <= FP8_MAX_REGISTERS, usage[2]
    assert [line[6:] for line in done.stdout.splitlines() if line.startswith("ok")] == [
        "index_scores: bf16 keys, N 2, I 16, block_c 64 (_index_scores_kernel)",
        "index_scores: fp8 keys, N 2, I 16, block_c 64 (_index_scores_kernel)",
        f"{fp8_gpu_tile} (_index_scores_kernel)",
        f"{remap} (_topk_remap_kernel)"], done.stdout
    assert done.stdout.splitlines()[-1] == "all 4 compiled (4 kernels)", done.stdout


def test_resident_programs_count_as_the_occupancy_calculator():
    """What ``--resources`` says an SM holds, for Hopper's limits: registers (4 schedulers of
    16,384, a warp's share in units of 256), shared memory (228 KiB, 1 KiB
    of it kept for each program), 64 warps, 32 programs."""
    cases = {(119, 26624, 4): 4,  # 120 x 32 = 3,840 a warp: 4 warps a scheduler, 16 an SM
             (96, 26624, 4): 5, (80, 26624, 4): 6, (64, 26624, 4): 8,
             (62, 42240, 4): 5,  # registers allow 8; shared memory 5
             (32, 116224, 4): 1,  # two would fit but for the 1 KiB the system keeps a program
             (168, 231232, 4): 1, (255, 0, 8): 1, (32, 0, 4): 16,  # 64 warps
             (16, 1024, 1): 32}  # at most 32 programs
    code = ("import sys; sys.path.insert(0, 'tools'); from cross_compile import resident_programs; "
            f"print([resident_programs(*c) for c in {list(cases)}])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(list(cases.values())), done.stdout
