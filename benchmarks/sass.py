"""Static SASS of the CUDA kernel builds, without a GPU: instruction counts by class.

    python3 benchmarks/sass.py [--arch sm_90a] [--family quant mhc attention indexer] [--set NAME=VALUE ...]
                               [--json OUT.json]

Each kernel is built as the ops build it (`compile_for`, TileLang + nvcc) for --arch, and its SASS
(TileLang's `export_sass`: nvcc, then nvdisasm or cuobjdump) is counted by opcode class. Needs nvcc
and nvdisasm or cuobjdump on PATH: the CUDA toolkit has them, and the disassemblers also come as
the PyPI wheels `nvidia-cuda-nvdisasm` and `nvidia-cuda-cuobjdump`. No GPU is needed, so a change to a
kernel's instruction mix (the indexer's scoring is bound by its instruction count on an H200,
BENCHMARKS.md) can be seen before it is timed. The counts are static: a loop body counts once.
"loop" is the longest loop's body (the span of the backward branch that covers the most
instructions, branches after the last EXIT left out): a kernel's main loop, per trip; where the
body branches, both sides count.
--set overrides an integer constant of a kernel module (the first family module that has it)
before the builds, as the GPU benchmarks' --set does: a variant is counted before it is timed.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from quant import tuning  # benchmarks/ is the script's path: the GPU benchmarks' --set

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
ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?[A-Z]")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_x_\d+)\)")
FAMILIES = {"quant": "dsv41c.tilelang_kernels.quant", "mhc": "dsv41c.tilelang_kernels.mhc",
            "attention": "dsv41c.tilelang_kernels.attention", "indexer": "dsv41c.tilelang_kernels.indexer"}


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
        yield "attention", "packed_fp8 pair decode H=64 d=512", attention.build(
            "packed_fp8", "bfloat16", 64, 512, 512 ** -0.5, target, split=True, pair=True)
        yield "attention", "combine H=64 d=512", attention.build("combine", "bfloat16", 64, 512, 0.0, target)
    if "indexer" in families:
        from dsv41c.tilelang_kernels import indexer
        yield "indexer", "scores H=32 d=128 (block max)", indexer.build("scores", (32, 128, False, False, True), target)
        yield "indexer", "scores H=32 d=128 (candidates)", indexer.build("scores", (32, 128, False, True, False), target)
        for mode in ("topk", "cand"):
            for phase in indexer.SELECT_PHASES:
                yield "indexer", f"select {mode} {phase}", indexer.build("select", (mode, phase), target)


def sass(kernel) -> str:
    """A built kernel's SASS (TileLang recompiles its CUDA source with the build's flags and
    disassembles it with nvdisasm or cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.sass"
        kernel.export_sass(str(path))
        return path.read_text()


def opcode_counts(text: str) -> collections.Counter:
    return collections.Counter(m.group(1) for line in text.splitlines() if (m := OPCODE.match(line)))


def longest_loop(text: str) -> int:
    """Instructions from a backward branch's target to the branch, for the branch that spans the
    most (0 if the code has no backward branch). Branches after the last EXIT are left out: ptxas
    puts the retry paths of waits there (an mbarrier's try_wait), each jumping back into the code
    it left, which is no loop."""
    labels, spans, address, last_exit = {}, [], None, None
    for line in text.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = None  # its address: the next instruction's
        elif m := ADDRESS.match(line):
            address = int(m.group(1), 16)
            for name, at in labels.items():
                if at is None:
                    labels[name] = address
            if (b := BRANCH.search(line)) and labels.get(b.group(1)) is not None and labels[b.group(1)] < address:
                spans.append((address, (address - labels[b.group(1)]) // 16 + 1))
            if OPCODE.match(line).group(1) == "EXIT":
                last_exit = address
    return max((n for at, n in spans if last_exit is None or at < last_exit), default=0)


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
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override an integer constant of a kernel module (a variant) before the builds")
    parser.add_argument("--json", default=None, help="also write the rows here")
    opts = parser.parse_args()
    modules = [importlib.import_module(FAMILIES[f]) for f in opts.family]
    for a in opts.set:
        name = a.partition("=")[0]
        module = next((m for m in modules if isinstance(getattr(m, name, None), int)), modules[0])
        tuning(module, [a])
    if shutil.which("nvcc") is None:
        sys.exit("sass.py: nvcc is not on PATH (the CUDA toolkit compiles the kernels)")
    if shutil.which("nvdisasm") is None and shutil.which("cuobjdump") is None:
        sys.exit("sass.py: neither nvdisasm nor cuobjdump is on PATH (the CUDA toolkit has both; the PyPI "
                 "wheels nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump too)")
    rows = []
    if opts.set:
        print(f"overrides: {', '.join(opts.set)}")
    print(f"| family | kernel | total | loop | {' | '.join(NAMES)} |")
    print(f"|---|---|---:|---:|{'---:|' * len(NAMES)}")
    for family, name, kernel in kernels(opts.family, opts.arch):
        text = sass(kernel)
        ops = opcode_counts(text)
        if not ops:
            sys.exit(f"sass.py: no instructions found in the SASS of {family} {name}")
        by_class, loop = classify(ops), longest_loop(text)
        rows.append({"family": family, "kernel": name, "total": sum(ops.values()), "loop": loop, "classes": by_class,
                     "opcodes": dict(ops.most_common()), "overrides": opts.set})
        print(f"| {family} | {name} | {sum(ops.values())} | {loop} | "
              + " | ".join(str(by_class[c]) for c in NAMES) + " |", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
