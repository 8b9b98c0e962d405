"""The code blocks of README.md and docs/ run as written (the ones marked
`fast`; `scripts/run_doc_blocks.py` runs the `slow` ones), every marker is
well formed, and every link between the pages lands on a file and a heading.
The markers: docs/README.md, "Code blocks the tests run"."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from raylm.entrypoints.cli import build_parser
from raylm.testing import doc_blocks
from raylm.testing.doc_blocks import (
    DocBlock,
    Sandbox,
    doc_pages,
    extract,
    parse_marker,
    run_block,
    run_tier,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_marker_parses_and_the_counts_are_shown(capsys):
    counts = {}
    for page in doc_pages(ROOT):
        blocks = extract(page)  # raises on a misspelt or misplaced marker
        counts[str(page.relative_to(ROOT))] = (
            len(blocks),
            sum(b.tier == "fast" for b in blocks),
            sum(b.tier == "slow" for b in blocks),
        )
    with capsys.disabled():
        print("\ndoc blocks (all, fast, slow):", counts)
    readme_all, readme_fast, _ = counts["README.md"]
    # The README's first generate and serve (Python, shell, server, two clients) run in CI.
    assert readme_fast >= 5
    assert sum(fast + slow for _, fast, slow in counts.values()) >= 8


@pytest.mark.parametrize(
    "body",
    [
        "fsat",
        "fast servr",
        "fast expect=",
        "fast timeout=x",
        "fast timeout=0",
        "slow serve client",
        "",
        "fast cleanup=1",
    ],
)
def test_a_misspelt_marker_is_refused(body):
    with pytest.raises(ValueError):
        parse_marker(body, "page.md:1")


def test_marker_words():
    assert parse_marker('slow serve cleanup expect="a b" timeout=30', "p") == {
        "tier": "slow",
        "role": "serve",
        "cleanup": True,
        "expect": "a b",
        "timeout_s": 30.0,
    }


@pytest.mark.parametrize(
    "page",
    [
        "<!-- doc-test: fast -->\n\n```bash\ntrue\n```\n",  # not right before the fence
        "<!-- doc-test fast -->\n```bash\ntrue\n```\n",  # no colon
        "<!-- doc-test: fast -->\n```yaml\na: 1\n```\n",  # no runner for yaml
        "<!-- doc-test: fast -->\n",  # no block at all
        "```bash\ntrue\n",  # never closed
    ],
)
def test_a_misplaced_marker_is_refused(tmp_path, page):
    (tmp_path / "p.md").write_text(page)
    with pytest.raises(ValueError):
        extract(tmp_path / "p.md")


def test_an_indented_marker_is_an_example(tmp_path):
    (tmp_path / "p.md").write_text("    <!-- doc-test: TIER -->\n\n```bash\ntrue\n```\n")
    assert [b.tier for b in extract(tmp_path / "p.md")] == [None]


def block(code: str, lang: str = "bash", **fields) -> DocBlock:
    return DocBlock(Path("p.md"), 1, lang, code, **{"tier": "fast", **fields})


def test_the_runner_sees_failures(monkeypatch):
    """What makes a block fail: a status, a missing expected text, a timeout,
    a process left behind (ended by the runner), and the sandbox's limits."""
    monkeypatch.setattr(doc_blocks, "LEFTOVER_GRACE_S", 1.0)
    sandbox = Sandbox()
    try:
        assert run_block(block("echo hi"), sandbox).problem() is None
        assert "exit status 3" in run_block(block("exit 3"), sandbox).problem()
        assert "not in its output" in run_block(block("echo hi", expect="bye"), sandbox).problem()
        assert "timed out" in run_block(block("sleep 30", timeout_s=1), sandbox).problem()
        left = run_block(block("setsid sleep 300 >/dev/null 2>&1 &"), sandbox)
        assert "left processes behind" in left.problem() and "sleep 300" in left.leftovers[0]
        assert run_block(block("setsid sleep 300 >/dev/null 2>&1 &", cleanup=True), sandbox).problem() is None
        probe = (
            "import os, urllib.request\n"
            "home, cwd = os.environ['HOME'], os.getcwd()\n"
            "assert os.path.dirname(home) == os.path.dirname(cwd) and cwd.endswith('/cwd'), (home, cwd)\n"
            "assert os.environ['HF_HUB_OFFLINE'] == '1'\n"
            "try:\n"
            "    urllib.request.urlopen('http://example.com', timeout=5)\n"
            "    raise SystemExit('reached the network')\n"
            "except OSError:\n"
            "    print('offline')\n"
        )
        assert run_block(block(probe, lang="python", expect="offline"), sandbox).problem() is None
    finally:
        assert sandbox.close() == []
    assert not sandbox.root.exists() and not sandbox.ray_tmp.exists()


def test_setup_commands_are_ci_s():
    """The README's two set-up commands are the first two lines that begin
    `pip install -e`, and the second is what CI runs."""
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("pip install -e")]
    assert lines[0] == 'pip install -e . -c constraints.txt && raylm generate "ROMEO:"'
    assert lines[1] in (ROOT / ".ci" / "run").read_text().splitlines()


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    in_code, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_links_between_pages_land(tmp_path):
    assert not broken_links(
        [*doc_pages(ROOT), ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "peers" / "README.md"]
    )
    (tmp_path / "a.md").write_text(
        "## 1.7 LoRA, by name\n[x](b.md) [y](#17-lora-by-name) [z](#lora) [w](a.md#17-lora-by-name)\n"
    )
    assert broken_links([tmp_path / "a.md"]) == ["a.md: b.md (no such file)", "a.md: #lora (no such heading)"]


@pytest.mark.server
def test_fast_blocks_run_as_written(capsys):
    results = run_tier(ROOT, "fast")
    with capsys.disabled():
        for r in results:
            print(f"\n{r.block.where} ({r.block.lang} {r.block.role or 'run'}): {r.seconds:.1f} s", end="")
        print()
    assert len(results) >= 5
    problems = [p for r in results if (p := r.problem())]
    assert not problems, "\n\n".join(problems)


def raylm_commands(code: str) -> list[list[str]]:
    """The `raylm ...` commands of a shell block, each as its argv (comments,
    line continuations, `&&`, `;` and pipes taken apart)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        current: list[str] = []
        for word in lexer:
            if set(word) <= set(";&|"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    # `...` on a page stands for more flags, not a word the CLI is given.
    return [[w for w in c[1:] if w != "..."] for c in commands if c[:1] == ["raylm"]]


def test_every_raylm_command_on_the_pages_parses():
    """Marked or not, each `raylm` command in a shell block names flags and
    values that the CLI takes (a renamed or misspelt flag fails here)."""
    parser = build_parser()
    wrong, seen = [], 0
    for page in doc_pages(ROOT):
        for b in extract(page):
            if b.lang not in ("bash", "sh", "console"):
                continue
            for argv in raylm_commands(b.code):
                seen += 1
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        parser.parse_args(argv)
                except SystemExit:
                    wrong.append(f"{b.where}: raylm {shlex.join(argv)}: {err.getvalue().strip()[-200:]}")
    assert not wrong, "\n".join(wrong)
    assert seen >= 20, seen


def test_every_python_block_compiles():
    blocks = [b for page in doc_pages(ROOT) for b in extract(page) if b.lang == "python"]
    for b in blocks:
        compile(b.code, b.where, "exec")
    assert len(blocks) >= 3
