"""Opcode counts of the kernels in a SASS listing, to read a peer's kernel beside ours.

    cuobjdump -sass peer.so > peer.sass                 # or our CUTE_DSL_KEEP=sass dumps
    python benchmarks/sass_summary.py peer.sass --match splitkv_mla [--top 40]

Per matching function: instruction count, the opcodes that say what a mainloop does
(wgmma, TMA, cp.async, ldmatrix/stmatrix, exponentials, barriers, shared and global
memory, local memory) and the most frequent opcodes. Static counts: a loop body counts
once; ``--loops`` also prints each backward branch's body size (the instructions between
its target and itself), where the steady state is; ``--order START:END`` (hex addresses, as
``--loops`` prints them) prints that range's opcodes in issue order, runs of one opcode
merged, and how many exponentials each wgmma wait (``WARPGROUP.DEPBAR``) has before it: where
ptxas put a warpgroup's softmax against the wait for its previous P V.
"""

import argparse
import re
import sys
from collections import Counter

KEY_OPS = ("HGMMA", "QGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "UTMALDG", "UTMASTG", "UBLKCP", "LDGSTS", "LDSM",
           "STSM", "MUFU.EX2", "BAR.SYNC", "BAR.ARV", "SYNCS", "LDS", "STS", "LDG", "STG", "LDL", "STL", "SHFL",
           "FFMA", "FMUL", "FADD", "FMNMX", "F2FP")
_FUNC = re.compile(r"(?:Function\s*:\s*(\S+))|(?://-+\s*\.text\.(\S+)\s*-+)")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)|\b(0x[0-9a-f]+)\b")


def functions(text: str):
    """(name, lines) of each function of a cuobjdump (``Function : name``) or nvdisasm
    (``//---- .text.name ----``) listing."""
    out, name, lines = [], None, []
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            if name is not None:
                out.append((name, lines))
            name, lines = m.group(1) or m.group(2), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out.append((name, lines))
    return out


def parse(lines):
    """[(address, opcode, operands)] and {label: address of the next instruction}."""
    insns, labels, pending = [], {}, []
    for line in lines:
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            insns.append((addr, m.group(2), m.group(3)))
    return insns, labels


def summary(name: str, lines, top: int, loops: bool) -> str:
    insns, labels = parse(lines)
    ops = Counter(op for _, op, _ in insns)
    lines_out = [f"{name}\n  instructions: {len(insns)}"]
    for key in KEY_OPS:
        n = sum(c for op, c in ops.items() if op == key or op.startswith(key + "."))
        if n:
            lines_out.append(f"  {key:18s} {n}")
    lines_out.append("  top: " + ", ".join(f"{op} {c}" for op, c in ops.most_common(top)))
    if loops:
        for addr, op, rest in insns:
            if not op.startswith("BRA"):
                continue
            t = _TARGET.search(rest)
            if t is None:
                continue
            dst = labels.get(t.group(1)) if t.group(1) else int(t.group(2), 16)
            if dst is None or dst >= addr:
                continue
            body = Counter(o for a, o, _ in insns if dst <= a <= addr)
            hot = ", ".join(f"{o} {c}" for o, c in body.most_common(8))
            lines_out.append(f"  loop {dst:#x}..{addr:#x}: {sum(body.values())} instructions ({hot})")
    return "\n".join(lines_out)


def order(lines, start: int, end: int) -> str:
    """The opcodes of [start, end] in issue order (predicates dropped, modifiers cut at the
    first dot), runs of one opcode merged as ``OP xN``; then each ``WARPGROUP.DEPBAR`` with
    the count of ``MUFU.EX2`` before it in the range."""
    insns, _ = parse(lines)
    ops = [op for a, op, _ in insns if start <= a <= end]
    runs = []
    for op in ops:
        short = op.split(".")[0]
        if runs and runs[-1][0] == short:
            runs[-1][1] += 1
        else:
            runs.append([short, 1])
    out = [f"  order {start:#x}..{end:#x}: {len(ops)} instructions",
           "  " + ", ".join(f"{op} x{n}" if n > 1 else op for op, n in runs)]
    ex2 = 0
    for op in ops:
        if op.startswith("MUFU.EX2"):
            ex2 += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            out.append(f"  {op}: after {ex2} of the range's {sum(o.startswith('MUFU.EX2') for o in ops)} MUFU.EX2")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sass")
    p.add_argument("--match", default="", help="substring of the function names to summarise")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--loops", action="store_true")
    p.add_argument("--order", default="", help="START:END, hex addresses: that range's opcodes in issue order")
    args = p.parse_args(argv)
    text = open(args.sass, errors="replace").read()
    found = [(n, b) for n, b in functions(text) if args.match in n]
    if not found:
        sys.exit(f"no function matching {args.match!r} in {args.sass}")
    for name, body in found:
        print(summary(name, body, args.top, args.loops))
        if args.order:
            start, end = (int(x, 16) for x in args.order.split(":"))
            print(order(body, start, end))


if __name__ == "__main__":
    main()
