#!/usr/bin/env python3
"""The layer check: no module of src/ may import a module of a higher layer.

    python3 .ci/layers.py [--root DIR] [--map FILE]
    python3 .ci/layers.py --self-test

Reads every .rs file under DIR/src (default: the repository this script is
in) and collects its references to other modules of the crate:

- `use` declarations anywhere (top level, in function bodies, under
  `#[cfg(...)]`, with any visibility), brace groups over several lines
  included: `use crate::a::b;`, `use crate::{a, b::{c, d}};`,
  `use crate::a as b;`, `use super::x;`, `use self::x;`, and a use of a
  child module by its bare name;
- paths written inline in code, without a `use`: `crate::a::B`,
  `$crate::a::B`, `super::a::f()`, `self::a::B`.

Comments (`//`, `///`, `//!`, `/* */`, nested) and string and character
literals are blanked before anything is read, so doc links and strings are
never counted. `pub(crate)`, `pub(super)` and `pub(in path)` are visibilities,
not imports.

A path is resolved to the file of the longest module path it starts with
(`src/a.rs` or `src/a/mod.rs` is module `a`, `src/a/b.rs` is `a::b`);
`super::` and `self::` are relative to the module the line is in (inline
`mod x { ... }` blocks included). A path that names an item of the crate
root (`crate::Name`) is followed through the `use` lines of src/lib.rs
(`pub use x::Name`, `pub use self::x::{Name, Other as O}`, inline
`pub mod m { pub use crate::x::Name; }`, globs) to the module the item comes
from.

The layer of each file comes from the map (default: layers.txt next to this
script; its header explains the format): a file may import its own layer and
any layer of a lower level, plus what an `allow` line adds, minus what a
`deny` line takes away. Each refused import is printed as

    src/queue/edges.rs:21: keys imports transactions (crate::deadlock::Edge)

and a file the map does not cover is an error of its own. Exit status: 0 when
there is nothing to report, 1 when there is, 2 when the map cannot be read.
"""

import argparse
import bisect
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ROOT = os.path.dirname(HERE)
DEFAULT_MAP = os.path.join(HERE, "layers.txt")


class MapError(Exception):
    """The layer map is malformed."""


# ------------------------------------------------------------------ lexing


_RAW = re.compile(r'(?:br|cr|r)(#*)"')


def _is_ident_char(c):
    return c.isalnum() or c == "_"


def strip_rust(src):
    """`src` with comments and string/char literals blanked out.

    Every character inside a comment or literal becomes a space, except
    newlines, so offsets and line numbers are unchanged.
    """
    out = list(src)
    n = len(src)
    i = 0

    def blank(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
            continue
        if c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth += 1
                    j += 2
                elif src.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    j += 1
            blank(i, j)
            i = j
            continue
        if c in "rbc" and not (i > 0 and _is_ident_char(src[i - 1])):
            # Raw strings (r"..", r#".."#, br"..", cr#".."#): no escapes.
            # Byte and C strings and byte chars need nothing special: their
            # prefix is skipped as an identifier, then the quote is read.
            m = _RAW.match(src, i)
            if m:
                close = '"' + m.group(1)
                j = src.find(close, m.end())
                j = n if j < 0 else j + len(close)
                blank(i, j)
                i = j
                continue
        if c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
            continue
        if c == "'":
            # A char literal ('a', '\n', '\u{1F600}', '"') or a lifetime/label.
            if nxt == "\\":
                j = i + 3  # past the backslash and the escaped character
                while j < n and src[j] != "'" and src[j] != "\n":
                    j += 1
                blank(i, j + 1)
                i = j + 1
                continue
            if i + 2 < n and src[i + 2] == "'":
                blank(i, i + 3)
                i += 3
                continue
            i += 1
            continue
        if _is_ident_char(c):
            j = i
            while j < n and _is_ident_char(src[j]):
                j += 1
            i = j
            continue
        i += 1
    return "".join(out)


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|::|\S")


def tokenize(src):
    """Tokens of the stripped source: a list of (text, line)."""
    text = strip_rust(src)
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    return [
        (m.group(), bisect.bisect_right(starts, m.start()))
        for m in _TOKEN.finditer(text)
    ]


# ------------------------------------------------------------------ parsing


class Leaf:
    """One path of a `use` tree, or one inline path.

    `segs` is the path as written, a list of (text, line); `alias` the name
    after `as`, if any.
    """

    def __init__(self, segs, alias=None):
        self.segs = segs
        self.alias = alias

    def names(self):
        return [s for s, _ in self.segs]


class Ref:
    """A reference from a file to a path: a group of leaves of one `use`
    statement (or one inline path), made in module `cur` (a tuple)."""

    def __init__(self, leaves, cur, inline):
        self.leaves = leaves
        self.cur = cur
        self.inline = inline


def _parse_tree(toks, i, prefix, leaves):
    """Parses a use tree at toks[i]; appends its leaves; returns the index
    after it."""
    segs = list(prefix)
    if i < len(toks) and toks[i][0] == "::":
        i += 1
    while i < len(toks):
        t, line = toks[i]
        if t == "{":
            i += 1
            while i < len(toks) and toks[i][0] != "}":
                i = _parse_tree(toks, i, segs, leaves)
                if i < len(toks) and toks[i][0] == ",":
                    i += 1
                elif i < len(toks) and toks[i][0] != "}":
                    i += 1  # malformed: skip a token rather than loop
            return i + 1
        if t == "*":
            leaves.append(Leaf(segs + [("*", line)]))
            return i + 1
        if re.match(r"[A-Za-z_]", t) or t == "$":
            if t == "$" and i + 1 < len(toks):  # $crate
                i += 1
                t, line = "$" + toks[i][0], toks[i][1]
            segs.append((t, line))
            i += 1
            if i < len(toks) and toks[i][0] == "::":
                i += 1
                continue
            alias = None
            if i + 1 < len(toks) and toks[i][0] == "as":
                alias = toks[i + 1][0]
                i += 2
            leaves.append(Leaf(segs, alias))
            return i
        return i  # `,` `}` `;` or junk: an empty tree
    return i


def scan(tokens, file_mod):
    """The references of one file whose module path is `file_mod`.

    Returns Ref objects. Also tracks inline `mod name { ... }` blocks so that
    `super::` and `self::` resolve against the right module.
    """
    refs = []
    mods = []  # stack of (name, depth of its `{`)
    depth = 0
    n = len(tokens)
    i = 0

    def cur():
        return tuple(file_mod) + tuple(name for name, _ in mods)

    while i < n:
        t, line = tokens[i]
        prev = tokens[i - 1][0] if i else ""
        if t == "{":
            depth += 1
        elif t == "}":
            if mods and mods[-1][1] == depth:
                mods.pop()
            depth -= 1
        elif t == "mod" and prev != "::" and i + 2 < n and tokens[i + 2][0] == "{":
            mods.append((tokens[i + 1][0], depth + 1))
            i += 2
            continue
        elif t == "use" and prev not in ("::", "#", "."):
            leaves = []
            j = i + 1
            while j < n and tokens[j][0] != ";":
                before = j
                j = _parse_tree(tokens, j, [], leaves)
                if j == before:
                    j += 1  # not a tree: skip the token
            refs.append(Ref(leaves, cur(), inline=False))
            i = j + 1
            continue
        elif (
            t in ("crate", "super", "self", "$")
            and prev not in ("::", "in")
            and i + 1 < n
        ):
            k = i
            if t == "$":  # $crate, in a macro
                if tokens[i + 1][0] != "crate":
                    i += 1
                    continue
                k = i + 1
            if k + 1 < n and tokens[k + 1][0] == "::":
                segs = [("$crate" if t == "$" else t, line)]
                j = k + 2
                while j < n and re.match(r"[A-Za-z_]", tokens[j][0]):
                    segs.append(tokens[j])
                    if j + 1 < n and tokens[j + 1][0] == "::":
                        j += 2
                    else:
                        j += 1
                        break
                if len(segs) > 1:
                    refs.append(Ref([Leaf(segs)], cur(), inline=True))
                i = j
                continue
        i += 1
    return refs


def module_of(relpath):
    """The module path (a tuple) of a file under src/, or None for a file
    that is no module of the library (src/main.rs, src/bin/...)."""
    parts = relpath.split("/")
    if parts[0] != "src" or not relpath.endswith(".rs"):
        return None
    parts = parts[1:]
    if parts == ["lib.rs"]:
        return ()
    if parts == ["main.rs"] or parts[0] == "bin":
        return None
    last = parts[-1][:-3]
    if last == "mod":
        return tuple(parts[:-1])
    return tuple(parts[:-1] + [last])


_ITEM = r"\b(?:struct|enum|union|trait|type|fn|const|static|mod|macro_rules!)\s+{}\b"


class Crate:
    """The modules of the crate and the re-exports of its root."""

    def __init__(self, files):
        self.files = files  # relpath -> source
        self.tokens = {p: tokenize(s) for p, s in files.items()}
        self.mod_file = {}
        for p in sorted(files):
            m = module_of(p)
            if m is not None:
                self.mod_file.setdefault(m, p)
        self.file_mod = {p: m for m, p in self.mod_file.items()}
        # The root's `use` lines: name path (tuple) -> absolute target
        # (tuple), or None for an external item; and its globs.
        self.reexports = {}
        self.globs = []
        root = self.mod_file.get(())
        if root is not None:
            for ref in scan(self.tokens[root], ()):
                if ref.inline:
                    continue
                for leaf in ref.leaves:
                    names = leaf.names()
                    target = self.absolute(ref.cur, names, allow_child=True)
                    if names[-1] == "*":
                        if target is not None:
                            self.globs.append((ref.cur, target[:-1]))
                        continue
                    if names[-1] == "self":
                        names = names[:-1]
                        if target is not None:
                            target = target[:-1]
                    if not names:
                        continue
                    name = leaf.alias or names[-1]
                    if name == "_":
                        continue
                    self.reexports.setdefault(ref.cur + (name,), target)

    def absolute(self, cur, names, allow_child):
        """The absolute path (tuple) of `names` written in module `cur`, or
        None when it is not a path into this crate."""
        if not names:
            return None
        head = names[0]
        if head in ("crate", "$crate"):
            return tuple(names[1:])
        if head == "self":
            return tuple(cur) + tuple(names[1:])
        if head == "super":
            base = list(cur)
            k = 0
            while k < len(names) and names[k] == "super":
                if not base:
                    return None
                base.pop()
                k += 1
            return tuple(base) + tuple(names[k:])
        if allow_child and self._is_module(tuple(cur) + (head,)):
            return tuple(cur) + tuple(names)
        return None

    def _is_module(self, path):
        return path in self.mod_file

    def resolve(self, path, depth=0):
        """The file a crate path (tuple, absolute) lands in, or None when it
        leads out of the crate (a root `use` of an external item)."""
        path = tuple(s for s in path if s not in ("self", "*"))
        for k in range(len(path), -1, -1):
            if path[:k] in self.mod_file:
                if k > 0 or depth > 8:
                    return self.mod_file[path[:k]]
                break
        # The crate root: follow its `use` lines.
        for k in range(len(path), 0, -1):
            if path[:k] in self.reexports:
                target = self.reexports[path[:k]]
                if target is None:
                    return None
                return self.resolve(target + path[k:], depth + 1)
        if path:
            for at, source in self.globs:
                if path[: len(at)] != at or len(path) <= len(at):
                    continue
                name = path[len(at)]
                f = self.mod_file.get(source)
                if f and re.search(_ITEM.format(re.escape(name)), strip_rust(self.files[f])):
                    return self.resolve(source + path[len(at):], depth + 1)
        return self.mod_file.get(())


# ------------------------------------------------------------------ the map


class LayerMap:
    def __init__(self, text, name="layers.txt"):
        self.name = name
        self.level = {}  # layer -> level index (0 lowest)
        self.allow = set()
        self.deny = set()
        self.patterns = {}  # pattern -> layer
        rules = []
        for no, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = "{}:{}".format(name, no)
            words = line.split()
            if words[0] == "layer":
                names = [w.strip() for w in line[len("layer"):].split(",")]
                if not all(re.fullmatch(r"[A-Za-z_][\w-]*", w) for w in names):
                    raise MapError("{}: bad layer line: {!r}".format(where, raw))
                for w in names:
                    if w in self.level:
                        raise MapError("{}: layer {} named twice".format(where, w))
                    self.level[w] = len(set(self.level.values()))
                # Siblings share the level given to the first of them.
                lvl = self.level[names[0]]
                for w in names:
                    self.level[w] = lvl
            elif words[0] in ("allow", "deny"):
                m = re.fullmatch(r"(allow|deny)\s+(\S+)\s*->\s*(\S+)", line)
                if not m:
                    raise MapError("{}: expected `{} FROM -> TO`: {!r}".format(where, words[0], raw))
                rules.append((where, m.group(1), m.group(2), m.group(3)))
            elif len(words) == 2 and words[0].startswith("src/"):
                pat, layer = words
                if not (pat.endswith("/") or pat.endswith(".rs")):
                    raise MapError("{}: a path is a file (.rs) or a folder (ending in /): {!r}".format(where, pat))
                if pat in self.patterns:
                    raise MapError("{}: {} mapped twice".format(where, pat))
                self.patterns[pat] = (layer, where)
            else:
                raise MapError("{}: not a layer, allow, deny or `src/PATH LAYER` line: {!r}".format(where, raw))
        if not self.level:
            raise MapError("{}: no `layer` lines".format(name))
        for pat, (layer, where) in self.patterns.items():
            if layer not in self.level:
                raise MapError("{}: unknown layer {} (for {})".format(where, layer, pat))
        for where, kind, a, b in rules:
            for w in (a, b):
                if w not in self.level:
                    raise MapError("{}: unknown layer {}".format(where, w))
            (self.allow if kind == "allow" else self.deny).add((a, b))
        self.patterns = {p: l for p, (l, _) in self.patterns.items()}

    def layer_of(self, relpath):
        """The layer of a file (most specific pattern), or None."""
        best = None
        for pat, layer in self.patterns.items():
            hit = relpath == pat if pat.endswith(".rs") else relpath.startswith(pat)
            if hit and (best is None or len(pat) > len(best[0])):
                best = (pat, layer)
        return best[1] if best else None

    def unused(self, relpaths):
        return sorted(
            p for p in self.patterns
            if not any(r == p if p.endswith(".rs") else r.startswith(p) for r in relpaths)
        )

    def may_import(self, a, b):
        if (a, b) in self.deny:
            return False
        if a == b or (a, b) in self.allow:
            return True
        return self.level[b] < self.level[a]


# ------------------------------------------------------------------ check


def _display(leaves):
    """`crate::a::{B, C as D}` for leaves of one group."""
    paths = [leaf.names() for leaf in leaves]
    if len(paths) == 1:
        p = "::".join(paths[0])
        return p + (" as " + leaves[0].alias if leaves[0].alias else "")
    common = []
    for parts in zip(*paths):
        if all(x == parts[0] for x in parts):
            common.append(parts[0])
        else:
            break
    common = common[: min(len(p) for p in paths) - 1] if any(len(p) == len(common) for p in paths) else common
    rests = []
    for leaf, p in zip(leaves, paths):
        r = "::".join(p[len(common):]) or "self"
        if leaf.alias:
            r += " as " + leaf.alias
        if r not in rests:
            rests.append(r)
    if len(rests) == 1:
        return "::".join(common + [rests[0]])
    return "::".join(common + ["{" + ", ".join(rests) + "}"])


def _leaf_line(leaf):
    """The line of the first segment after crate/super/self."""
    for s, line in leaf.segs:
        if s not in ("crate", "$crate", "super", "self"):
            return line
    return leaf.segs[0][1]


def check(files, layers):
    """Returns (problems, files, imports): problems are (path, line, text)
    sorted; line 0 for a file-level problem."""
    crate = Crate(files)
    problems = []
    imports = 0
    for path in sorted(files):
        if path not in crate.file_mod:
            layer = layers.layer_of(path)
            if layer is None:
                problems.append((path, 0, "not mapped to a layer (add it to {})".format(layers.name)))
            continue
        mine = layers.layer_of(path)
        if mine is None:
            problems.append((path, 0, "not mapped to a layer (add it to {})".format(layers.name)))
        seen = set()
        for ref in scan(crate.tokens[path], crate.file_mod[path]):
            groups = {}
            for leaf in ref.leaves:
                target = crate.absolute(ref.cur, leaf.names(), allow_child=not ref.inline)
                if target is None:
                    continue
                dest = crate.resolve(target)
                if dest is None or dest == path:
                    continue
                groups.setdefault(dest, []).append(leaf)
            for dest, leaves in groups.items():
                imports += 1
                if mine is None:
                    continue
                theirs = layers.layer_of(dest)
                if theirs is None or layers.may_import(mine, theirs):
                    continue
                line = min(_leaf_line(l) for l in leaves)
                text = "{} imports {} ({})".format(mine, theirs, _display(leaves))
                if (line, text) not in seen:
                    seen.add((line, text))
                    problems.append((path, line, text))
    problems.sort(key=lambda p: (p[0], p[1]))
    nfiles = sum(1 for p in files if p in crate.file_mod)
    return problems, nfiles, imports


def read_tree(root):
    files = {}
    src = os.path.join(root, "src")
    for d, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(".rs"):
                full = os.path.join(d, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                with open(full, encoding="utf-8") as f:
                    files[rel] = f.read()
    return files


def report(problems, nfiles, imports, out=sys.stdout):
    for path, line, text in problems:
        if line:
            print("{}:{}: {}".format(path, line, text), file=out)
        else:
            print("{}: {}".format(path, text), file=out)
    if problems:
        print(
            "layer check: {} violation(s) in {} file(s)".format(
                len(problems), len({p for p, _, _ in problems})
            ),
            file=out,
        )
        return 1
    print("layer check: ok, {} files, {} imports".format(nfiles, imports), file=out)
    return 0


# ------------------------------------------------------------------ self-test

_TEST_MAP = """
layer low
layer mid
layer left, right
layer top
allow right -> left
src/lib.rs      top
src/low.rs      low
src/a.rs        low
src/a/          mid
src/a/deep.rs   low
src/queue/      mid
src/deadlock.rs left
src/lost.rs     right
src/x.rs        low
"""


def _run(files, map_text=_TEST_MAP):
    return check(files, LayerMap(map_text, "test-map"))[0]


class SelfTest(unittest.TestCase):
    LIB = "mod low; mod a; mod queue; mod deadlock; mod lost; mod x;\n"

    def files(self, **extra):
        f = {
            "src/lib.rs": self.LIB,
            "src/low.rs": "",
            "src/a.rs": "",
            "src/a/deep.rs": "",
            "src/deadlock.rs": "pub struct Edge; pub struct Edges;",
            "src/lost.rs": "",
            "src/x.rs": "",
            "src/queue/mod.rs": "",
            "src/queue/holders.rs": "",
            "src/queue/entry.rs": "",
        }
        f.update({k.replace("__", "/").replace("_rs", ".rs"): v for k, v in extra.items()})
        return f

    def test_simple_use(self):
        p = _run(self.files(src__low_rs="\nuse crate::queue::Entry;\n"))
        self.assertEqual(p, [("src/low.rs", 2, "low imports mid (crate::queue::Entry)")])

    def test_multiline_brace_group(self):
        src = (
            "use crate::{\n"
            "    x,\n"
            "    queue::{\n"
            "        Holders,\n"
            "        entry::{Entry as E, self},\n"
            "    },\n"
            "    deadlock::Edge,\n"
            "};\n"
        )
        p = _run(self.files(src__low_rs=src))
        self.assertEqual(
            p,
            [
                ("src/low.rs", 3, "low imports mid (crate::queue::Holders)"),
                ("src/low.rs", 3, "low imports mid (crate::queue::entry::{Entry as E, self})"),
                ("src/low.rs", 7, "low imports left (crate::deadlock::Edge)"),
            ],
        )

    def test_visibility_alias_cfg_and_fn_body(self):
        src = (
            "pub(crate) use crate::queue as q;\n"
            "#[cfg(test)]\n"
            "use crate::deadlock::Edge;\n"
            "pub(super) fn f() {\n"
            "        use crate::lost::Lost;\n"
            "}\n"
            "pub(in crate::x) struct S;\n"
        )
        p = _run(self.files(src__low_rs=src))
        self.assertEqual(
            [(l, t) for _, l, t in p],
            [
                (1, "low imports mid (crate::queue as q)"),
                (3, "low imports left (crate::deadlock::Edge)"),
                (5, "low imports right (crate::lost::Lost)"),
            ],
        )

    def test_inline_paths(self):
        src = (
            "fn f(out: &mut crate::deadlock::Edges) {\n"
            "    let _ = crate::queue::entry::Entry::new(); crate::x::g();\n"
            "    macro_rules! m { () => { $crate::lost::Lost::new() } }\n"
            "}\n"
        )
        p = _run(self.files(src__low_rs=src))
        self.assertEqual(
            [(l, t) for _, l, t in p],
            [
                (1, "low imports left (crate::deadlock::Edges)"),
                (2, "low imports mid (crate::queue::entry::Entry::new)"),
                (3, "low imports right ($crate::lost::Lost::new)"),
            ],
        )

    def test_comments_ignored(self):
        src = (
            "//! [`E`](crate::deadlock::Edge)\n"
            "/// crate::lost::Lost\n"
            "// use crate::queue::Entry;\n"
            "/* use crate::queue::Entry;\n"
            "   /* nested */ crate::lost::Lost */\n"
            "/** crate::lost::Lost */ fn f() {} // crate::lost\n"
        )
        self.assertEqual(_run(self.files(src__low_rs=src)), [])

    def test_strings_ignored(self):
        src = (
            'const A: &str = "use crate::queue::Entry; \\" crate::lost::L";\n'
            'const B: &str = r#"crate::lost::Lost " still"#;\n'
            "const C: &[u8] = b\"crate::lost\";\n"
            "const D: char = '\"'; const E: char = '\\'';\n"
            "fn g<'a>(x: &'a str) -> &'a str { x }\n"
            "const F: &str = \"multi\n  crate::lost::Lost\n\";\n"
            "use crate::deadlock::Edge;\n"
        )
        p = _run(self.files(src__low_rs=src))
        self.assertEqual([(l, t) for _, l, t in p], [(9, "low imports left (crate::deadlock::Edge)")])

    def test_super_resolution(self):
        # src/low.rs `super::` is the root; src/queue/entry.rs's is queue.
        files = self.files(
            src__queue__entry_rs="use super::holders::Holders;\nuse super::super::lost::Lost;\n",
            src__x_rs="fn f() { super::lost::g() }\n"
            "#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::queue;\n}\n",
        )
        crate = Crate(files)
        refs = scan(crate.tokens["src/queue/entry.rs"], crate.file_mod["src/queue/entry.rs"])
        self.assertEqual(
            crate.resolve(crate.absolute(refs[0].cur, refs[0].leaves[0].names(), True)),
            "src/queue/holders.rs",
        )
        p = _run(files)
        self.assertEqual(
            p,
            [
                ("src/queue/entry.rs", 2, "mid imports right (super::super::lost::Lost)"),
                ("src/x.rs", 1, "low imports right (super::lost::g)"),
                ("src/x.rs", 5, "low imports mid (super::super::queue)"),
            ],
        )

    def test_root_reexports(self):
        lib = self.LIB + (
            "pub use deadlock::{Edge, Edges as Es};\n"
            "pub use self::lost::{\n    Lost,\n};\n"
            "pub use crate::queue::*;\n"
            "pub use std::sync::Arc;\n"
            "pub struct Root;\n"
            "pub mod futures {\n    pub use crate::lost::Waiting;\n}\n"
        )
        src = (
            "use crate::{Edge, Es, Lost, Arc};\n"
            "fn f() -> crate::futures::Waiting { crate::Holder::new(); crate::Root }\n"
        )
        files = self.files(src__lib_rs=lib, src__low_rs=src,
                           src__queue__mod_rs="pub struct Holder;")
        p = _run(files)
        self.assertEqual(
            [(l, t) for _, l, t in p],
            [
                (1, "low imports left (crate::{Edge, Es})"),
                (1, "low imports right (crate::Lost)"),
                (2, "low imports right (crate::futures::Waiting)"),
                (2, "low imports mid (crate::Holder::new)"),
                (2, "low imports top (crate::Root)"),
            ],
        )

    def test_longest_module_file(self):
        # src/a.rs (low) with a child folder src/a/ (mid) and src/a/deep.rs (low).
        files = self.files(
            src__a_rs="mod deep; mod inner { }\n",
            src__a__b_rs="",
            src__low_rs="use crate::a::b::X;\nuse crate::a::inner::Y;\nuse crate::a::deep::Z;\n",
        )
        p = _run(files)
        self.assertEqual(p, [("src/low.rs", 1, "low imports mid (crate::a::b::X)")])
        crate = Crate(files)
        self.assertEqual(crate.resolve(("a", "inner", "Y")), "src/a.rs")
        self.assertEqual(crate.resolve(("a", "b")), "src/a/b.rs")
        self.assertEqual(crate.resolve(("queue", "entry", "E")), "src/queue/entry.rs")

    def test_child_module_by_bare_name(self):
        files = self.files(src__queue__mod_rs="mod entry;\nuse entry::Entry;\nuse std::sync::Arc;\n",
                           src__low_rs="mod sub { use super::super::queue; }\n")
        self.assertEqual(_run(files), [("src/low.rs", 1, "low imports mid (super::super::queue)")])

    def test_siblings_and_allow(self):
        files = self.files(src__deadlock_rs="use crate::lost::Lost;\n",
                           src__lost_rs="use crate::deadlock::Edge;\n")
        self.assertEqual(_run(files), [("src/deadlock.rs", 1, "left imports right (crate::lost::Lost)")])

    def test_unmapped_file(self):
        files = self.files(src__new_rs="", src__fresh__mod_rs="")
        p = _run(files)
        self.assertEqual(
            [(f, l) for f, l, _ in p], [("src/fresh/mod.rs", 0), ("src/new.rs", 0)]
        )
        self.assertIn("not mapped to a layer", p[0][2])

    def test_most_specific_pattern(self):
        m = LayerMap(_TEST_MAP, "t")
        self.assertEqual(m.layer_of("src/a/deep.rs"), "low")
        self.assertEqual(m.layer_of("src/a/other.rs"), "mid")
        self.assertEqual(m.layer_of("src/a.rs"), "low")
        self.assertIsNone(m.layer_of("src/ab.rs"))

    def test_bad_map(self):
        for text in ("src/x.rs nowhere\nlayer a\n", "layer a\nsrc/x a\n", "layer a\nallow a -> b\n", "junk\n"):
            with self.assertRaises(MapError):
                LayerMap(text)

    def test_report_lines(self):
        import io

        files = self.files(src__queue__mod_rs="use crate::deadlock::{Edge,\n Edges};\n")
        out = io.StringIO()
        rc = report(*check(files, LayerMap(_TEST_MAP, "t")), out=out)
        self.assertEqual(rc, 1)
        self.assertEqual(
            out.getvalue(),
            "src/queue/mod.rs:1: mid imports left (crate::deadlock::{Edge, Edges})\n"
            "layer check: 1 violation(s) in 1 file(s)\n",
        )
        out = io.StringIO()
        self.assertEqual(report(*check(self.files(), LayerMap(_TEST_MAP, "t")), out=out), 0)
        self.assertEqual(out.getvalue(), "layer check: ok, 10 files, 0 imports\n")


def self_test():
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(SelfTest)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


# ------------------------------------------------------------------ main


def _shown(path, root):
    """`path` as messages name it: relative to the repository it is in."""
    path = os.path.abspath(path)
    for base in (os.path.abspath(root), DEFAULT_ROOT):
        if path.startswith(base + os.sep):
            return os.path.relpath(path, base).replace(os.sep, "/")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=DEFAULT_ROOT, help="the repository to check (default: %(default)s)")
    ap.add_argument("--map", default=DEFAULT_MAP, help="the layer map (default: .ci/layers.txt beside this script)")
    ap.add_argument("--self-test", action="store_true", help="run the parser's unit tests and exit")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    try:
        with open(args.map, encoding="utf-8") as f:
            layers = LayerMap(f.read(), _shown(args.map, args.root))
    except (OSError, MapError) as e:
        print("layer check: {}".format(e), file=sys.stderr)
        return 2
    files = read_tree(args.root)
    if not files:
        print("layer check: no .rs files under {}".format(os.path.join(args.root, "src")), file=sys.stderr)
        return 2
    for pat in layers.unused(files):
        print("note: {} matches no file ({})".format(pat, layers.name), file=sys.stderr)
    return report(*check(files, layers))


if __name__ == "__main__":
    sys.exit(main())
