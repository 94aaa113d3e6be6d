"""Embeddings (docs/embeddings.md): `LLM.embed` and `POST /v1/embeddings` against transformers' AutoModel
pooled the same way, on the default model (no pooling files: last token), the same folder with
mean-pooling sentence-transformers files, and a tiny Qwen3 saved from `Qwen3Model` (last token); mixed
with greedy generation; bad inputs answered 400 while the server goes on."""

from __future__ import annotations

import base64
import functools
import json
import shutil
import struct
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy
import openai
import pytest
import torch
from conftest import TOKENIZER_FILES, compiled_runner, llm_clean, make_tiny_model_with_tokenizer
from test_server import Server

from minisgl.core import SamplingParams
from minisgl.embeddings import MAX_EMBEDDING_INPUTS, finish, finish_all, folder_pooling, split_inputs
from minisgl.llm import LLM

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors", "a"]
IDS = [[1, 504, 3458, 282, 4649, 314], [1, 1, 2, 3]]


def _pooling_files(folder: Path, mode: str, normalize: bool = True) -> None:
    """sentence-transformers' files: a Transformer, a Pooling by `mode`, and a Normalize module."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    keys = {
        "last": "pooling_mode_lasttoken",
        "mean": "pooling_mode_mean_tokens",
        "cls": "pooling_mode_cls_token",
    }
    config = {key: key == keys[mode] for key in keys.values()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 1, **config}))


@pytest.fixture(scope="module")
def folders(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    """The default model; its files (linked) with mean-pooling files; a tiny bare Qwen3 with last-token
    files and the default model's tokenizer."""
    import transformers

    root = tmp_path_factory.mktemp("embed")
    mean = root / "smollm2-mean"
    mean.mkdir()
    for path in smollm2_path.iterdir():
        (mean / path.name).symlink_to(path)
    _pooling_files(mean, "mean")
    causal = make_tiny_model_with_tokenizer(root, "qwen3")
    bare = root / "tiny-qwen3-bare"
    transformers.AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(bare)
    for name in TOKENIZER_FILES:
        if (causal / name).is_file():
            shutil.copy(causal / name, bare / name)
    _pooling_files(bare, "last")
    return {"last": smollm2_path, "mean": mean, "bare": bare}


@functools.lru_cache(maxsize=1)
def _auto_model(folder: Path) -> torch.nn.Module:
    """transformers' AutoModel of `folder`, float32, in eval mode: loaded once for a folder's run of
    `reference` calls (the default model's load is most of a call), one folder's model kept at a time."""
    import transformers

    return transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", autouse=True)
def _free_the_reference_model() -> Iterator[None]:
    """The cached reference model goes with the module (the worker runs other modules after it)."""
    yield
    _auto_model.cache_clear()


def reference(folder: Path, ids: list[int], mode: str | None = None, normalize: bool = True) -> torch.Tensor:
    """transformers' AutoModel `last_hidden_state` pooled by `mode` (default: as the folder says, else
    last), normalized unless told not to."""
    mode = mode or folder_pooling(folder)[0] or "last"
    with torch.no_grad():
        hidden = _auto_model(folder)(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(
        torch.tensor(a, dtype=torch.float64), b.double(), dim=0
    ).item()


def _inputs(tokenizer) -> list[tuple[object, list[list[int]]]]:
    """Every input form with the token ids each of its inputs stands for."""
    tok = [tokenizer(t)["input_ids"] for t in TEXTS]
    return [(TEXTS[0], tok[:1]), (TEXTS, tok), (IDS[0], IDS[:1]), (IDS, IDS)]


@pytest.mark.parametrize("kind", ["last", "mean", "bare"])
def test_llm_embed_matches_transformers(folders, kind) -> None:
    folder = folders[kind]
    with LLM(str(folder), device="cpu", dtype="float32", max_running_req=4, max_prefill_tokens=8) as llm:
        assert llm.pooling == ("mean" if kind == "mean" else "last") and llm.normalize_embeddings
        for given, ids in _inputs(llm.tokenizer):
            vectors = llm.embed(given)
            assert len(vectors) == len(ids)
            for vector, item in zip(vectors, ids):
                assert _cos(vector, reference(folder, item)) >= 0.99999
        full = llm.embed(TEXTS[1])[0]
        short = llm.embed(TEXTS[1], dimensions=16)[0]
        expected = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
        assert len(short) == 16 and torch.allclose(torch.tensor(short), expected, atol=1e-6)
        llm_clean(llm)
        if kind == "bare":  # no LM head: generation is refused
            with pytest.raises(ValueError, match="no LM head"):
                llm.generate("hello")


@pytest.mark.parametrize("mode", ["cls", "mean", "last"])
def test_the_settings_override_the_folder(folders, mode) -> None:
    """pooling and normalize_embeddings given: the folder's files are not what counts; inputs longer
    than a prefill chunk pool across their chunks."""
    folder = folders["bare"]
    settings = dict(
        device="cpu", dtype="float32", max_prefill_tokens=3, pooling=mode, normalize_embeddings=False
    )
    with LLM(str(folder), **settings) as llm:
        ids = [llm.tokenizer(t)["input_ids"] for t in TEXTS]
        for vector, item in zip(llm.embed(TEXTS), ids):
            expected = reference(folder, item, mode, normalize=False)
            assert torch.allclose(torch.tensor(vector), expected, rtol=1e-4, atol=1e-5)
        # three pages of tokens, twice: last-token pooling takes the cached prefix, mean and CLS do not
        long = list(range(3, 53))
        expected = reference(folder, long, mode, normalize=False)
        for _ in range(2):
            assert torch.allclose(torch.tensor(llm.embed([long])[0]), expected, rtol=1e-4, atol=1e-5)
        assert (llm.scheduler.prefix_cached_tokens > 0) == (mode == "last")
        if (
            mode == "mean"
        ):  # every row and a carry across chunks, through the compiled forward's hidden states
            _check_the_compiled_path(llm, TEXTS, [long])
        llm_clean(llm)


def _check_the_compiled_path(llm, *inputs) -> None:
    """The engine's forward as on a GPU above its graphs: the compiled forward (dynamo, its eager
    backend), whose hidden states the vectors pool from; they equal the eager model's."""
    engine = llm.engine
    want = [llm.embed(item) for item in inputs]
    compiled = torch.compile(engine.model.forward, fullgraph=True, dynamic=False, backend="eager")
    runner = compiled_runner(engine, compiled)
    calls = []
    run = runner.run_compiled_hidden
    runner.run_compiled_hidden = lambda batch: calls.append(batch.num_tokens) or run(batch)
    eager_runner, engine.forward_path.graph_runner = engine.forward_path.graph_runner, runner
    try:
        got = [llm.embed(item) for item in inputs]
    finally:
        engine.forward_path.graph_runner = eager_runner
    assert calls, "the compiled forward ran"
    for a, b in zip(sum(got, []), sum(want, [])):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)


def test_embeddings_beside_greedy_generation(folders) -> None:
    """Embedding inputs batched with greedy generations: both as when each runs alone."""
    with LLM(
        str(folders["mean"]), device="cpu", dtype="float32", max_running_req=6, max_prefill_tokens=8
    ) as llm:
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        prompts = [llm.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
        alone = [out.token_ids for out in llm.generate(prompts, greedy)]
        alone_vectors = llm.embed(TEXTS)
        ids, params = llm.embedding_requests(TEXTS)
        sched = llm.scheduler
        states = [sched.add_request(p, greedy) for p in prompts]
        states += [sched.add_request(item, params) for item in ids]
        llm._run_until_finished(states, progress=False)
        assert [s.output_ids for s in states[:2]] == alone
        for state, vector in zip(states[2:], alone_vectors):
            assert _cos(vector, torch.tensor(state.embedding)) >= 0.99999
        llm_clean(llm)


def _decode(item) -> list[float]:
    raw = base64.b64decode(item.embedding) if isinstance(item.embedding, str) else None
    return list(struct.unpack(f"<{len(raw) // 4}f", raw)) if raw is not None else item.embedding


@pytest.fixture(scope="module")
def bare_server(folders):
    """A server of the tiny bare Qwen3, with a request trace (`srv.trace`)."""
    trace = folders["bare"].parent / "trace.jsonl"
    options = [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-running-req",
        "8",
        "--request-trace",
        str(trace),
    ]
    srv = Server("--model", str(folders["bare"]), *options)
    srv.trace = trace
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.output()


def test_http_embeddings_match_transformers(bare_server, folders) -> None:
    folder = folders["bare"]
    client = openai.OpenAI(base_url=bare_server.url, api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    for given, ids in _inputs(tok):
        for fmt in ("float", "base64"):
            out = client.embeddings.create(model=model, input=given, encoding_format=fmt, user="u")
            assert out.object == "list" and [d.index for d in out.data] == list(range(len(ids)))
            assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
            for item, item_ids in zip(out.data, ids):
                assert _cos(_decode(item), reference(folder, item_ids)) >= 0.99999
    full = client.embeddings.create(model=model, input=TEXTS[0]).data[0].embedding
    short = client.embeddings.create(model=model, input=TEXTS[0], dimensions=8).data[0].embedding
    assert len(full) == 64 and len(short) == 8
    assert torch.allclose(
        torch.tensor(short), torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0), atol=1e-6
    )
    lines = [json.loads(line) for line in bare_server.trace.read_text().splitlines()]
    assert lines and all(line["kind"] == "embedding" for line in lines)
    assert lines[-1]["prompt_tokens"] == len(tok(TEXTS[0])["input_ids"])
    metrics = bare_server.metrics()
    assert metrics["minisgl_embedding_requests_total,reason=stop"] >= 1
    assert metrics["minisgl_embedding_tokens_total"] >= sum(map(len, IDS))
    assert metrics["minisgl_generation_tokens_total"] == 0  # embeddings generate nothing


BAD = [
    ({"input": ""}, "empty string"),
    ({"input": []}, "empty list"),
    ({"input": [[1, 2], []]}, "empty list of token ids"),
    ({"input": [5, 49152]}, "outside the vocabulary"),
    ({"input": [5, -1]}, "outside the vocabulary"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": [1] * 600}, "context"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, str(MAX_EMBEDDING_INPUTS)),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": {"a": 1}}, "input"),
]


def test_finishing_and_splitting_inputs() -> None:
    """`LLM.embed`'s vectors finished at once (`finish_all`) as the server finishes each (`finish`):
    truncated, normalized or not, a zero vector left as it is; token ids of any integer type taken, a
    bool or a float among them refused."""
    vectors = [array("f", v) for v in ([3.0, 4.0, 12.0], [0.0, 0.0, 0.0], [1e-3, -2.5, 7.0])]
    for normalize in (True, False):
        for dims in (None, 2):
            got = finish_all(vectors, normalize, dims)
            want = [finish(v, normalize, dims) for v in vectors]
            assert torch.allclose(
                torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
            )
    assert finish_all(vectors, True)[0] == [3 / 13, 4 / 13, 12 / 13]
    assert split_inputs([[1, 2], (3, numpy.int64(4))]) == [[1, 2], [3, 4]]
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match=f"holds {bad}"):
            split_inputs([[1, bad]])


def test_bad_inputs_get_400_and_the_server_goes_on(bare_server) -> None:
    import httpx2 as httpx

    model = httpx.get(bare_server.url + "/models", timeout=30).json()["data"][0]["id"]
    for body, words in BAD:
        r = httpx.post(bare_server.url + "/embeddings", json={"model": model, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
        ok = httpx.post(bare_server.url + "/embeddings", json={"model": model, "input": "hi"}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64
    # a bare model has no LM head: its generation endpoints say so
    r = httpx.post(
        bare_server.url + "/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 400 and "no LM head" in r.json()["error"]["message"]


def test_cli_embed_prints_json_lines(folders, tmp_path) -> None:
    from click.testing import CliRunner

    from minisgl.cli import main

    folder = folders["bare"]
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("\n".join(TEXTS[:2]) + "\n")
    args = ["embed", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--quiet"]
    result = CliRunner().invoke(main, [*args, "--file", str(inputs), TEXTS[2]])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["text"] for line in lines] == [TEXTS[2], *TEXTS[:2]]
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    for line in lines:
        assert _cos(line["embedding"], reference(folder, tok(line["text"])["input_ids"])) >= 0.99999


def test_pooling_files_minisgl_cannot_follow_leave_generation_served(tmp_path) -> None:
    folder = make_tiny_model_with_tokenizer(tmp_path)
    _pooling_files(folder, "mean")
    config = folder / "1_Pooling" / "config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "pooling_mode_weightedmean_tokens": True})
    )
    with LLM(str(folder), device="cpu", dtype="float32") as llm:
        assert len(llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
        with pytest.raises(ValueError, match="pooling_mode_weightedmean_tokens"):
            llm.embed("hello")
    with LLM(str(folder), device="cpu", dtype="float32", pooling="last") as llm:
        assert len(llm.embed("hello")[0]) == 64


def test_embeddings_under_tensor_parallelism(folders) -> None:
    """Two ranks: the following rank pools in lockstep with rank 0 (mean, chunked)."""
    from test_tp_launch import _addr

    folder = folders["bare"]
    settings = dict(
        device="cpu", dtype="float32", max_prefill_tokens=8, pooling="mean", distributed_timeout=60
    )
    with LLM(str(folder), tp=2, distributed_addr=_addr(), **settings) as llm:
        ids = [llm.tokenizer(t)["input_ids"] for t in TEXTS] + [list(range(3, 40))]
        for vector, item in zip(llm.embed(ids), ids):
            assert _cos(vector, reference(folder, item, "mean")) >= 0.99999
        llm_clean(llm)


def test_http_embeddings_beside_greedy_completions(folders) -> None:
    """The mean-pooling folder served: embeddings requested while greedy completions run; the
    completions' tokens are those each gives alone, the vectors transformers'."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx2 as httpx
    import transformers

    folder = folders["mean"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    srv = Server(
        "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--max-prefill-tokens", "16"
    )
    try:
        model = httpx.get(srv.url + "/models", timeout=30).json()["data"][0]["id"]
        body = {
            "model": model,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

        def complete(prompt: str) -> list[int]:
            r = httpx.post(srv.url + "/completions", json={**body, "prompt": prompt}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        def embed(texts: list[str]) -> list[list[float]]:
            r = httpx.post(srv.url + "/embeddings", json={"model": model, "input": texts}, timeout=120)
            assert r.status_code == 200, r.text
            return [item["embedding"] for item in r.json()["data"]]

        alone = [complete(p) for p in TEXTS[:2]]
        with ThreadPoolExecutor(4) as pool:
            completions = [pool.submit(complete, p) for p in TEXTS[:2]]
            vectors = [pool.submit(embed, TEXTS), pool.submit(embed, TEXTS[::-1])]
            assert [f.result(timeout=300) for f in completions] == alone
            mixed = [f.result(timeout=300) for f in vectors]
        for got, texts in zip(mixed, (TEXTS, TEXTS[::-1])):
            for vector, text in zip(got, texts):
                assert _cos(vector, reference(folder, tok(text)["input_ids"])) >= 0.99999
    finally:
        assert srv.stop() == 0, srv.output()
