"""Static SASS of the CUDA kernel builds, without a GPU: instruction counts by class.

    python3 benchmarks/sass.py [--arch sm_90a] [--family quant mhc attention indexer] [--json OUT.json]

Each kernel is built as the ops build it (`compile_for`, TileLang + nvcc) for --arch, and its SASS
(TileLang's `export_sass`: nvcc, then nvdisasm or cuobjdump) is counted by opcode class. Needs nvcc
and nvdisasm or cuobjdump on PATH: the CUDA toolkit has them, and the disassemblers also come as
the PyPI wheels `nvidia-cuda-nvdisasm` and `nvidia-cuda-cuobjdump`. No GPU is needed, so a change to a
kernel's instruction mix (the indexer's scoring is bound by its instruction count on an H200,
BENCHMARKS.md) can be seen before it is timed. The counts are static: a loop body counts once.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

CLASSES = {   # opcode (before the first '.') -> class; anything else is "other"
    "tensor": {"HGMMA", "HMMA", "IMMA", "QGMMA", "WARPGROUP", "WARPSYNC"},
    "global": {"LDG", "STG", "LDGSTS", "LDGDEPBAR", "RED", "REDG", "ATOMG", "UTMALDG", "UTMASTG"},
    "shared": {"LDS", "STS", "LDSM", "STSM", "ATOMS", "SYNCS"},
    "fp": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "F2F", "F2FP", "I2F", "F2I", "HADD2",
           "HMUL2", "HFMA2", "HMNMX2", "DADD", "DMUL", "DFMA", "FCHK"},
    "int": {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "PRMT", "ISETP", "SEL", "IMNMX", "VIADD", "IABS", "POPC",
            "FLO", "BMSK", "SGXT", "LOP", "IMUL", "VIMNMX", "VIMNMX3", "I2IP", "BREV", "PLOP3"},
    "uniform": {"UIADD3", "UIMAD", "USHF", "ULEA", "ULOP3", "UISETP", "USEL", "UPRMT", "UFLO", "UPOPC"},
    "move": {"MOV", "S2R", "S2UR", "R2UR", "CS2R", "UMOV", "ULDC", "LDC", "SHFL", "B2R", "R2P", "P2R", "VOTE",
             "VOTEU", "MATCH"},
    "control": {"BRA", "BSSY", "BSYNC", "BAR", "EXIT", "RET", "CALL", "NOP", "YIELD", "DEPBAR", "ELECT",
                "BPT", "MEMBAR", "FENCE", "ERRBAR", "CCTL"},
}
NAMES = (*CLASSES, "other")
OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def kernels(families: list[str], arch: str):
    """(family, name, compiled kernel) for the builds the ops use at the released dims."""
    target = f"cuda:{arch}"
    if "quant" in families:
        from dsv41c.tilelang_kernels import quant
        for fmt in ("fp8", "fp4_e4m3", "mxfp4"):
            for direction in ("quant", "dequant"):
                yield "quant", f"{fmt} {direction} bf16", quant.build(fmt, direction, "bfloat16", 512, target)
    if "mhc" in families:
        from dsv41c.tilelang_kernels import mhc
        from dsv41c.tilelang_kernels.quant import compile_for
        for kind in mhc.KINDS:
            # the main kernel, then (the mixing kinds) the finalize kernel
            for role, (_, fn) in zip(("main", "finalize"), mhc.mhc_prim_funcs(kind, "bfloat16", 4, 5120, 1e-6, 1e-6,
                                                                               20, "cuda"), strict=False):
                yield "mhc", f"{kind} {role} bf16 D=5120", compile_for(fn, target)
    if "attention" in families:
        from dsv41c.tilelang_kernels import attention
        for kind in attention.KINDS:
            yield "attention", f"{kind} decode H=64 d=512", attention.build(kind, "bfloat16", 64, 512, 512 ** -0.5,
                                                                          target, split=True)
        yield "attention", "combine H=64 d=512", attention.build("combine", "bfloat16", 64, 512, 0.0, target)
    if "indexer" in families:
        from dsv41c.tilelang_kernels import indexer
        yield "indexer", "scores H=32 d=128 (block max)", indexer.build("scores", (32, 128, False, False, True), target)
        for phase in indexer.SELECT_PHASES:
            yield "indexer", f"select topk {phase}", indexer.build("select", ("topk", phase), target)


def opcode_counts(kernel) -> collections.Counter:
    """Opcode counts of a built kernel's SASS (TileLang recompiles its CUDA source with the build's
    flags and disassembles it with nvdisasm or cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.sass"
        kernel.export_sass(str(path))
        text = path.read_text()
    return collections.Counter(m.group(1) for line in text.splitlines() if (m := OPCODE.match(line)))


def classify(ops: collections.Counter) -> dict[str, int]:
    out = dict.fromkeys(NAMES, 0)
    for op, n in ops.items():
        out[next((c for c, members in CLASSES.items() if op in members), "other")] += n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--family", nargs="+", default=["quant", "mhc", "attention", "indexer"],
                        choices=["quant", "mhc", "attention", "indexer"])
    parser.add_argument("--json", default=None, help="also write the rows here")
    opts = parser.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("sass.py: nvcc is not on PATH (the CUDA toolkit compiles the kernels)")
    if shutil.which("nvdisasm") is None and shutil.which("cuobjdump") is None:
        sys.exit("sass.py: neither nvdisasm nor cuobjdump is on PATH (the CUDA toolkit has both; the PyPI "
                 "wheels nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump too)")
    rows = []
    print(f"| family | kernel | total | {' | '.join(NAMES)} |")
    print(f"|---|---|---:|{'---:|' * len(NAMES)}")
    for family, name, kernel in kernels(opts.family, opts.arch):
        ops = opcode_counts(kernel)
        if not ops:
            sys.exit(f"sass.py: no instructions found in the SASS of {family} {name}")
        by_class = classify(ops)
        rows.append({"family": family, "kernel": name, "total": sum(ops.values()), "classes": by_class,
                     "opcodes": dict(ops.most_common())})
        print(f"| {family} | {name} | {sum(ops.values())} | " + " | ".join(str(by_class[c]) for c in NAMES) + " |",
              flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
