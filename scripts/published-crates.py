#!/usr/bin/env python3
"""Prints the workspace's published crates, one package name a line: every crate under crates/
whose Cargo.toml does not say `publish = false`. This is the one list CI packages and
snapshots (scripts/public-surface.py imports it).

    python3 scripts/published-crates.py            # every published crate
    python3 scripts/published-crates.py --lib      # only those with a library target
    python3 scripts/published-crates.py --cargo-args [--lib]   # as `-p NAME -p NAME …`
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _package_table(manifest):
    """The `[package]` table's lines of a Cargo.toml."""
    lines, inside = [], False
    for line in manifest.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[package]"
        elif inside:
            lines.append(stripped)
    return lines


def published_crates(lib_only=False):
    """[(package name, crate directory)] of the published crates, sorted by name."""
    crates = []
    crates_dir = os.path.join(ROOT, "crates")
    for entry in sorted(os.listdir(crates_dir)):
        crate_dir = os.path.join(crates_dir, entry)
        manifest_path = os.path.join(crate_dir, "Cargo.toml")
        if not os.path.isfile(manifest_path):
            continue
        with open(manifest_path, encoding="utf-8") as f:
            manifest = f.read()
        package = _package_table(manifest)
        if any(re.fullmatch(r"publish\s*=\s*false", line) for line in package):
            continue
        name = next(
            (m.group(1) for line in package if (m := re.fullmatch(r'name\s*=\s*"([^"]+)"', line))),
            entry,
        )
        has_lib = os.path.isfile(os.path.join(crate_dir, "src", "lib.rs")) or re.search(
            r"^\[lib\]", manifest, re.M
        )
        if lib_only and not has_lib:
            continue
        crates.append((name, crate_dir))
    return sorted(crates)


def main(argv):
    names = [name for name, _ in published_crates(lib_only="--lib" in argv)]
    if not names:
        print("published-crates: no published crate found", file=sys.stderr)
        return 1
    if "--cargo-args" in argv:
        print(" ".join(f"-p {name}" for name in names))
    else:
        print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
