#!/usr/bin/env python3
# Used for the reshape notes: deploy/local/fn-lengths.py src [N] prints the median, p90 and max
# function length of the .rs files below src, and the N longest. A length counts code lines
# from `fn` to its closing brace: lines neither blank nor comment-only (issue 37's measure).
# Functions inside `#[cfg(test)]` modules are counted too.
"""Function lengths (lines from `fn` to its closing brace) of every fn in the .rs files below a
folder: median, p90, max and the longest ones."""
import os, re, sys, statistics
root = sys.argv[1] if len(sys.argv) > 1 else 'src'
lens = []
fn_re = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)')
for dp, _, files in os.walk(root):
    for f in files:
        if not f.endswith('.rs'):
            continue
        path = os.path.join(dp, f)
        lines = open(path).read().split('\n')
        i = 0
        while i < len(lines):
            m = fn_re.match(lines[i])
            if m:
                # find the opening brace of the body (or ';' for a declaration)
                depth = 0; started = False; j = i
                while j < len(lines):
                    code = re.sub(r'//.*', '', lines[j])
                    code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
                    code = re.sub(r"'(\\.|[^'\\])'", "''", code)
                    if not started and ';' in code and '{' not in code:
                        break
                    for ch in code:
                        if ch == '{':
                            depth += 1; started = True
                        elif ch == '}':
                            depth -= 1
                    if started and depth == 0:
                        code_lines = sum(
                            1 for line in lines[i:j + 1]
                            if line.strip() and not line.strip().startswith('//'))
                        lens.append((code_lines, f"{path}:{i+1} {m.group(6)}"))
                        break
                    j += 1
            i += 1
ls = sorted(l for l, _ in lens)
q = lambda p: ls[min(len(ls) - 1, int(p * len(ls)))]
print(f"{root}: {len(ls)} fns, median {statistics.median(ls)}, p90 {q(0.9)}, max {ls[-1]}")
for l, where in sorted(lens, reverse=True)[:int(sys.argv[2]) if len(sys.argv) > 2 else 8]:
    print(f"  {l:4} {where}")
