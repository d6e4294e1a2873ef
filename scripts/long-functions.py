#!/usr/bin/env python3
"""Lists the functions of the published crates' sources (crates/idempotency*/src) longer than
LIMIT lines (default 80), from the `fn` line to its closing brace, doc comments excluded.
Exits 1 if there is one. `--top N` prints the N longest whatever their length."""
import os, re, sys

LIMIT = 80
args = sys.argv[1:]
top = int(args[args.index("--top") + 1]) if "--top" in args else 0
found = []
for crate in sorted(os.listdir("crates")):
    if not crate.startswith("idempotency"):
        continue
    for root, _, files in os.walk(os.path.join("crates", crate, "src")):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            lines = open(path).read().split("\n")
            in_tests = None
            i = 0
            while i < len(lines):
                line = lines[i]
                if re.match(r"\s*#\[cfg\(test\)\]", line):
                    break  # unit tests sit at the end of a file
                m = re.match(r"\s*(pub(\([a-z]+\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+([a-z_0-9]+)", line)
                if m and not line.strip().startswith("//"):
                    depth, started, j = 0, False, i
                    while j < len(lines):
                        code = re.sub(r"//.*", "", lines[j])
                        code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
                        code = re.sub(r"'(\\.|[^'\\])'", "''", code)
                        if not started and ";" in code and "{" not in code:
                            break  # a declaration without a body
                        for ch in code:
                            if ch == "{":
                                depth += 1
                                started = True
                            elif ch == "}":
                                depth -= 1
                        if started and depth == 0:
                            break
                        j += 1
                    if started:
                        found.append((j - i + 1, f"{path}:{i + 1}", m.group(6)))
                    i = j + 1 if started else i + 1
                    continue
                i += 1
found.sort(reverse=True)
if top:
    for n, where, name in found[:top]:
        print(f"{n:5} {where} {name}")
    sys.exit(0)
long = [x for x in found if x[0] >= LIMIT]
for n, where, name in long:
    print(f"{n:5} {where} {name}")
if long:
    print(f"{len(long)} functions of {LIMIT} lines or more")
    sys.exit(1)
print(f"every function is under {LIMIT} lines (longest: {found[0][0]}, {found[0][2]})")
