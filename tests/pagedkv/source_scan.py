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
