#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The shape of the library, as a table: modules and their includes, header, class and function
sizes, the headers' opening comments, README lengths, test file sizes and the pipeline options a
user reads. Reports and never fails (exit 0 unless it cannot read the tree).

    scripts/size_check.py [repository root]

Classes and functions are found by a brace scan of the headers (no compiler): a class is a
`class`/`struct` head followed by `{`; a function is a line ending in `) {` (or `) const {`,
`noexcept {`, ...) that is not a control statement or a lambda; each spans to its matching `}`.
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
INC = os.path.join(ROOT, "include", "cudawait")
# The modules from the bottom up; a module may include its own files and those of lower ranks.
RANK = {"runtime": 1, "core": 2, "memory": 3, "observe": 3, "nccl": 3, "copy": 4, "pipeline": 5}
TOP = 6  # the umbrella (cudawait.hpp) and version.hpp sit above every module


def module_of(rel):
    """The module of a header, by its path below include/cudawait/ (a face is its module's)."""
    first = rel.split("/")[0]
    name = first[:-4] if first.endswith(".hpp") else first
    return name if name in RANK else "umbrella"


def rank(module):
    return RANK.get(module, TOP)


def headers():
    out = []
    for d, _, files in os.walk(INC):
        for f in files:
            if f.endswith(".hpp"):
                out.append(os.path.relpath(os.path.join(d, f), INC))
    return sorted(out)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def includes(lines):
    return [m.group(1) for m in (re.match(r"\s*#include <cudawait/([^>]+)>", l) for l in lines) if m]


def strip_comments(lines):
    """The lines with // comments and string literals blanked (block comments are not used)."""
    out = []
    for l in lines:
        l = re.sub(r'"(\\.|[^"\\])*"', '""', l)
        l = re.sub(r"'(\\.|[^'\\])*'", "''", l)
        i = l.find("//")
        out.append(l[:i] if i >= 0 else l)
    return out


CONTROL = re.compile(r"^\s*(\}\s*)?(if|else|for|while|switch|do|try|catch|return|case|namespace|extern)\b")
CLASS_HEAD = re.compile(r"^\s*(template\s*<.*>\s*)?(class|struct)\s+(\w+)[^;()]*$")
FUNC_END = re.compile(r"\)\s*(const|noexcept|override|final|->\s*[\w:<>&*, ]+|\s)*\{\s*$")


def spans(lines):
    """(kind, name, first line, length) of the classes and functions in a header."""
    code = strip_comments(lines)
    found = []
    for i, l in enumerate(code):
        kind = name = None
        m = CLASS_HEAD.match(l)
        if m and ("{" in l or (i + 1 < len(code) and code[i + 1].strip().startswith("{"))
                  or (i + 1 < len(code) and code[i + 1].strip().startswith(":"))):
            kind, name = "class", m.group(3)
        elif FUNC_END.search(l) and not CONTROL.match(l):
            # The head may span lines: the name is on the line that opens the parameter list.
            head = l
            for k in range(i, max(i - 6, -1), -1):
                if re.search(r"[~\w:]+\s*\(", code[k]):
                    head = code[k]
                    break
            head = re.sub(r"\[\[[^\]]*\]\]", "", head)  # attributes
            before = head.split("(")[0]
            m = re.search(r"([~\w:]+)\s*\(", head)
            if m and "[" not in before and "=" not in before and not CONTROL.match(head):
                kind, name = "function", m.group(1)
        if kind is None:
            continue
        depth, started = 0, False
        for j in range(i, len(code)):
            for ch in code[j]:
                if ch == "{":
                    depth += 1
                    started = True
                elif ch == "}":
                    depth -= 1
            if started and depth <= 0:
                found.append((kind, name, i + 1, j - i + 1))
                break
    return found


def opening_comment(lines):
    """Lines of the comment block that opens a header (after the SPDX line and #pragma once)."""
    n, seen = 0, False
    for l in lines[1:]:
        s = l.strip()
        if s.startswith("#pragma") or (not s and not seen):
            continue
        if s.startswith("//"):
            n += 1
            seen = True
            continue
        if not s and seen:
            continue
        break
    return n


def option_fields(path):
    """Direct data members of struct pipeline_options (a nested struct's member counts once)."""
    if not os.path.exists(path):
        return None
    code = strip_comments(read(path))
    count, depth, inside = 0, 0, False
    for l in code:
        if not inside and re.match(r"^struct pipeline_options\b.*\{", l):
            inside, depth = True, 1
            continue
        if not inside:
            continue
        if depth == 1 and re.match(r"^\s+[\w:<>,\s*&]+\s+\w+(\s*=.*|\s*\{.*\})?;\s*$", l) and "(" not in l \
                and not re.match(r"^\s+(using|friend|static|return)\b", l):
            count += 1
        depth += l.count("{") - l.count("}")
        if depth <= 0:
            break
    return count


def main():
    hs = headers()
    text = {h: read(os.path.join(INC, h)) for h in hs}
    up, sideways, mod_edges = [], [], {}
    for h in hs:
        a = module_of(h)
        for inc in includes(text[h]):
            b = module_of(inc)
            if a != b:
                mod_edges.setdefault(a, set()).add(b)
            if rank(b) > rank(a):
                up.append(f"{h} -> {inc}")
            elif rank(b) == rank(a) and a != b:
                sideways.append(f"{h} -> {inc}")
    # Floors: the longest chain of module dependencies, the umbrella included.
    memo = {}

    def floor(m, stack=()):
        if m in stack:
            return float("inf")  # a cycle
        if m not in memo:
            memo[m] = 1 + max((floor(d, stack + (m,)) for d in mod_edges.get(m, ())), default=0)
        return memo[m]

    floors = max(floor(m) for m in set(module_of(h) for h in hs))
    # File-level cycles.
    graph = {h: [i for i in includes(text[h]) if i in text] for h in hs}
    color, cycles = {}, []

    def visit(n, path):
        color[n] = 1
        for d in graph[n]:
            if color.get(d) == 1:
                cycles.append(" -> ".join(path + [d]))
            elif d not in color:
                visit(d, path + [d])
        color[n] = 2

    for h in hs:
        if h not in color:
            visit(h, [h])
    sizes = sorted(((len(text[h]) - 1, h) for h in hs), reverse=True)
    all_spans = [(s, h) for h in hs for s in spans(text[h])]
    classes = sorted(((s[3], f"{h}:{s[2]} {s[1]}") for s, h in all_spans if s[0] == "class"), reverse=True)
    funcs = sorted(((s[3], f"{h}:{s[2]} {s[1]}") for s, h in all_spans if s[0] == "function"), reverse=True)
    openings = sorted(((opening_comment(text[h]), h) for h in hs), reverse=True)
    comment_lines = sum(sum(1 for l in text[h] if l.strip().startswith("//")) for h in hs)
    total_lines = sum(len(text[h]) - 1 for h in hs)

    def lines_of(rel):
        p = os.path.join(ROOT, rel)
        return len(read(p)) - 1 if os.path.exists(p) else 0

    tests = []
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.endswith((".cpp", ".cu", ".hpp")):
                p = os.path.join(d, f)
                tests.append((len(read(p)) - 1, os.path.relpath(p, ROOT)))
    tests.sort(reverse=True)
    fields = option_fields(os.path.join(INC, "pipeline", "options.hpp"))

    rows = [
        ("modules (floors) / includes running up or sideways / file cycles",
         f"{floors} / {len(up) + len(sideways)} / {len(cycles)}", "<= 7 / 0 / 0"),
        ("largest header; headers over 800 lines",
         f"{sizes[0][0]} ({sizes[0][1]}); {sum(1 for n, _ in sizes if n > 800)}", "<= 800; 0"),
        ("classes over 600 lines; functions over 100 lines",
         f"{sum(1 for n, _ in classes if n > 600)}; {sum(1 for n, _ in funcs if n > 100)}", "0; 0"),
        ("opening comment block: largest; total",
         f"{openings[0][0]} ({openings[0][1]}); {sum(n for n, _ in openings)}", "<= 30; <= 600"),
        ("comment share of header lines", f"{100.0 * comment_lines / max(total_lines, 1):.0f}%", "<= 15%"),
        ("README lines; benchmarks/README lines",
         f"{lines_of('README.md')}; {lines_of('benchmarks/README.md')}", "<= 250; <= 150"),
        ("largest test file", f"{tests[0][0]} ({tests[0][1]})" if tests else "-", "<= 1500"),
        ("flat pipeline_options fields", "-" if fields is None else str(fields), "<= 8"),
    ]
    print(f"cudawait's shape: {len(hs)} headers, {total_lines} lines")
    w = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"  {name:<{w}}  {value:<44}  target {target}")
    for label, items in (("includes running up", up), ("includes sideways", sideways), ("cycles", cycles)):
        for item in items:
            print(f"  {label}: {item}")
    for label, items, bar in (("header", sizes, 800), ("class", classes, 600), ("function", funcs, 100),
                              ("opening comment", openings, 30), ("test file", tests, 1500)):
        for n, where in items:
            if n > bar:
                print(f"  {label} over {bar}: {n} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
