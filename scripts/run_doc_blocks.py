"""Run the code blocks of README.md and docs/ marked `slow` (or another tier),
each sandboxed as tests/docs/test_doc_blocks.py runs the fast ones, and report
each block's time and result (docs/README.md, "Code blocks the tests run").

    python scripts/run_doc_blocks.py               # the slow blocks
    python scripts/run_doc_blocks.py --tier fast   # the ones CI runs
    python scripts/run_doc_blocks.py --list        # which blocks are marked, per page
    python scripts/run_doc_blocks.py docs/operations.md   # one page's

Exit status 1 when a block fails.
"""

import argparse
import sys
import time
from pathlib import Path

from raylm.testing.doc_blocks import TIERS, doc_pages, extract, run_tier

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to run (default: README.md and docs/)")
    parser.add_argument("--tier", choices=TIERS, default="slow")
    parser.add_argument("--list", action="store_true", help="list the marked blocks per page and exit")
    args = parser.parse_args()
    if args.list:
        for page in doc_pages(ROOT):
            blocks = extract(page)
            tiers = ", ".join(f"{t} {sum(b.tier == t for b in blocks)}" for t in TIERS)
            print(f"{page.relative_to(ROOT)}: {len(blocks)} blocks; marked {tiers}")
        return 0
    start = time.monotonic()
    results = run_tier(ROOT, args.tier, [page.resolve() for page in args.pages])
    failed = 0
    for r in results:
        problem = r.problem()
        failed += problem is not None
        first = r.block.code.strip().splitlines()[0]
        print(f"{'FAIL' if problem else 'ok  '} {r.block.where:<20} {r.seconds:6.1f} s  {first[:70]}")
        if problem:
            print("     " + problem.replace("\n", "\n     "))
        if r.leftovers and r.block.cleanup:
            print(f"     ended {len(r.leftovers)} processes it left on purpose")
    print(f"{len(results) - failed} of {len(results)} {args.tier} blocks ok in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
