"""The suite's worker-seconds per test file, from a `make test` log with `PYTEST_ADDOPTS="-v"` whose lines each begin
with a Unix time (`... | python3 -u -c "import sys,time; [print(f'{time.time():.0f} {l}', end='', flush=True) for l in sys.stdin]"`):
each passed test's span is from the end of the previous test on its worker to its own end. Two logs: the cases both ran (the
same test id), summed, then the files both have, side by side. Usage: python benchmarks/suite_by_file.py LOG [OTHER_LOG]"""

from __future__ import annotations

import collections
import re
import sys


def spans(path):
    """Each passed test id's span in worker-seconds, and the log's first test start to its last test end."""
    end, worker, passed = {}, {}, set()
    first = None
    for line in open(path):
        m = re.match(r"(\d+) (.*)", line)
        if not m:
            continue
        ts, rest = int(m[1]), m[2]
        m3 = re.match(r"(tests/\S+::\S+) ?$", rest)
        if m3 and first is None:
            first = ts
        m2 = re.match(r"\[(gw\d)\] \[ *\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+)", rest)
        if m2:
            end[m2[3]] = ts
            worker[m2[3]] = m2[1]
            if m2[2] == "PASSED":
                passed.add(m2[3])
    byw, span = collections.defaultdict(list), {}
    for k in end:
        byw[worker[k]].append((end[k], k))
    for w in byw:
        prev = first
        for ts, k in sorted(byw[w]):
            span[k], prev = ts - prev, ts
    return {k: s for k, s in span.items() if k in passed}, max(end.values()) - first


def perfile(path):
    span, total = spans(path)
    files, cases = collections.defaultdict(float), collections.Counter()
    for k, s in span.items():
        f = k.split("::")[0].split("/")[-1]
        files[f] += s
        cases[f] += 1
    return {f: (files[f], cases[f]) for f in files}, total

if __name__ == "__main__":
    a, ta = perfile(sys.argv[1])
    if len(sys.argv) > 2:
        b, tb = perfile(sys.argv[2])
        print(f"span {ta} s vs {tb} s")
        sa_, sb_ = spans(sys.argv[1])[0], spans(sys.argv[2])[0]
        same = set(sa_) & set(sb_)
        print(f"cases in both: {len(same)}; worker-s {sum(sa_[k] for k in same):.0f} vs {sum(sb_[k] for k in same):.0f}")
        both = sorted(set(a) & set(b), key=lambda f: -a[f][0])
        sa = sum(a[f][0] for f in both); sb = sum(b[f][0] for f in both)
        ca = sum(a[f][1] for f in both); cb = sum(b[f][1] for f in both)
        print(f"files in both: {len(both)}; worker-s {sa:.0f} ({ca} cases) vs {sb:.0f} ({cb} cases)")
        for f in both:
            print(f"{a[f][0]:6.0f} {a[f][1]:4d} | {b[f][0]:6.0f} {b[f][1]:4d}  {f}")
        print("only in first:", {f: a[f] for f in set(a) - set(b)})
        print("only in second:", {f: b[f] for f in set(b) - set(a)})
    else:
        for f, (s, c) in sorted(a.items(), key=lambda x: -x[1][0]):
            print(f"{s:6.0f} {c:4d} {f}")
        print("span", ta, "sum", sum(s for s, c in a.values()))
