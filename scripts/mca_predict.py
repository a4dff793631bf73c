"""Predicted (not measured) throughput of the CPU kernels' QKᵀ and P·V inner loops on CPUs this
machine does not have: each loop's body is taken from the generated assembly and run through
``llvm-mca`` for the CPU's scheduling model, and its FMA rate compared with the same model's rate for
a block of independent FMAs of the same instruction (the CPU's peak, by that model; RVV: on the loop's
register group, `peak_block`).

    python scripts/mca_predict.py [--markdown]

The inner loops are the blocks that branch back to themselves; the first with vector FMAs is QKᵀ's
register tile (the scores come first in the kernel), the last P·V's. RISC-V: LLVM 19's SpacemiT X60
has no scheduling model, so the RVV-256 kernel is read by SiFive X280's (and P670's) instead.
Needs llvm-mca (Debian's ``llvm``; the newest ``llvm-mca-NN`` on PATH is used: LLVM 19 has the
Neoverse V1/V2 and SiFive vector models, 14 has not).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import tempfile

import tvmattn
from tvmattn.compiler.cross import cpus
from tvmattn.compiler.cross.toolchain import MCA, program
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import isa_of

# (tvmattn CPU, llvm-mca's -mcpu, -mattr): the RVV-256 kernel read by two SiFive vector cores' models
MODELS = [("neoverse-v1", "neoverse-v1", ""), ("neoverse-v2", "neoverse-v2", ""), ("cortex-a76", "cortex-a76", ""),
          ("neoverse-n1", "neoverse-n1", ""), ("spacemit-x60", "sifive-x280", "+v"),
          ("spacemit-x60", "sifive-p670", "+v")]
SPEC = dict(batch=1, seq_len=256, num_heads=8, head_dim=64, projections=False)  # a prefill core
# the multiply-accumulate instructions: name → (pattern, fp32 lanes' products each does: a bfdot lane's
# two count two, its work), and a block of independent ones: the model's peak for it
MACS = {"fmla.4s": (r"fmla\tv\d+\.4s", 4), "fmla.z": (r"(fmla|fmad)\tz\d+\.s", 8),
        "vfmacc": (r"(vfmacc|vfmadd)\.v[fv]\t", 8), "bfdot": (r"bfdot\tv\d+\.4s", 8),
        "bfdot.z": (r"bfdot\tz\d+\.s", 16), "fmla.8h": (r"fmla\tv\d+\.8h", 8),
        "fmla.zh": (r"(fmla|fmad)\tz\d+\.h", 16)}
PEAK_BLOCK = {
    "fmla.4s": [f"fmla\tv{i}.4s, v30.4s, v31.s[0]" for i in range(24)],
    "fmla.z": ["ptrue\tp0.s, vl8"] + [f"fmla\tz{i}.s, p0/m, z30.s, z31.s" for i in range(24)],
    "bfdot": [f"bfdot\tv{i}.4s, v30.8h, v31.2h[0]" for i in range(24)],
    "bfdot.z": [f"bfdot\tz{i}.s, z30.h, z31.h" for i in range(24)],
    "fmla.8h": [f"fmla\tv{i}.8h, v14.8h, v15.h[0]" for i in (*range(14), *range(16, 26))],  # (.h[i]: v0-v15)
    "fmla.zh": ["ptrue\tp0.h, vl16"] + [f"fmla\tz{i}.h, p0/m, z30.h, z31.h" for i in range(24)],
}


def macs(body: list[str]) -> dict[str, int]:
    """The fp32 lanes' products of ``body``'s multiply-accumulates, by kind (RVV's times the register
    group its ``vsetvli`` sets: RVV-256's kernels run on groups of two)."""
    group = max((int(m.group(1)) for i in body if i.startswith("vset") and (m := re.search(r", m(\d)", i))), default=1)
    found = {kind: sum(lanes for i in body if re.match(pattern, i)) for kind, (pattern, lanes) in MACS.items()}
    return {kind: n * (group if kind == "vfmacc" else 1) for kind, n in found.items() if n}


def peak_block(kind: str, body: list[str]) -> list[str]:
    """A block of independent multiply-accumulates of ``kind`` in the form ``body`` runs them (RVV: on
    its register groups, by the ``vsetvli`` `inner_loops` gives every RVV loop)."""
    if kind != "vfmacc":
        return PEAK_BLOCK[kind]
    vtype = next(i for i in body if i.startswith("vset"))
    group = int(re.search(r", m(\d)", vtype).group(1))
    return [vtype] + [f"vfmacc.vf\tv{group * i}, fa0, v{32 - group}" for i in range(1, 32 // group - 1)]
_LABEL = re.compile(r"^([.\w$]+):")
_FALLTHROUGH = re.compile(r"^\s*(//|#|;)\s*%bb\.\d+:")


def mca_program() -> str:
    """The newest llvm-mca-NN on PATH, else llvm-mca."""
    found = sorted({int(m.group(1)) for d in os.environ.get("PATH", "").split(os.pathsep) if os.path.isdir(d)
                    for f in os.listdir(d) if (m := re.fullmatch(r"llvm-mca-(\d+)", f))})
    return f"llvm-mca-{found[-1]}" if found else program(*MCA, "predict the kernels' throughput")


def inner_loops(asm: str, comment: str) -> list[list[str]]:
    """The instructions from each label to a branch back to it with no label between, in order
    (``comment``: the assembly's comment marker, // on aarch64, where # starts an immediate; # on RISC-V).
    RVV: the loop's body after the last ``vsetvli`` before it, which sets the vector type its
    instructions run at (llvm-mca assumes the widest register group without one)."""
    loops: list[list[str]] = []
    label, body, vtype = None, [], []
    for line in asm.splitlines():
        start = _LABEL.match(line)
        if start or _FALLTHROUGH.match(line):
            label, body = (start.group(1) if start else None), []
            continue
        text = line.split(comment)[0].strip()
        if not text or text.startswith("."):
            continue
        body.append(text)
        if label is not None and re.search(rf"[\s,]{re.escape(label)}$", text):
            loops.append(vtype + body if not any(i.startswith("vset") for i in body) else body)
            label, body = None, []
        if text.startswith("vset"):
            vtype = [text]
    return loops


def cycles(mca: str, mcpu: str, mattr: str, arch: str, body: list[str]) -> float:
    """llvm-mca's cycles per iteration of ``body``."""
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write("\n".join(body) + "\n")
        f.flush()
        command = [mca, f"-mtriple={arch}", f"-mcpu={mcpu}", "-iterations=200", f.name]
        out = subprocess.run(command + ([f"-mattr={mattr}"] if mattr else []), capture_output=True, text=True,
                             check=True).stdout
    total = float(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return total / float(re.search(r"Iterations:\s+(\d+)", out).group(1))


def predict(mca: str, cpu: str, mcpu: str, mattr: str, dtype: str) -> dict:
    arch = cpus.CPUS[cpu].arch
    kernel = tvmattn.compile(AttentionSpec(**SPEC, dtype=dtype), arch, mcpu=cpu, tuned=False)
    isa = isa_of(kernel.target).name
    comment = "//" if arch == "aarch64" else "#"
    loops = [body for body in inner_loops(kernel.source(), comment) if macs(body)]
    row = {"cpu": cpu, "model": mcpu, "isa": isa, "dtype": dtype}
    for name, body in (("qk", loops[0]), ("pv", loops[-1])):
        found = macs(body)
        kind = max(found, key=found.get)  # the loop's main instruction: its peak is the loop's
        block = peak_block(kind, body)
        peak = sum(macs(block).values()) / cycles(mca, mcpu, mattr, arch, block)
        per_cycle = sum(found.values()) / cycles(mca, mcpu, mattr, arch, body)
        row[name] = (len(body), kind, per_cycle, per_cycle / peak)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    mca = mca_program()
    rows = [predict(mca, cpu, mcpu, mattr, dtype) for cpu, mcpu, mattr in MODELS
            for dtype in ("float32", "bfloat16", "float16")]
    fp32 = {(r["cpu"], r["model"]): r for r in rows if r["dtype"] == "float32"}
    print(f"{mca}; {SPEC}; per loop: its instructions, main instruction, fp32 products per cycle (a bfdot lane's "
          "two count two), fraction of the model's peak for that instruction; bf16, fp16: × fp32's products per cycle")
    if args.markdown:
        print("| CPU (llvm-mca model) | record | dtype | QKᵀ loop | QKᵀ % of peak | P·V loop | P·V % of peak "
              "| × fp32 (QKᵀ, P·V) |")
        print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        qk, pv = r["qk"], r["pv"]
        base = fp32[(r["cpu"], r["model"])]
        speedup = f"{qk[2] / base['qk'][2]:.2f}×, {pv[2] / base['pv'][2]:.2f}×" if r["dtype"] != "float32" else ""
        if args.markdown:
            print(f"| {r['cpu']} ({r['model']}) | {r['isa']} | {r['dtype']} | {qk[0]} instr, {qk[1]} "
                  f"| {100 * qk[3]:.0f} % | {pv[0]} instr, {pv[1]} | {100 * pv[3]:.0f} % | {speedup} |")
        else:
            print(f"{r['cpu']:13s} {r['model']:12s} {r['isa']:9s} {r['dtype']:9s} "
                  f"QKᵀ {qk[0]:3d} instr {qk[1]:7s} {qk[2]:5.2f}/c {100 * qk[3]:4.0f} %  "
                  f"P·V {pv[0]:3d} instr {pv[1]:7s} {pv[2]:5.2f}/c {100 * pv[3]:4.0f} %  {speedup}")


if __name__ == "__main__":
    main()
