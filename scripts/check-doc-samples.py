#!/usr/bin/env python3
"""Every Rust sample of the user documentation compiles in CI, one of two ways:

* a ```rust block (any info string without `ignore`) is compiled, and run unless `no_run`, as a
  doctest: the Markdown file must be included by `crates/doc-samples` (or be the crate
  documentation of its crate) -- this script checks that it is;
* a ```rust,ignore block is an excerpt of a file CI compiles: the line before the block is
  `<!-- excerpt: PATH -->`, and every non-blank line of the block appears in PATH, in order, as
  a whole line (leading spaces, `//!`/`///` doc markers and rustdoc's hidden `# ` ignored; a
  line `// …` marks what the excerpt leaves out).

    python3 scripts/check-doc-samples.py     # exit 1, listing each sample that is neither
"""
import glob
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXCERPT = re.compile(r"^<!-- excerpt: (\S+) -->$")


def markdown_files():
    files = ["README.md"] + sorted(glob.glob("docs/*.md")) + sorted(glob.glob("crates/*/README.md"))
    return [f for f in files if os.path.exists(os.path.join(ROOT, f))]


def included_as_doctests():
    """Markdown files some crate's source includes with `include_str!` (doctests)."""
    included = set()
    for source in glob.glob(os.path.join(ROOT, "crates/*/src/lib.rs")):
        text = open(source, encoding="utf-8").read()
        for rel in re.findall(r'include_str!\("([^"]+\.md)"\)', text):
            included.add(os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(source), rel)), ROOT))
    return included


def normalise(line):
    line = line.strip()
    for marker in ("//!", "///"):
        if line.startswith(marker):
            line = line[len(marker):].strip()
    if line.startswith("# ") or line == "#":
        line = line[1:].strip()
    return line


def is_excerpt(block, path):
    try:
        source = [normalise(l) for l in open(os.path.join(ROOT, path), encoding="utf-8")]
    except OSError:
        return f"{path} cannot be read"
    at = 0
    for line in block:
        wanted = normalise(line)
        if not wanted or wanted == "// …":
            continue
        while at < len(source) and source[at] != wanted:
            at += 1
        if at == len(source):
            return f"this line is not in {path} (in this order): {line.strip()!r}"
        at += 1
    return None


def rust_blocks(path):
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)$", lines[i])
        if not fence:
            i += 1
            continue
        info = fence.group(1)
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if info.split(",")[0] in ("rust", "rs"):
            before = lines[i - 1] if i > 0 else ""
            yield i + 1, info, before, lines[i + 1 : end]
        i = end + 1


def main():
    doctested = included_as_doctests()
    problems = []
    samples = 0
    for path in markdown_files():
        for line_no, info, before, block in rust_blocks(path):
            samples += 1
            where = f"{path}:{line_no}"
            if "ignore" in info.split(","):
                marker = EXCERPT.match(before.strip())
                if not marker:
                    problems.append(f"{where}: an `ignore` sample needs `<!-- excerpt: PATH -->` on the line before it")
                    continue
                wrong = is_excerpt(block, marker.group(1))
                if wrong:
                    problems.append(f"{where}: {wrong}")
            elif path not in doctested:
                problems.append(f"{where}: compiled nowhere: include {path} in crates/doc-samples/src/lib.rs")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"{samples} Rust samples in the docs: each compiled as a doctest or an excerpt of compiled code")


if __name__ == "__main__":
    main()
