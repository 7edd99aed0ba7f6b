#!/usr/bin/env python3
"""The structure checks of the repository: no import cycle between modules in any crate, the
layering rules of FORBIDDEN (the policy reaches no transfer code, the runtime no server), no
non-test source file over 800 lines, no function over 120 lines outside tests.

Run `python3 tools/structure.py` (`--list` also prints the module graph's edges; `--crate NAME
FOLDER ROOT_FILE` checks one crate alone). It exits 1 and
names every breach; `tests/integration/structure.rs` runs it in the test suite.

How it reads the code (no Rust parser is needed for this much):
- Comments, strings and char literals are blanked first, keeping line numbers.
- A module is a file: `a/b.rs` or `a/b/mod.rs` is `a::b` of its crate (`lib.rs`/`main.rs` is the
  root). Inline `mod x { .. }` blocks belong to their file.
- Module A imports module B when A names an item of B: in a `use` (not a `pub use` re-export, which
  is B's public face, not a dependency), or in a path written in the code (`crate::..`, `super::..`,
  `self::..`, or a path that starts with a child module or with a module brought in by `use`). A
  path through a re-export is followed to the module that defines the item.
- Test code (`#[cfg(test)]` modules, inline or in their own files, and `#[test]` functions) is left
  out of all three checks.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

# (crate, folder, root file)
CRATES = [
    ("kvflow", "src", "lib.rs"),
    ("kvflow (binary)", "src", "main.rs"),
    ("kvflow-operators", "operators/src", "lib.rs"),
    ("kvflow-kernels", "kernels/src", "lib.rs"),
]
# Layering rules: (crate, module, modules it must not reach, directly or through others).
FORBIDDEN = [
    # The scheduling policy is plain data structures: no transfer engine, no wire messages.
    ("kvflow-operators", ("policy",), [("transfer",), ("messages",)]),
    # The runtime takes a front end; the server is one.
    ("kvflow", ("runtime",), [("server",)]),
]
MAX_FILE_LINES = 800
MAX_FN_LINES = 120


def blank(src: str) -> str:
    """Comments, strings and char literals replaced by spaces; newlines kept."""
    out, i, n = [], 0, len(src)

    def keep_lines(s: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(keep_lines(src[i:j]))
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(src, i)) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append('"' + keep_lines(src[i + 1:j - 1]) + '"')
            i = j
        elif c == '"' or (c == "b" and src.startswith('b"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"))):
            j = i + (2 if c == "b" else 1)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('"' + keep_lines(src[i + 1:j]) + '"')
            i = j + 1
        elif c == "'":
            m = re.compile(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'").match(src, i)
            if m:
                out.append("' '" + " " * (m.end() - i - 3))
                i = m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def test_spans(text: str) -> tuple[list[tuple[int, int]], set[str]]:
    """Spans of test-only code in a blanked file, and the names of file modules declared test-only."""
    spans, test_mods = [], set()
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])", text):
        if m.group(2) == ";":
            test_mods.add(m.group(1))
        else:
            spans.append((m.start(), matching_brace(text, m.end() - 1)))
    for m in re.finditer(r"#\[(?:test|tokio::test[^\]]*)\]", text):
        f = re.compile(r"(?:\s*#\[[^\]]*\])*\s*(?:pub\s+)?(?:async\s+)?fn\s+\w+[^{;]*\{").match(text, m.end())
        if f:
            spans.append((m.start(), matching_brace(text, f.end() - 1)))
    return spans, test_mods


def in_spans(pos: int, spans) -> bool:
    return any(a <= pos <= b for a, b in spans)


class Crate:
    def __init__(self, name: str, root: str, entry: str):
        self.name, self.root = name, root
        self.files: dict[tuple, str] = {}  # module path -> file
        self.text: dict[tuple, str] = {}
        self.tests: dict[tuple, list] = {}
        self.test_files: set[tuple] = set()
        self.children: dict[tuple, set] = defaultdict(set)
        self.reexports: dict[tuple, dict] = defaultdict(dict)  # module -> name -> absolute path
        self.glob_reexports: dict[tuple, list] = defaultdict(list)  # module -> modules it `pub use`s whole
        self.use_aliases: dict[tuple, dict] = defaultdict(dict)  # module -> name -> absolute path
        self.load((), os.path.join(root, entry), os.path.join(root), False)

    def load(self, path: tuple, file: str, dir_for_children: str, is_test: bool):
        with open(file, encoding="utf-8") as f:
            text = blank(f.read())
        self.files[path], self.text[path] = file, text
        spans, test_mods = test_spans(text)
        self.tests[path] = spans
        if is_test:
            self.test_files.add(path)
        for m in re.finditer(r"^\s*(?:#\[path\s*=\s*\"([^\"]*)\"\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.M):
            name = m.group(2)
            child = path + (name,)
            self.children[path].add(name)
            for candidate in (os.path.join(dir_for_children, name + ".rs"), os.path.join(dir_for_children, name, "mod.rs")):
                if os.path.exists(candidate):
                    self.load(child, candidate, os.path.join(dir_for_children, name), is_test or name in test_mods or in_spans(m.start(), spans))
                    break
        for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*\{", text, re.M):
            self.children[path].add(m.group(1))

    # -- paths -------------------------------------------------------------------------------

    def absolute(self, here: tuple, segs: list[str]) -> list[str] | None:
        """A path as written in module `here`, made absolute within the crate (None: another crate)."""
        if not segs:
            return None
        base = list(here)
        head = segs[0]
        if head == "crate":
            return segs[1:]
        if head == "self":
            return base + segs[1:]
        if head == "super":
            i = 0
            while i < len(segs) and segs[i] == "super":
                base = base[:-1]
                i += 1
            return base + segs[i:]
        if head in self.children.get(here, ()):
            return base + segs
        if head in self.use_aliases.get(here, {}):
            return list(self.use_aliases[here][head]) + segs[1:]
        return None

    def resolve(self, segs: list[str], seen=None) -> tuple | None:
        """The module that defines what an absolute path names, following re-exports."""
        mod = ()
        for i, s in enumerate(segs):
            if mod + (s,) in self.files:
                mod = mod + (s,)
                continue
            target = self.reexports.get(mod, {}).get(s)
            if target is None:
                for glob in self.glob_reexports.get(mod, []):
                    if glob in self.text and re.search(
                        r"\b(?:struct|enum|fn|const|static|type|trait|mod|union)\s+" + re.escape(s) + r"\b", self.text[glob]
                    ):
                        target = glob + (s,)
                        break
            if target is not None:
                seen = seen or set()
                key = (mod, s)
                if key in seen:
                    return mod
                seen.add(key)
                return self.resolve(list(target) + segs[i + 1:], seen) or mod
            return mod
        return mod

    # -- uses ---------------------------------------------------------------------------------

    def use_trees(self, here: tuple):
        """(is_pub, absolute-or-None path, alias, position) for each leaf of each `use` outside tests."""
        text = self.text[here]
        for m in re.finditer(r"(?:^|[;{}\s])((pub(?:\([^)]*\))?\s+)?use\s+([^;]*);)", text):
            if in_spans(m.start(1), self.tests[here]):
                continue
            is_pub = m.group(2) is not None
            for segs, alias in expand_use(m.group(3)):
                yield is_pub, segs, alias, m.start(1)

    def index_uses(self):
        for here in self.files:
            for is_pub, segs, alias, _ in self.use_trees(here):
                if not segs:
                    continue
                if segs[-1] == "*":
                    absolute = self.absolute(here, segs[:-1])
                    if is_pub and absolute is not None:
                        self.glob_reexports[here].append(tuple(absolute))
                    continue
                absolute = self.absolute(here, segs)
                if absolute is None:
                    continue
                name = alias or segs[-1]
                if name == "self":
                    name = segs[-2] if len(segs) > 1 else name
                    absolute = absolute[:-1]
                if is_pub:
                    self.reexports[here][name] = tuple(absolute)
                self.use_aliases[here][name] = tuple(absolute)

    def edges(self) -> dict[tuple, dict[tuple, int]]:
        """module -> module it imports -> the first line that does."""
        self.index_uses()
        out: dict[tuple, dict[tuple, int]] = defaultdict(dict)
        for here in self.files:
            if here in self.test_files:
                continue
            text = self.text[here]

            def add(segs, pos):
                absolute = self.absolute(here, segs)
                if absolute is None:
                    return
                target = self.resolve(absolute)
                if target is None or target == here or target in self.test_files:
                    return
                # A module's own descendants or ancestors through a plain `mod` declaration are not
                # imports; naming their items is.
                out[here].setdefault(target, text.count("\n", 0, pos) + 1)

            for is_pub, segs, _alias, pos in self.use_trees(here):
                if is_pub or not segs:
                    continue
                if segs[-1] == "*":
                    segs = segs[:-1]
                add(segs, pos)
            for m in re.finditer(r"(?<![\w:])((?:[A-Za-z_]\w*::)+[A-Za-z_]\w*)", text):
                if in_spans(m.start(), self.tests[here]):
                    continue
                line_start = text.rfind("\n", 0, m.start()) + 1
                if re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?use\b", text[line_start:m.start()]):
                    continue
                add(m.group(1).split("::"), m.start())
        return out


def expand_use(tree: str) -> list[tuple[list[str], str | None]]:
    """`a::{b, c::d as e}` -> [(['a','b'], None), (['a','c','d'], 'e')]."""
    results = []

    def walk(prefix: list[str], s: str):
        s = s.strip()
        if not s:
            return
        brace = s.find("{")
        if brace >= 0:
            head_segs = [x for x in s[:brace].split("::") if x]
            for part in split_top(s[brace + 1 : s.rfind("}")]):
                walk(prefix + head_segs, part)
            return
        alias = None
        if " as " in s:
            s, alias = (x.strip() for x in s.split(" as ", 1))
        results.append((prefix + [x.strip() for x in s.split("::") if x.strip()], alias))

    walk([], re.sub(r"\s*(::|[{},])\s*", r"\1", re.sub(r"\s+", " ", tree)).lstrip(":"))
    return results


def split_top(body: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in body:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def strongly_connected(graph: dict) -> list[list]:
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in list(graph):
        if v not in index:
            visit(v)
    return comps


def cycle_through(graph: dict, comp: list) -> list:
    """One shortest cycle inside a strongly connected component, for the message."""
    members = set(comp)
    best = None
    for start in sorted(comp):
        prev, frontier = {start: None}, [start]
        while frontier and best is None or (frontier and len(best) > 2):
            nxt = []
            for v in frontier:
                for w in graph.get(v, {}):
                    if w not in members:
                        continue
                    if w == start:
                        path = [v]
                        while prev[path[-1]] is not None:
                            path.append(prev[path[-1]])
                        cyc = list(reversed(path)) + [start]
                        if best is None or len(cyc) < len(best):
                            best = cyc
                    elif w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
            if best is not None:
                break
    return best or comp


def reach(graph: dict, source: tuple):
    """For each module reachable from `source`, one shortest import path to it."""
    prev, frontier, out = {source: None}, [source], []
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
                    path = [w]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    out.append(list(reversed(path)))
        frontier = nxt
    return out


def mod_name(crate: Crate, path: tuple) -> str:
    return crate.name.split(" ")[0].replace("-", "_") + ("::" + "::".join(path) if path else "")


def long_functions(crate: Crate):
    for path, text in crate.text.items():
        if path in crate.test_files:
            continue
        for m in re.finditer(r"\bfn\s+(\w+)", text):
            if in_spans(m.start(), crate.tests[path]):
                continue
            j = m.end()
            depth = 0
            while j < len(text):
                c = text[j]
                if c in "(<[":
                    depth += 1
                elif c in ")>]":
                    depth -= 1 if not (c == ">" and text[j - 1] == "-") else 0
                elif c == ";" and depth <= 0:
                    j = -1
                    break
                elif c == "{" and depth <= 0:
                    break
                j += 1
            if j < 0 or j >= len(text):
                continue
            end = matching_brace(text, j)
            first = text.count("\n", 0, m.start()) + 1
            last = text.count("\n", 0, end) + 1
            if last - first + 1 > MAX_FN_LINES:
                yield crate.files[path], first, m.group(1), last - first + 1


def main() -> int:
    specs = CRATES
    if "--crate" in sys.argv:  # --crate NAME FOLDER ROOT_FILE: check that crate alone
        i = sys.argv.index("--crate")
        specs = [tuple(sys.argv[i + 1 : i + 4])]
    else:
        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    problems = []
    crates = [Crate(*spec) for spec in specs]
    for crate in crates:
        for path, file in crate.files.items():
            if path in crate.test_files:
                continue
            with open(file, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > MAX_FILE_LINES:
                problems.append(f"{file}: {lines} lines (at most {MAX_FILE_LINES} outside tests)")
        for file, line, name, length in long_functions(crate):
            problems.append(f"{file}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES} outside tests)")
        graph = crate.edges()
        if "--list" in sys.argv:
            for a, targets in sorted(graph.items()):
                for b, line in sorted(targets.items()):
                    print(f"{mod_name(crate, a)} -> {mod_name(crate, b)}  ({crate.files[a]}:{line})")
        for name, module, banned in FORBIDDEN:
            if name != crate.name:
                continue
            for hit in banned:
                paths = [
                    path
                    for source in graph
                    if source[: len(module)] == module
                    for path in reach(graph, source)
                    if path[-1][: len(hit)] == hit
                ]
                if paths:
                    steps = " -> ".join(mod_name(crate, m) for m in min(paths, key=len))
                    problems.append(
                        f"{mod_name(crate, module)} must not import {mod_name(crate, hit)}, directly or through others: {steps}"
                    )
        for comp in strongly_connected(graph):
            cyc = cycle_through(graph, comp)
            steps = " -> ".join(mod_name(crate, m) for m in cyc)
            where = "; ".join(f"{crate.files[a]}:{graph[a][b]}" for a, b in zip(cyc, cyc[1:]))
            problems.append(f"import cycle in {crate.name} ({len(comp)} modules): {steps}  [{where}]")
    for p in problems:
        print(p)
    print(f"structure: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
