"""Reading the project's source as code for the tests that scan it (test_defaults, test_envs)."""

from __future__ import annotations

import tokenize
from pathlib import Path


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) with comments and docstrings blanked; other strings are kept (a variable's
    name or an address is one), so a docstring may quote a command line without counting as code."""
    lines = path.read_text().splitlines()
    prev = tokenize.NEWLINE
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            docstring = tok.type == tokenize.STRING and prev in (
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENCODING,
            )
            if tok.type == tokenize.COMMENT or docstring:
                for row in range(tok.start[0], tok.end[0] + 1):
                    lines[row - 1] = ""
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                prev = tok.type
    return list(enumerate(lines, 1))
