#!/usr/bin/env python3
"""Checks that ARCHITECTURE.md names every crate and every module of the workspace.

The convention (stated at the top of ARCHITECTURE.md):
* a crate is named by its directory, in backticks: `crates/idempotency-http`;
* a module is named by its path from the crate, in backticks, the crate's package name with `_`
  for `-`: `idempotency::store::sqlite`, `idempotency_http::service`, `shop::routes`,
  `faults::scenarios`, `idempotency_cli::render`.

Modules are found from the files under each crate's src/ (src/a.rs and src/a/mod.rs are `a`,
src/a/b.rs is `a::b`; lib.rs and main.rs are the crate itself) and from inline `mod name {`
blocks at a file's top level (`pub mod headers { … }`). Test modules named `tests` are left out.

Prints what is missing, as the exact text to add, and exits 1 if anything is; exits 0 otherwise.
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DOC = "ARCHITECTURE.md"
INLINE_MOD = re.compile(r"^(?:pub(?:\([a-z:]+\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*\{", re.M)


def package_name(crate_dir):
    with open(os.path.join(crate_dir, "Cargo.toml"), encoding="utf-8") as f:
        in_package = False
        for line in f:
            line = line.strip()
            if line.startswith("["):
                in_package = line == "[package]"
            elif in_package:
                m = re.match(r'name\s*=\s*"([^"]+)"', line)
                if m:
                    return m.group(1)
    return os.path.basename(crate_dir)


def file_module(src, path):
    """The module path of a source file, relative to its crate (empty for lib.rs / main.rs)."""
    parts = os.path.relpath(path, src)[:-3].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts in (["lib"], ["main"]):
        parts = []
    return parts


def modules(crate_dir):
    """Every module of a crate: {module path: the file that holds it}."""
    src = os.path.join(crate_dir, "src")
    found = {}
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            parts = file_module(src, path)
            rel = os.path.relpath(path, ROOT)
            if parts and parts[-1] != "tests":
                found["::".join(parts)] = rel
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for m in INLINE_MOD.finditer(text):
                if m.group(1) != "tests":
                    found["::".join(parts + [m.group(1)])] = f"{rel} (inline `mod {m.group(1)}`)"
    return found


def main():
    with open(os.path.join(ROOT, DOC), encoding="utf-8") as f:
        named = set(re.findall(r"`([^`\n]+)`", f.read()))
    crates_dir = os.path.join(ROOT, "crates")
    missing = []
    counts = [0, 0]
    for entry in sorted(os.listdir(crates_dir)):
        crate_dir = os.path.join(crates_dir, entry)
        if not os.path.isfile(os.path.join(crate_dir, "Cargo.toml")):
            continue
        counts[0] += 1
        crate_token = f"crates/{entry}"
        if crate_token not in named:
            missing.append((f"`{crate_token}`", "a crate"))
        crate_path = package_name(crate_dir).replace("-", "_")
        for module, where in sorted(modules(crate_dir).items()):
            counts[1] += 1
            token = f"{crate_path}::{module}"
            if token not in named:
                missing.append((f"`{token}`", where))
    if missing:
        print(f"{DOC} does not name {len(missing)} crate(s) or module(s). Add each of these, "
              f"in backticks exactly as written, with a line on what it holds:", file=sys.stderr)
        for token, where in missing:
            print(f"  {token}    ({where})", file=sys.stderr)
        return 1
    print(f"{DOC} names all {counts[0]} crates and {counts[1]} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
