import sys, collections, re
c = collections.defaultdict(collections.Counter); tid=None; first=False
for line in sys.stdin:
    s=line.strip()
    if not s: continue
    if re.fullmatch(r'\d+', s): tid=s; first=True; continue
    if first:
        m=re.match(r'(\S+)\s+(.*?)\s*\(([^)]*)\)$', s)
        ip,sym,d = m.group(1), m.group(2), m.group(3).split('/')[-1]
        if d in ('libpython3.11.so.1.0','libtorch_python.so','libc.so.6','libtorch_cpu.so','libc10.so','kernel.kallsyms'): sym='(host: '+d+')'
        elif 'main.so' in d: sym='(inductor cpp)'
        elif 'libgomp' in d: sym='(gomp '+ip+')'
        c[tid][sym[:60]]+=1; first=False
for t,cc in c.items():
    tot=sum(cc.values()); print('tid',t,tot)
    for k,v in cc.most_common(16): print(f'  {100*v/tot:5.1f}% {k}')
