"""Write docs/settings.md from the settings classes (pagedkv/settings_doc.py).

``--check``: write nothing, exit 1 when the file differs from what the classes say (CI runs it
through ``make test``, beside ``tools/gen_protos.py --check``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from pagedkv.settings_doc import markdown

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="fail when docs/settings.md is stale")
    args = p.parse_args(argv)
    text = markdown()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            sys.stderr.write("docs/settings.md is stale: run `python tools/gen_settings_doc.py`\n")
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
