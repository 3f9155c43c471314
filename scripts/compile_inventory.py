"""What compiled on a first start (issue 20 item 6): the kernel cache root as a timeline.
Usage: python compile_inventory.py ROOT  (prints per-kernel counts and a timeline)"""
import collections, json, os, re, sys
root = sys.argv[1]
rows = []
for d, _, files in os.walk(root):
    for f in files:
        p = os.path.join(d, f)
        try:
            st = os.stat(p)
        except OSError:
            continue
        rows.append((st.st_mtime, p, st.st_size))
if not rows:
    print("empty", root); sys.exit(0)
t0 = min(r[0] for r in rows)
trit = []
other = collections.Counter()
for mt, p, sz in rows:
    if p.endswith(".json") and "/triton/" in p and not os.path.basename(p).startswith("__grp__"):
        try:
            m = json.load(open(p))
        except Exception:
            continue
        name = m.get("name") or os.path.basename(p)[:-5]
        sig = ""
        ttir = p[:-5] + ".ttir"
        if os.path.exists(ttir):
            head = open(ttir).read(20000)
            mm = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", head, re.S)
            if mm:
                sig = str(mm.group(1).count("tt.divisibility")) + "div"
        trit.append((mt - t0, name, m.get("num_warps"), m.get("num_stages"), sig))
    elif "/triton/" not in p:
        key = os.path.relpath(p, root).split(os.sep)[:3]
        other["/".join(key)] += 1
print(f"# triton kernels compiled: {len(trit)}")
c = collections.Counter(t[1] for t in trit)
for n, k in c.most_common():
    print(f"{k:4d} {n}")
print("# timeline (s from first file, name, warps, stages)")
for t in sorted(trit):
    print(f"{t[0]:8.1f} {t[1]} w{t[2]} s{t[3]} {t[4]}")
print("# other cache files by dir")
for k, v in sorted(other.items()):
    print(v, k)
mts = collections.defaultdict(list)
for mt, p, sz in rows:
    if "/triton/" not in p:
        mts["/".join(os.path.relpath(p, root).split(os.sep)[:3])].append(mt - t0)
for k, v in sorted(mts.items()):
    print(f"{k}: {min(v):.1f}..{max(v):.1f}s n={len(v)}")
