"""Compile the engine's Triton kernels for sm_90 on a machine without a GPU and count their SASS: registers,
shared memory, instructions, and for the main loop its instruction mix and its global loads (width and count).
An issue-bound kernel shows here as many instructions per weight byte; the device only confirms.

Needs Triton beside the CPU build of torch (the test venv has none): e.g.
    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 triton==3.6.0
    /tmp/tv/bin/python bench/kernel_sass.py fp8_row fp8_gemv fp4_gate_up bf16_row
Integer arguments that the JIT would see divisible by 16 (pointers, strides, Flash's sizes) are compiled so, as
the JIT specialises them. Files (.ttgir, .ptx, .sass) go to --out."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def kernels():
    """name -> (JIT function, argument types, constexprs, arguments divisible by 16, warps)."""
    from dsv4.kernels import bf16_gemv, fp4_gemv, fp8_linear, mhc, moe
    fp8 = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "OUT": "*bf16"}
    fp8_div = ("X", "W", "S", "OUT", "N", "K", "stride_xm", "stride_xg", "stride_s", "k_per_split")
    fp4 = {"A": "*bf16", "ROWS": "*i32", "W": "*i32", "W3": "*i32", "S": "*u8", "S3": "*u8", "C": "*bf16",
           "BLOCK_EXPERT": "*i64", "ROW_W": "*fp32", "limit": "fp32"}
    fp4_div = ("A", "ROWS", "W", "W3", "S", "S3", "C", "BLOCK_EXPERT", "ROW_W", "stride_am", "stride_we",
               "stride_wn", "stride_se", "stride_sn", "stride_cm", "N", "K")
    fp4_tc = {"A": "*bf16", "ROWS": "*i32", "W": "*i32", "C": "*bf16", "BLOCK_EXPERT": "*i64", "S": "*u8"}
    fp4_tc_div = ("A", "ROWS", "W", "C", "BLOCK_EXPERT", "S", "stride_am", "stride_we", "stride_wn", "stride_cm", "N",
                  "K", "stride_se", "stride_sn")
    tc = moe.GEMM_CONFIG_FP4
    row = fp8_linear.ROW_CONFIG
    gate_up = fp4_gemv.GEMV_CONFIG_GATE_UP_FEW
    return {
        **{f"fp8_row{'' if m == 1 else m}": (
            fp8_linear._fp8_row_kernel, dict(fp8, W="*i32"),
            dict(M=m, BLOCK_N=row["BLOCK_N"], BLOCK_K=row["BLOCK_K"], SB=128, PREFETCH=row["PREFETCH"], PDL=True),
            fp8_div, row["num_warps"]) for m in (1, 2, 4)},
        "fp8_gemv": (fp8_linear._fp8_gemv_kernel, fp8,
                     dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, SB=128, PDL=True), fp8_div, 4),
        "fp4_gate_up": (fp4_gemv._fp4_gemv_kernel, fp4,
                        dict(GATHER=True, GATE_UP=True, CLAMP=True, BLOCK_M=16, BLOCK_N=gate_up["BLOCK_N"],
                             BLOCK_K=gate_up["BLOCK_K"], EVEN_K=True, ASM=True, JOIN=gate_up.get("JOIN", False),
                             PREFETCH=fp4_gemv.PREFETCH, PDL=True), fp4_div,
                        gate_up["num_warps"]),
        "fp4_w2": (fp4_gemv._fp4_gemv_kernel, fp4,
                   dict(GATHER=False, GATE_UP=False, CLAMP=False, BLOCK_M=16, BLOCK_N=fp4_gemv.GEMV_CONFIG["BLOCK_N"],
                        BLOCK_K=fp4_gemv.GEMV_CONFIG["BLOCK_K"], EVEN_K=True, ASM=True,
                        JOIN=fp4_gemv.GEMV_CONFIG["JOIN"], PREFETCH=fp4_gemv.PREFETCH, PDL=True), fp4_div,
                   fp4_gemv.GEMV_CONFIG["num_warps"]),
        **{f"bf16_row{'' if m == 1 else m}": (
            bf16_gemv._row_kernel, {"X": "*bf16", "W": "*i32", "OUT": "*bf16"},
            dict(M=m, BLOCK_N=8, BLOCK_K=bf16_gemv.BLOCK_K, PDL=True), ("X", "W", "OUT", "N", "K"), 4)
           for m in (1, 2, 4)},
        "mhc_collapse": (mhc._collapse, {"P": "*fp32", "X": "*bf16", "SCALE": "*fp32", "BASE": "*fp32", "POST": "*fp32",
                                         "COMB": "*fp32", "NW": "*bf16", "U": "*bf16", "eps": "fp32",
                                         "norm_eps": "fp32"},
                         dict(n=4, KBP=256, RP=32, DP=4096, HEAD=False, NORM=True, PDL=True),
                         ("P", "KB", "X", "stride_x", "POST", "COMB", "NW", "U", "K", "d"), 8),
        "mhc_partials": (mhc._mix_partials, {"X": "*bf16", "FN": "*fp32", "P": "*fp32"},
                         dict(R=24, RP=32, BLOCK=mhc.BLOCK_K, TOKENS=mhc.MIX_TOKENS, BF16=True, PDL=True),
                         ("X", "stride_x", "FN", "P", "K"), 4),
        "mhc_post": (mhc._post, {"Y": "*bf16", "X": "*bf16", "POST": "*fp32", "COMB": "*fp32", "OUT": "*bf16"},
                     dict(n=4, BLOCK=2 * mhc.BLOCK_D, PDL=True), ("Y", "X", "POST", "COMB", "OUT", "d"), mhc.POST_WARPS),
        "mhc_post_mix": (mhc._post_mix, {"Y": "*bf16", "X": "*bf16", "POST": "*fp32", "COMB": "*fp32", "OUT": "*bf16",
                                         "FN": "*fp32", "P": "*fp32"},
                         dict(R=24, RP=32, BLOCK=mhc.BLOCK_K, TOKENS=mhc.MIX_TOKENS, BF16=True, PDL=True),
                         ("Y", "X", "POST", "COMB", "OUT", "FN", "P", "d"), mhc.POST_MIX_WARPS),
        "fp4_tc": (moe._grouped_gemm_kernel, fp4_tc,
                   dict(GATHER=True, BLOCK_M=16, BLOCK_N=tc["BLOCK_N"], BLOCK_K=tc["BLOCK_K"], IEEE=False, FP4=True,
                        ASM=True, EVEN_K=True, PDL=True), fp4_tc_div, tc["num_warps"]),
    }


def compile_sm90(fn, types: dict, consts: dict, div16, warps: int, out: str, name: str, stages: int = 1) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16 if a in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    os.makedirs(out, exist_ok=True)
    cubin = os.path.join(out, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out, f"{name}.{ext}"), "w") as f:
            f.write(k.asm[ext])
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    with open(os.path.join(out, f"{name}.sass"), "w") as f:
        f.write(sass)
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(
        r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_][\w.]*)\s*(.*?);", sass, re.M)]
    back = [(a - int(t.group(1), 16), int(t.group(1), 16), a) for a, op, rest in ins if op.startswith("BRA")
            for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
    info = {"regs": int(re.search(r"REG:(\d+)", usage).group(1)), "shared": k.metadata.shared,
            "instructions": len(ins)}
    if back:
        _, lo, hi = max(back)
        body = [op for a, op, _ in ins if lo <= a <= hi]
        info["loop instructions"] = len(body)
        info["loop mix"] = dict(Counter(op.split(".")[0] for op in body).most_common(12))
        info["loop loads"] = dict(Counter(op for op in body if op.startswith("LDG")))
    return info


def main():
    ks = kernels()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", choices=sorted(ks))
    ap.add_argument("--out", default="/tmp/kernel_sass")
    a = ap.parse_args()
    for name in a.names:
        fn, types, consts, div16, warps = ks[name]
        print(name, compile_sm90(fn, types, consts, div16, warps, a.out, name))


if __name__ == "__main__":
    main()
