"""SASS checks of the Hopper forward's warpgroup MMAs (issue 29), for a build of forward_sm90.cu:
  cuobjdump -sass forward_sm90.o > fwd.sass && python bench/sass_check_fwd90.py fwd.sass
(cuobjdump and nvdisasm: the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels if the toolkit
lacks them). Per kernel instantiation:
  - Q clobber: instructions that write a register of the S MMA's A operand (Q's fragments, which
    every key tile reads again) after the first S MMA. Must be 0 up to the epilogue; f3bc00f's
    DP = 64 build had 90 inside the key-tile loop (ptxas put P there when the PV MMA had the S
    MMA's shape, m64n64k16).
  - in-flight hazards: between an HGMMA and the next WARPGROUP.DEPBAR in program order, a
    non-HGMMA instruction that writes its A registers or reads/writes its accumulators.
Heuristic text scans (program order, not the control-flow graph): a clean result is evidence, not
proof.
"""
import re
import sys


def regs_in(s):
    return {int(m.group(1)) for m in re.finditer(r'\bR(\d+)\b', s)}


def check(txt):
    for f in re.split(r'\n\s+Function : ', txt)[1:]:
        m = re.search(r'kernelI(6__half|13__nv_bfloat16)Li(\d+)', f.split('\n')[0])
        if not m:
            continue
        ins = [(int(a, 16), i.strip()) for a, i in re.findall(r'/\*([0-9a-f]{4,5})\*/\s+([^;]*);', f)]
        qregs, first = set(), None
        for a, i in ins:
            mm = re.match(r'HGMMA\.\S+ R\d+, R(\d+), gdesc\[\w+\](\.tnspB)?', i)
            if mm and not mm.group(2):
                qregs |= set(range(int(mm.group(1)), int(mm.group(1)) + 4))
                first = a if first is None else first
        clobber = []
        for a, i in ins:
            mm = re.match(r'(@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)\s+R(\d+)', i)
            if first is not None and a > first and mm and int(mm.group(3)) in qregs and \
                    not mm.group(2).startswith(('HGMMA', 'ST', 'RED', 'ATOM', 'SYNCS', 'BAR',
                                                'WARPGROUP', 'ISETP', 'FSETP', 'BRA', 'R2P', 'VOTE')):
                clobber.append((hex(a), i))
        haz = []
        for k, (a, i) in enumerate(ins):
            mm = re.match(r'HGMMA\.64x(\d+)x16\S* R(\d+), R(\d+), gdesc', i)
            if not mm:
                continue
            n, c0, a0 = int(mm.group(1)), int(mm.group(2)), int(mm.group(3))
            acc, A = set(range(c0, c0 + n // 2)), set(range(a0, a0 + 4))
            for a2, i2 in ins[k + 1:]:
                if i2.startswith('WARPGROUP.DEPBAR'):
                    break
                if i2.startswith(('HGMMA', 'WARPGROUP.ARRIVE')):
                    continue
                parts = re.sub(r'^@!?U?P\w+\s+', '', i2).split(None, 1)
                if len(parts) < 2:
                    continue
                md = re.match(r'R(\d+)', parts[1])
                if md and not parts[0].startswith(('ST', 'RED', 'ATOM', 'SYNCS', 'BRA', 'ISETP',
                                                   'FSETP', 'R2P', 'VOTE')):
                    if int(md.group(1)) in A | acc:
                        haz.append((hex(a2), 'write', i2))
                    src = regs_in(parts[1][md.end():])
                else:
                    src = regs_in(parts[1])
                if src & acc:
                    haz.append((hex(a2), 'read acc', i2))
        print(f"{m.group(1)} DP={m.group(2)}: Q clobber {len(clobber)}, in-flight hazards {len(haz)}",
              clobber[:2], haz[:2])


if __name__ == "__main__":
    check(open(sys.argv[1]).read())
