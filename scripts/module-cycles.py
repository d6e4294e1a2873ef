#!/usr/bin/env python3
"""Finds import cycles between the modules of each crate under crates/: module A uses module B
(a `crate::b` path, or `super::b` from a child) and B uses A, directly or through others.
Prints every cycle and exits 1 if there is one. Modules are files: src/a.rs or src/a/mod.rs is
`a`, src/a/b.rs is `a::b` (a child using its parent, `super::`, is not counted: a parent owns
its children)."""
import os, re, sys

def modules(src):
    found = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"], ["main"]):
                continue
            found["::".join(rel)] = path
    return found

def uses(text, names):
    text = re.sub(r"//.*", "", text)
    out = set()
    for m in re.finditer(r"\bcrate::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)", text):
        parts = m.group(1).split("::")
        for i in range(len(parts), 0, -1):
            name = "::".join(parts[:i])
            if name in names:
                out.add(name)
                break
    # `use crate::{a::X, b}` groups
    for m in re.finditer(r"\bcrate::\{", text):
        depth, item, items = 1, "", []
        for ch in text[m.end():]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
            if ch == "," and depth == 1:
                items.append(item)
                item = ""
            else:
                item += ch
        items.append(item)
        for item in items:
            head = item.strip().split("::")[0].strip()
            if head in names:
                out.add(head)
    return out

def cycles(graph):
    found, state, stack = [], {}, []
    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2
    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found

bad = 0
for crate in sorted(os.listdir("crates")):
    src = os.path.join("crates", crate, "src")
    if not os.path.isdir(src):
        continue
    names = modules(src)
    graph = {}
    for name, path in names.items():
        edges = uses(open(path).read(), names)
        # A module using its own descendants or ancestors is structure, not a cycle.
        graph[name] = {e for e in edges if e != name and not e.startswith(name + "::") and not name.startswith(e + "::")}
    for cycle in cycles(graph):
        bad += 1
        print(f"{crate}: " + " -> ".join(cycle))
if bad:
    sys.exit(1)
print("no import cycles between modules")
