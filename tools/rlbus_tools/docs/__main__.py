"""``python -m rlbus_tools.docs [--check] [DOCS_DIR]``: write the generated reference pages, or check them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlbus_tools.docs import PAGES, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlbus_tools.docs", description=__doc__)
    parser.add_argument("docs", nargs="?", type=Path, default=Path("docs"), help="the docs directory (docs)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale pages")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale(args.docs)
        for name in out_of_date:
            print(f"{args.docs / name} is stale: run `make docs` (python -m rlbus_tools.docs)", file=sys.stderr)
        return 1 if out_of_date else 0
    changed = write(args.docs)
    print(f"{len(PAGES)} generated pages, {len(changed)} rewritten: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
