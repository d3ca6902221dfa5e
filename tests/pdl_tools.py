"""What a programmatic-dependent-launch kernel does before ``griddepcontrol.wait``, read from its PTX or SASS.

K3.md failure 2 is a kernel that reads its predecessor's output before the wait. Both readers turn the
code into instructions (``Insn``: registers written and read, parameter words read, branch target,
memory access), run a forward data-flow analysis over the code before the first wait (per program
point, strong updates, branches and loops followed) that labels every register with the pointer
parameters its value derives from, and list every global access there with the parameters its address
derives from (``Region``). A test then requires those to be weights only. The wait itself must be
unpredicated, no branch may skip it or jump back over it, no exit may precede it, and
``launch_dependents`` must follow it.

PTX names the instructions (``griddepcontrol.wait`` / ``.launch_dependents``) and reads pointers with
``ld.param``; SASS (nvdisasm) names them ``ACQBULK`` / ``PREEXIT`` and reads pointers from the constant
bank (``c[0x0][0x210 + offset]`` on sm_90, offsets from the PTX parameter list).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PARAM_BASE = 0x210  # sm_90: kernel parameters start at c[0x0][0x210]


@dataclass
class Param:
    name: str  # the role a test gives it (x, weight, ...)
    ptx: str  # PTX symbol
    offset: int  # byte offset in the parameter buffer
    size: int
    pointer: bool  # a tensor: an aggregate whose first 8 bytes are the pointer


@dataclass
class Insn:
    text: str
    dests: tuple[str, ...] = ()
    srcs: tuple[str, ...] = ()
    consts: frozenset = frozenset()  # pointer parameters read directly (ld.param, c[0x0][...])
    predicated: bool = False
    label: str | None = None  # a label, not an instruction
    target: str | None = None  # branch target
    uncond: bool = False  # control never falls through (unconditional branch, exit, ret)
    kind: str = ""  # "read" | "write" | "wait" | "trigger" | "end" | ""
    addr: tuple[str, ...] = ()  # registers of the global address (read / write)


@dataclass
class Region:
    """The code before the first wait: its global reads (instruction, parameters of the address), problems."""

    loads: list[tuple[str, frozenset]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


# ------------------------------------------------------------------------------------------ data flow
def _flow(insns: list[Insn]) -> list[dict[str, frozenset]]:
    """The register labels before each instruction (None: unreachable), to a fixpoint over the branches."""
    at = {ins.label: n for n, ins in enumerate(insns) if ins.label}
    states: list = [None] * len(insns)
    if insns:
        states[0] = {}
    changed = True
    while changed:
        changed = False
        for n, ins in enumerate(insns):
            st = states[n]
            if st is None:
                continue
            lab = ins.consts.union(*(st.get(r, frozenset()) for r in ins.srcs))
            out = dict(st)
            for d in ins.dests:
                out[d] = (st.get(d, frozenset()) | lab) if ins.predicated else lab
            succ = [] if ins.uncond or n + 1 >= len(insns) else [n + 1]
            if ins.target in at:
                succ.append(at[ins.target])
            for s in succ:
                if states[s] is None:
                    states[s], changed = dict(out), True
                    continue
                for r, v in out.items():
                    if not v <= states[s].get(r, frozenset()):
                        states[s][r] = states[s].get(r, frozenset()) | v
                        changed = True
    return states


def check_region(insns: list[Insn], weights: set[str], wait: str = "griddepcontrol.wait") -> Region:
    region = Region()
    kinds = [ins.kind for ins in insns]
    if "wait" not in kinds:
        region.problems.append(f"no {wait}")
        return region
    w = kinds.index("wait")
    if insns[w].predicated:
        region.problems.append(f"the first wait is predicated: {insns[w].text}")
    if "trigger" not in kinds:
        region.problems.append("no launch_dependents")
    elif kinds.index("trigger") < w:
        region.problems.append("launch_dependents before the wait")
    at = {ins.label: n for n, ins in enumerate(insns) if ins.label}
    for n, ins in enumerate(insns):
        t = at.get(ins.target)
        if t is not None and n < w < t:
            region.problems.append(f"a branch before the wait skips it: {ins.text}")
        if t is not None and t < w < n:
            region.problems.append(f"a branch after the wait jumps back before it: {ins.text}")
        if n < w and ins.kind == "end":
            region.problems.append(f"{ins.text} before the wait")
    pre = insns[:w]
    states = _flow(pre)
    for ins, st in zip(pre, states, strict=True):
        if ins.kind == "write":
            region.problems.append(f"global write before the wait: {ins.text}")
        elif ins.kind == "read":
            st = st or {}
            src = ins.consts.union(*(st.get(r, frozenset()) for r in ins.addr))
            region.loads.append((ins.text, src))
            if not src or not src <= weights:
                region.problems.append(f"global read before the wait from {sorted(src) or 'an unknown address'}: "
                                       f"{ins.text}")
    return region


# ------------------------------------------------------------------------------------------ PTX
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\S+?)(?:\[(\d+)\])?\s*[,)]?\s*$")
_PTX_REG = re.compile(r"%[a-z]+\d+")
_SCALAR_BYTES = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4,
                 "u16": 2, "b16": 2, "s16": 2, "u8": 1, "b8": 1, "s8": 1}
_SPACES = ("param", "shared", "local", "const", "global")
_PTX_NO_DEST = ("st", "cp", "prefetch", "bar", "bra", "ret", "exit", "griddepcontrol", "red", "fence", "membar")


def ptx_params(ptx: str, roles: list[str]) -> list[Param]:
    """The entry's parameters in order, named by ``roles`` (their count must match), with buffer offsets."""
    entries = ptx.count(".entry ")
    assert entries == 1, f"expected one kernel entry, found {entries}"
    start = ptx.index(".entry ")
    out, off = [], 0
    for line in ptx[start:ptx.index(")", start)].splitlines():
        m = _PARAM.search(line.strip())
        if not m:
            continue
        align, typ, sym, n = m.group(1), m.group(2), m.group(3), m.group(4)
        size = int(n) if n else _SCALAR_BYTES[typ]
        a = int(align) if align else size
        off = -(-off // a) * a
        out.append(Param("", sym, off, size, pointer=bool(n) and int(align or 0) == 8))
        off += size
    assert len(out) == len(roles), f"kernel has {len(out)} parameters, the test names {len(roles)}: {roles}"
    for p, r in zip(out, roles, strict=True):
        p.name = r
    return out


def _ptx_space(op: str) -> str | None:
    """The state space an ld / st / atom names (None: generic addressing, which may be global)."""
    return next((p.split("::")[0] for p in op.split(".")[1:] if p.split("::")[0] in _SPACES), None)


def ptx_insns(ptx: str, params: list[Param]) -> list[Insn]:
    by_sym = {p.ptx: p for p in params}
    body = ptx[ptx.index("{", ptx.index(".entry ")) + 1:]
    out = []
    for raw in body.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith((".reg", ".shared", ".local", "{", "}")):
            continue
        if line.endswith(":"):
            out.append(Insn(line, label=line[:-1]))
            continue
        pred = re.match(r"@!?%p\d+\s+", line)
        ins = line[pred.end():] if pred else line
        op, _, rest = ins.rstrip(";").partition(" ")
        ops = split_operands(rest)
        base = op.split(".")[0]
        i = Insn(line, predicated=bool(pred))
        brackets = [o for o in ops if o.startswith("[")]
        if op.startswith("griddepcontrol.wait"):
            i.kind = "wait"
        elif op.startswith("griddepcontrol.launch_dependents"):
            i.kind = "trigger"
        elif base == "bra":
            i.target, i.uncond = ops[0], not pred
        elif base in ("ret", "exit"):
            i.kind, i.uncond = "end", not pred
        elif ((base in ("st", "atom", "red") and _ptx_space(op) in (None, "global"))
              or op.startswith(("cp.reduce.async.bulk", "cp.async.bulk.global"))):
            i.kind = "write"
        elif brackets and ((base in ("ld", "ldu") and _ptx_space(op) in (None, "global"))
                           or op.startswith(("cp.async", "prefetch"))):
            i.kind = "read"  # cp.async.<..>.shared.global [dst], [src]: the global address is the second
            i.addr = tuple(_PTX_REG.findall(brackets[1] if op.startswith("cp.async") and len(brackets) > 1
                                            else brackets[0]))
        if base == "ld" and _ptx_space(op) == "param":
            m = re.search(r"\[(\S+?)(\+\d+)?\]", ops[1])
            p = by_sym.get(m.group(1)) if m else None
            if p is not None and p.pointer and not m.group(2):
                i.consts = frozenset({p.name})
        if ops and base not in _PTX_NO_DEST and not (base == "atom"):
            i.dests = tuple(_PTX_REG.findall(ops[0]))
            i.srcs = tuple(r for o in ops[1:] for r in _PTX_REG.findall(o))
        out.append(i)
    return out


def ptx_pre_wait(ptx: str, params: list[Param], weights: set[str]) -> Region:
    return check_region(ptx_insns(ptx, params), weights)


# ------------------------------------------------------------------------------------------ SASS
_SASS_REG = re.compile(r"\b(U?R)(\d+)(\.64|\.128)?\b")
_CBANK = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_SASS_PRED = re.compile(r"^!?U?P(T|\d+)$")
_SASS_NO_DEST = ("ST", "STG", "STS", "STL", "RED", "REDG", "UBLKPF", "BRA", "BAR", "EXIT", "ACQBULK", "PREEXIT",
                 "LDGSTS", "MEMBAR", "FENCE", "WARPSYNC", "BSYNC", "BSSY", "CCTL", "ERRBAR", "NOP", "RET", "CALL",
                 "DEPBAR", "LDGDEPBAR", "SYNCS", "ARRIVES", "UTMALDG", "UTMAPF", "UTMASTG", "BPT")
_SASS_WRITES = ("STG", "ST", "RED", "REDG", "UTMASTG", "UBLKCP", "UBLKRED")
_SASS_READS = ("LDG", "LD", "LDGSTS", "UBLKPF", "UTMALDG", "UTMAPF")


def sass_op(line: str) -> str:
    return re.sub(r"^@!?U?P[T\d]+\s+", "", line).split(" ")[0]


def _regs(text: str, width: int = 0) -> list[str]:
    regs = []
    for kind, n, suffix in _SASS_REG.findall(text):
        k = max(width, {".64": 2, ".128": 4}.get(suffix, 1))
        regs += [f"{kind}{int(n) + j}" for j in range(k)]
    return regs


def _width(op: str) -> int:
    if ".128" in op:
        return 4
    return 2 if (".64" in op or ".WIDE" in op) else 1


def sass_insns(lines: list[str], params: list[Param]) -> list[Insn]:
    words = {PARAM_BASE + p.offset + b: p.name for p in params if p.pointer for b in (0, 4)}

    def cbank(text: str, width: int) -> frozenset:
        return frozenset(words[int(h, 16) + 4 * j] for h in _CBANK.findall(text) for j in range(width)
                         if int(h, 16) + 4 * j in words)

    out = []
    for line in lines:
        if line.startswith(".L"):
            out.append(Insn(line, label=line))
            continue
        pred = re.match(r"@!?U?P[T\d]+\s+", line)
        ins = line[pred.end():] if pred else line
        op, _, rest = ins.partition(" ")
        base = op.split(".")[0]
        ops = split_operands(rest)
        i = Insn(line, predicated=bool(pred))
        brackets = re.findall(r"\[([^\]]*)\]", rest)
        if base == "ACQBULK":
            i.kind = "wait"
        elif base == "PREEXIT":
            i.kind = "trigger"
        elif base == "BRA":
            m = re.search(r"`\((\.L_x_\d+)\)", rest)
            i.target, i.uncond = (m.group(1) if m else None), not pred
        elif base in ("EXIT", "RET"):
            i.kind, i.uncond = "end", not pred
        elif base in _SASS_WRITES or (base.startswith("ATOM") and base != "ATOMS"):
            i.kind = "write"
        elif base in _SASS_READS and brackets:
            i.kind = "read"  # LDGSTS [smem], [global]: the global address is the last bracket
            addr = brackets[0] if base in ("UBLKPF", "UTMAPF", "UTMALDG") else brackets[-1]
            i.addr = tuple(_regs(addr))
            i.consts = cbank(addr, 2)
        if base in ("R2UR", "SHFL"):  # a predicate first, then the register written
            ops = [o for o in ops if not _SASS_PRED.match(o)]
        if ops and base not in _SASS_NO_DEST and not _SASS_PRED.match(ops[0]):
            w = _width(op)
            dest = _regs(ops[0])
            if dest:
                kind, n = re.match(r"(U?R)(\d+)", dest[0]).groups()
                i.dests = tuple(f"{kind}{int(n) + j}" for j in range(max(w, len(dest))))
            i.srcs = tuple(r for o in ops[1:] for r in _regs(o))
            if i.kind != "read":
                i.consts = cbank(" ".join(ops[1:]), w)
        out.append(i)
    return out


def sass_pre_wait(lines: list[str], params: list[Param], weights: set[str]) -> Region:
    return check_region(sass_insns(lines, params), weights, wait="ACQBULK")
