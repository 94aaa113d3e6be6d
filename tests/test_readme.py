"""README's Engine API example runs as written and generates what it promises."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_engine_example_runs(smollm2_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine_block = next(b for b in blocks if "BatchPreparer(engine)" in b)
    namespace: dict = {}
    exec(compile(engine_block, "README.md", "exec"), namespace)
    outputs = eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert [len(tokens) for tokens in outputs] == [16, 16]
    prep = namespace["prep"]
    assert prep.pages.num_used == 0 and prep.table_idxs.num_free == 128
    assert namespace["engine"]._closed


@pytest.mark.slow
def test_readme_llm_example_runs(smollm2_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    llm_block = next(b for b in blocks if "from minisgl.llm import LLM" in b)
    namespace: dict = {}
    exec(compile(llm_block, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Paris" in printed and "4" in printed
    assert namespace["out"].finish_reason in ("stop", "length")
