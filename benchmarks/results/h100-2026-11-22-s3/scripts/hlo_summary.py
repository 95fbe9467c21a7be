"""Summarize an optimized HLO dump: the kernels of the biggest computation (the decode-loop body)
in order, each with its fused ops and output shape. Dev helper."""
import re, sys, collections
text = open(sys.argv[1]).read()
comps, cur, name = {}, None, None
for line in text.splitlines():
    m = re.match(r'^(ENTRY )?%?([\w.\-]+) .*\{\s*$', line)
    if m and not line.startswith(' '):
        name = m.group(2); cur = comps.setdefault(name, []); continue
    if line.startswith('}'):
        cur = None; continue
    if cur is not None and '=' in line:
        cur.append(line.strip())
def ops(c):
    out = []
    for l in comps.get(c, []):
        m = re.match(r'%?[\w.\-]+ = (\S+) ([\w\-]+)\(', l)
        if m and m.group(2) not in ('parameter', 'constant', 'get-tuple-element', 'bitcast', 'tuple'):
            out.append(m.group(2))
    return out
body = max(comps, key=lambda c: sum(' fusion(' in l or 'custom-call(' in l for l in comps[c]))
print("body:", body, len(comps[body]), "instructions")
kinds = collections.Counter()
for l in comps[body]:
    m = re.match(r'%?([\w.\-]+) = (\S+) ([\w\-]+)\(', l)
    if not m:
        continue
    nm, shape, op = m.groups()
    if op in ('parameter', 'constant', 'get-tuple-element', 'bitcast', 'tuple'):
        continue
    extra = ''
    c = re.search(r'calls=%?([\w.\-]+)', l)
    if c:
        o = ops(c.group(1)); extra = ','.join(o[:14]) + ('...' if len(o) > 14 else '')
    t = re.search(r'custom_call_target="([^"]+)"', l)
    if t:
        extra = t.group(1)
        kn = re.search(r'name\\?": ?\\?"([\w]+)', l) or re.search(r'"name":"(\w+)"', l)
        if kn: extra += ' ' + kn.group(1)
    kinds[op] += 1
    print(f"{nm[:40]:40s} {op:14s} {shape[:40]:40s} {extra[:160]}")
print(kinds)
