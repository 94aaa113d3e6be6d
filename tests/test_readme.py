"""README: its LLM and Engine examples run as written, it stays small, and its links resolve."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the README is for newcomers; what later work documents goes to docs/
README_MAX_BYTES = 16 * 1024
# [text](target) in Markdown; the target stops at whitespace or the closing parenthesis
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def run_readme_example(marker: str, capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    """Runs the README's Python block that contains `marker`; returns its namespace and what it printed."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, (
        f"README.md should have one python block containing {marker!r}, found {len(matching)}"
    )
    namespace: dict = {}
    exec(compile(matching[0], "README.md", "exec"), namespace)
    return namespace, capsys.readouterr().out


@pytest.mark.slow
def test_readme_engine_example_runs(smollm2_path, capsys):
    namespace, printed = run_readme_example("BatchPreparer(engine)", capsys)
    outputs = eval(printed.strip().splitlines()[-1])
    assert [len(tokens) for tokens in outputs] == [16, 16]
    prep = namespace["prep"]
    assert prep.pages.num_used == 0 and prep.table_idxs.num_free == 128
    assert namespace["engine"]._closed


@pytest.mark.slow
def test_readme_llm_example_runs(smollm2_path, capsys):
    namespace, printed = run_readme_example("from minisgl.llm import LLM", capsys)
    assert "Paris" in printed and "4" in printed
    assert namespace["out"].finish_reason in ("stop", "length")


def test_readme_is_small():
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a page under docs/ and link it"
    )


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
