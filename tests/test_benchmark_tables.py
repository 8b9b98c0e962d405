"""benchmarks/README.md's tables are what benchmarks/make_readme.py makes from benchmarks/results/*.json.

Fast and without matplotlib: the plots are checked only by `make_readme.py --check --plots`.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def test_the_tables_are_made_from_the_results_with_no_diff():
    done = subprocess.run(
        [sys.executable, str(BENCH / "make_readme.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_every_results_file_says_where_its_figures_come_from():
    files = sorted((BENCH / "results").glob("*.json"))
    assert files
    for path in files:
        doc = json.loads(path.read_text())
        assert doc["title"] and doc["question"] and doc["source"] and doc["rows"], path.name
        assert doc["runs"], path.name
        for letter, run in doc["runs"].items():
            for field in ("machine", "date", "raylm_commit", "command"):
                assert run.get(field), f"{path.name}: run {letter} has no {field}"
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]), f"{path.name}: run {letter}'s date"
        if "transcribed" not in doc["source"]:
            continue
        assert "not re-run" in doc["source"], path.name


def test_the_readme_stays_short_and_its_links_resolve():
    readme = BENCH / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 520
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (readme.parent / target).exists(), target
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in slugs, anchor
    for name in ("decode_by_batch.svg", "migration_pause.svg"):
        assert f"plots/{name}" in text and (BENCH / "plots" / name).is_file()


def test_nothing_under_benchmarks_names_a_path_outside_the_repo():
    for path in BENCH.rglob("*"):
        if path.is_file() and path.suffix in {".md", ".py", ".sh", ".json"}:
            text = path.read_text(errors="replace")
            assert "../shared" not in text and "/shared/" not in text, path
