#!/usr/bin/env python3
"""A sorted listing of each published library crate's public API, read from its rustdoc HTML
(what users see), committed as api/<crate>.txt and frozen by CI.

    python3 scripts/public-surface.py --write   # build the docs, regenerate api/*.txt
    python3 scripts/public-surface.py --check   # build the docs, compare; exit 1 with a diff

Options: --no-build reads the docs already in the target directory ($CARGO_TARGET_DIR or
target/); --crate NAME limits the run to one crate.

The crates are those of scripts/published-crates.py with a library target (a binary-only crate
such as idempotency-cli has no library API). The docs are built with
`cargo doc --no-deps --all-features -p …` (keeping $RUSTDOCFLAGS, so a CI docs step built with
the same flags is reused). For each item of the crate's all.html (every public path, through
`pub use` re-exports) one line `kind path: declaration`; for structs, enums, unions and traits
also their public fields, variants, inherent methods and associated items, and the trait
methods (required and provided). Trait implementations are not listed.

Each line is `kind path: signature`, signatures with whitespace collapsed; the file is sorted.
Per crate it prints the number of names at the crate root and of public items (lines).
"""
import difflib
import html
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
API_DIR = os.path.join(ROOT, "api")

_spec = importlib.util.spec_from_file_location(
    "published_crates", os.path.join(ROOT, "scripts", "published-crates.py")
)
_published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_published)

# all.html: `<a href="struct.Foo.html">Foo</a>` or `<a href="header/constant.X.html">header::X</a>`
ALL_ITEM = re.compile(r'<li><a href="([^"]+)">([^<]+)</a></li>')
KIND_OF_FILE = re.compile(r"(?:^|/)([a-z]+)\.[A-Za-z0-9_]+\.html$")
ITEM_DECL = re.compile(r'<pre class="rust item-decl"><code>(.*?)</code></pre>', re.S)
# A member's anchor: `<section id="method.new" …><… class="code-header">pub fn new(…)</h4>`
MEMBER = re.compile(
    r'<section id="((?:method|tymethod|variant|associatedconstant|associatedtype)\.[^"]+)"'
    r"[^>]*>.*?<h[34] class=\"code-header\">(.*?)</h[34]>",
    re.S,
)
FIELD = re.compile(
    r'<span id="structfield\.([^"]+)" class="structfield[^"]*">.*?<code>(.*?)</code></span>', re.S
)
# A struct-like variant's field: `<span id="variant.Amqp.field.source" …><code>source: Error</code>`
VARIANT_FIELD = re.compile(
    r'<span id="variant\.([^".]+)\.field\.([^"]+)" class="section-header">.*?<code>(.*?)</code></span>',
    re.S,
)
MEMBER_KIND = {
    "method": "method",
    "tymethod": "method",
    "variant": "variant",
    "associatedconstant": "assoc-const",
    "associatedtype": "assoc-type",
}


def text_of(fragment):
    """The visible text of an HTML fragment, on one line."""
    fragment = re.sub(r'<span class="item-info">.*?</span>', "", fragment, flags=re.S)
    # The notable-traits marker `ⓘ` is a link of its own; attributes and `where` are blocks.
    fragment = re.sub(r'<a[^>]*class="tooltip"[^>]*>.*?</a>', "", fragment, flags=re.S)
    fragment = re.sub(r"</?div[^>]*>|<br\s*/?>", " ", fragment)
    fragment = re.sub(r"<[^>]+>", "", fragment)
    text = " ".join(html.unescape(fragment).split())
    # Long signatures are wrapped one parameter a line: `( a: A, b: B, )` reads `(a: A, b: B)`.
    return re.sub(r"\(\s+", "(", re.sub(r",?\s+\)", ")", text))


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")


def build_docs(crates):
    args = ["cargo", "doc", "-q", "--no-deps", "--all-features"]
    for name in crates:
        args += ["-p", name]
    subprocess.run(args, cwd=ROOT, check=True)


def inherent_section(page):
    """The page without its trait implementations (auto traits, blanket impls, trait impls) and
    the methods it borrows through `Deref`."""
    for marker in (
        '<h2 id="trait-implementations"',
        '<h2 id="synthetic-implementations"',
        '<h2 id="blanket-implementations"',
        '<h2 id="implementors"',
        '<h2 id="object-safety"',
        '<h2 id="dyn-compatibility"',
        '<h2 id="deref-methods',
    ):
        at = page.find(marker)
        if at != -1:
            page = page[:at]
    return page


def members(path, kind, page):
    """Lines for the fields, variants, methods and associated items listed on an item's page."""
    lines = []
    if kind not in ("struct", "enum", "union", "trait"):
        return lines
    body = inherent_section(page)
    for name, code in FIELD.findall(body):
        lines.append(f"field {path}::{name}: {text_of(code)}")
    for variant, name, code in VARIANT_FIELD.findall(body):
        lines.append(f"field {path}::{variant}::{name}: {text_of(code)}")
    for anchor, header in MEMBER.findall(body):
        member_kind, _, name = anchor.partition(".")
        lines.append(f"{MEMBER_KIND[member_kind]} {path}::{name}: {text_of(header)}")
    return lines


def surface(crate):
    """The sorted listing of one crate's public API, and its number of root names."""
    lib = crate.replace("-", "_")
    doc_dir = os.path.join(target_dir(), "doc", lib)
    with open(os.path.join(doc_dir, "all.html"), encoding="utf-8") as f:
        all_page = f.read()
    lines, root_names = set(), set()
    for href, name in ALL_ITEM.findall(all_page):
        kind_match = KIND_OF_FILE.search(href)
        if not kind_match:
            continue
        kind = kind_match.group(1)
        path = f"{lib}::{html.unescape(name)}"
        first = name.split("::")[0]
        root_names.add(first)
        with open(os.path.join(doc_dir, href), encoding="utf-8") as f:
            page = f.read()
        decl = ITEM_DECL.search(page)
        signature = text_of(decl.group(1)) if decl else ""
        if kind in ("struct", "enum", "union", "trait") and "{" in signature:
            signature = signature[: signature.index("{")].strip()
        lines.add(f"{kind} {path}: {signature}".rstrip(": "))
        lines.update(members(path, kind, page))
    # Public modules are listed on the crate's index page, not in all.html; so are the
    # re-exports that are not inlined (`pub use module::Item` at the root: a root name whose
    # page is the module's).
    with open(os.path.join(doc_dir, "index.html"), encoding="utf-8") as f:
        index = f.read()
    for module in re.findall(r'<a class="mod" href="([a-z0-9_]+)/index.html"', index):
        lines.add(f"mod {lib}::{module}")
        root_names.add(module)
    for name in re.findall(r'id="reexport\.([A-Za-z0-9_]+)"', index):
        lines.add(f"reexport {lib}::{name}")
        root_names.add(name)
    return sorted(lines), len(root_names)


def write_listing(directory, crate, lines):
    path = os.path.join(directory, f"{crate}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return path


def main(argv):
    if "--write" not in argv and "--check" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    crates = [name for name, _ in _published.published_crates(lib_only=True)]
    if "--crate" in argv:
        crates = [argv[argv.index("--crate") + 1]]
    if "--no-build" not in argv:
        build_docs(crates)
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = API_DIR if "--write" in argv else scratch
        os.makedirs(out_dir, exist_ok=True)
        for crate in crates:
            lines, root_names = surface(crate)
            fresh = write_listing(out_dir, crate, lines)
            print(f"{crate}: {root_names} names at the crate root, {len(lines)} public items")
            if "--check" in argv:
                committed = os.path.join(API_DIR, f"{crate}.txt")
                old = open(committed, encoding="utf-8").readlines() if os.path.exists(committed) else []
                new = open(fresh, encoding="utf-8").readlines()
                if old != new:
                    failed = True
                    sys.stdout.writelines(
                        difflib.unified_diff(old, new, f"api/{crate}.txt (committed)", f"api/{crate}.txt (now)")
                    )
    if failed:
        print(
            "public-surface: the public API differs from api/*.txt; if the change is meant, run "
            "`python3 scripts/public-surface.py --write` and commit api/",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
