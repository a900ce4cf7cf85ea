"""Reading the project's source as code, or as prose, for the tests that scan it (test_defaults,
test_envs: code; tests/test_comments.py: comments and docstrings)."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

_STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) with comments and docstrings blanked; other strings are kept (a variable's
    name or an address is one), so a docstring may quote a command line without counting as code."""
    lines = path.read_text().splitlines()
    prev = tokenize.NEWLINE
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            docstring = tok.type == tokenize.STRING and prev in _STATEMENT_START
            if tok.type == tokenize.COMMENT or docstring:
                for row in range(tok.start[0], tok.end[0] + 1):
                    lines[row - 1] = ""
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                prev = tok.type
    return list(enumerate(lines, 1))


def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each comment and of each line of each docstring in ``source``: the
    prose a reader takes as a statement about the code. A comment is its own text only, without the
    code before it on the line (``timeout_ms=5  # ...`` gives ``# ...``); a docstring is a string
    that starts a statement, as in ``code_lines``."""
    lines = source.splitlines()
    out: list[tuple[int, str]] = []
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in _STATEMENT_START:
            out += [(row, lines[row - 1]) for row in range(tok.start[0], tok.end[0] + 1)]
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return out


def c_comment_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each line of each ``/* ... */`` and ``// ...`` comment in C ``source``:
    the comment's own text on that line, without the code around it. String and character literals
    are skipped, so a ``"/*"`` or a ``"// ..."`` in code opens no comment."""
    out: list[tuple[int, str]] = []
    i, line, n = 0, 1, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            out.append((line, source[i:end]))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for k, text in enumerate(source[i:end].split("\n")):
                out.append((line + k, text))
            line += source.count("\n", i, end)
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            i = j + 1
        else:
            line += c == "\n"
            i += 1
    return out
