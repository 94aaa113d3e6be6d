"""EngineSettings: layering (explicit > env > YAML > defaults), origins, validation, presets, model configs."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from minisgl.config_fields import Setting, declaration
from minisgl.distributed import DistributedInfo
from minisgl.engine.config import EngineConfig
from minisgl.models.config import ModelConfig
from minisgl.multimodal.config import MediaConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.settings import CONFIGS as CONFIG_CLASSES
from minisgl.settings import EngineSettings, LaunchConfig, ServerConfig, SettingsError, settings_markdown

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
H200_PRESET = CONFIGS / "h200-qwen3-0.6b.yaml"
CPU_PRESET = CONFIGS / "cpu-smollm2.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MINISGL_* variable of the surrounding shell leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("MINISGL_"):
            monkeypatch.delenv(name)


def write_yaml(path: Path, values: dict[str, Any] | str) -> Path:
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values))
    return path


def make_model_folder(path: Path, num_layers: int = 2) -> Path:
    """A minimal Llama model folder: just config.json."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 256,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def fake_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """default_model_path() returns a tiny tmp folder instead of preparing the real SmolLM2."""
    folder = make_model_folder(tmp_path / "default-model")
    monkeypatch.setattr("minisgl.models.default.default_model_path", lambda: folder)
    return folder


# -- defaults --------------------------------------------------------------------------------------


def test_fields_mirror_the_configs() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    scheduler = {f.name for f in dataclasses.fields(SchedulerConfig)}
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    media = {f.name for f in dataclasses.fields(MediaConfig)}
    launch = {"tp_size", "dp_size"}
    filled = {"tp_info", "enable_lora"}  # by the settings layer, from tp_size and the LoRA settings
    assert set(EngineSettings.model_fields) == engine - filled | scheduler | launch | server | media
    assert [f.name for f in dataclasses.fields(LaunchConfig)] == ["tp_size", "dp_size"]


@pytest.mark.parametrize("config_cls", CONFIG_CLASSES, ids=lambda cls: cls.__name__)
def test_every_config_field_is_a_setting_with_a_description(config_cls: type) -> None:
    for field in dataclasses.fields(config_cls):
        declared = declaration(field)
        filled = {"tp_info": "tp_size", "enable_lora": "lora_modules"}
        if field.name in filled:  # the fields that are no setting say where they come from
            assert isinstance(declared, str) and filled[field.name] in declared
            continue
        assert isinstance(declared, Setting), (
            f"{config_cls.__name__}.{field.name} is not declared with setting()"
        )
        assert declared.description and "\n" not in declared.description, field.name
        assert EngineSettings.model_fields[field.name].description == declared.description


def test_defaults_equal_config_defaults() -> None:
    settings = EngineSettings.model_fields
    for config_cls in CONFIG_CLASSES:
        for field in dataclasses.fields(config_cls):
            if field.name == "model_path":  # required in EngineConfig; None = the default model here
                assert settings["model_path"].default is None and field.default is dataclasses.MISSING
            elif field.name == "tp_info":
                assert DistributedInfo(0, settings["tp_size"].default) == field.default_factory()
            elif field.name == "enable_lora":  # on with lora_modules or allow_runtime_lora, both off
                assert field.default_factory() is False
                assert not settings["lora_modules"].default and not settings["allow_runtime_lora"].default
            else:
                assert settings[field.name].default == field.default, field.name


def test_default_settings_build_the_default_configs(tmp_path: Path) -> None:
    model = str(make_model_folder(tmp_path / "m"))
    settings = EngineSettings.load(model_path=model)
    assert settings.to_engine_config() == EngineConfig(model_path=model)
    assert EngineConfig(model_path=model).dtype is None  # 'auto'
    assert settings.to_scheduler_config() == SchedulerConfig()
    assert SchedulerConfig().prefill_tokens("cpu") == 512 and SchedulerConfig().prefill_tokens("cuda") == 8192
    assert SchedulerConfig(max_prefill_tokens=24).prefill_tokens("cuda") == 24


def test_every_field_has_a_one_line_description() -> None:
    for name, field in EngineSettings.model_fields.items():
        assert field.description and "\n" not in field.description, name


# -- layering and origins --------------------------------------------------------------------------


def test_priority_explicit_over_env_over_yaml_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_yaml(tmp_path / "s.yaml", {"page_size": 32, "max_running_req": 8, "memory_ratio": 0.5})
    monkeypatch.setenv("MINISGL_PAGE_SIZE", "64")
    monkeypatch.setenv("MINISGL_MAX_RUNNING_REQ", "16")

    settings = EngineSettings.load(config, page_size=128)

    assert (settings.page_size, settings.max_running_req, settings.memory_ratio) == (128, 16, 0.5)
    assert settings.dtype == "auto"
    sources = settings.sources()
    assert sources["page_size"] == "explicit"
    assert sources["max_running_req"] == "env MINISGL_MAX_RUNNING_REQ"
    assert sources["memory_ratio"] == f"yaml {config}"
    assert sources["dtype"] == "default"
    assert set(sources) == set(EngineSettings.model_fields)


def test_minisgl_config_env_picks_the_yaml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_yaml(tmp_path / "s.yaml", {"max_running_req": 8})
    monkeypatch.setenv("MINISGL_CONFIG", str(config))
    settings = EngineSettings.load()
    assert settings.max_running_req == 8
    assert settings.sources()["max_running_req"] == f"yaml {config}"
    assert EngineSettings().max_running_req == 8  # the plain constructor layers the same way


def test_config_argument_beats_minisgl_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CONFIG", str(write_yaml(tmp_path / "a.yaml", {"max_running_req": 8})))
    assert EngineSettings.load(write_yaml(tmp_path / "b.yaml", {"max_running_req": 9})).max_running_req == 9


@pytest.mark.parametrize("raw", ["[1,2,4]", "1,2,4", " 1, 2 ,4 "])
def test_env_batch_size_list(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CUDA_GRAPH_BS", raw)
    assert EngineSettings.load().cuda_graph_bs == [1, 2, 4]


def test_env_values_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_USE_DUMMY_WEIGHT", "true")
    monkeypatch.setenv("MINISGL_MEMORY_RATIO", "0.25")
    monkeypatch.setenv("MINISGL_CUDA_GRAPH_MAX_BS", "none")
    monkeypatch.setenv("MINISGL_CACHE_DIR", "/nonexistent")  # not a setting, but allowed
    settings = EngineSettings.load(config=None, cuda_graph_max_bs=None)
    assert settings.use_dummy_weight is True and settings.memory_ratio == 0.25
    assert settings.cuda_graph_max_bs is None and settings.sources()["cuda_graph_max_bs"] == "explicit"
    monkeypatch.setenv("MINISGL_CUDA_GRAPH_MAX_BS", "8")
    assert EngineSettings.load().cuda_graph_max_bs == 8


def test_relative_model_path_in_yaml_resolves_against_its_folder(tmp_path: Path) -> None:
    model = make_model_folder(tmp_path / "presets" / "models" / "m")
    config = write_yaml(tmp_path / "presets" / "s.yaml", {"model_path": "models/m"})
    assert Path(EngineSettings.load(config).model_path) == model.resolve()
    # a path that does not exist beside the file is left as written
    other = write_yaml(tmp_path / "presets" / "t.yaml", {"model_path": "elsewhere/m"})
    assert EngineSettings.load(other).model_path == "elsewhere/m"


def test_settings_are_frozen() -> None:
    settings = EngineSettings.load()
    with pytest.raises(ValueError):
        settings.page_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("key", "value", "read"),
    [
        ("page_size", 32, lambda llm: llm.engine.config.page_size),
        ("max_prefill_tokens", 24, lambda llm: llm.scheduler.max_prefill_tokens),
    ],
    ids=["engine", "scheduler"],
)
def test_one_key_through_yaml_env_and_llm_keywords(
    key: str, value: int, read: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EngineConfig field and a SchedulerConfig field, set the same way (the CLI: tests/test_cli.py)."""
    from minisgl.llm import LLM

    config = write_yaml(tmp_path / "s.yaml", {key: value})
    settings = EngineSettings.load(config)
    assert getattr(settings, key) == value and settings.sources()[key] == f"yaml {config}"
    monkeypatch.setenv(f"MINISGL_{key.upper()}", str(value))
    settings = EngineSettings.load()
    assert getattr(settings, key) == value and settings.sources()[key] == f"env MINISGL_{key.upper()}"
    monkeypatch.delenv(f"MINISGL_{key.upper()}")
    assert getattr(EngineSettings.load(**{key: value}), key) == value

    model = make_model_folder(tmp_path / "m")
    tiny = {"device": "cpu", "use_dummy_weight": True, "cpu_kv_budget_gib": 0.01, "max_running_req": 4}
    with LLM(str(model), **tiny, **{key: value}) as llm:
        assert read(llm) == value and llm.settings.sources()[key] == "explicit"
    with LLM(str(model), config=config, **tiny) as llm:
        assert read(llm) == value


def test_max_prefill_tokens_default_follows_the_device(tmp_path: Path) -> None:
    from minisgl.llm import LLM

    model = make_model_folder(tmp_path / "m")
    with LLM(str(model), device="cpu", use_dummy_weight=True, cpu_kv_budget_gib=0.01) as llm:
        assert llm.scheduler.max_prefill_tokens == 512 and llm.settings.max_prefill_tokens is None


def test_strings_are_parsed_other_values_type_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Env variables and CLI options give strings, which are parsed; Python and YAML values are not
    coerced: True is no 1 and 1 is no True."""
    assert EngineSettings.load(page_size="32", overlap_scheduling="false").page_size == 32
    assert EngineSettings.load(memory_ratio=1).memory_ratio == 1.0  # an integer is a number
    for key, value in [
        ("page_size", True),
        ("use_dummy_weight", 1),
        ("memory_ratio", False),
        ("dtype", 16),
        ("page_size", torch.float16),  # only dtype takes a torch.dtype
    ]:
        with pytest.raises(SettingsError) as error:
            EngineSettings.load(**{key: value})
        assert_names(error, f"{key}={value!r} must be", "explicit")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_takes_a_torch_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    """From Python, dtype may also be a torch.dtype: the settings keep its name, the EngineConfig the dtype."""
    name = str(dtype).removeprefix("torch.")
    settings = EngineSettings.load(
        model_path=str(make_model_folder(tmp_path / "m")), device="cpu", dtype=dtype
    )
    assert settings.dtype == name and settings.sources()["dtype"] == "explicit"
    assert f"dtype: {name}  # explicit" in settings.to_yaml(with_sources=True).splitlines()
    assert settings.to_engine_config().dtype is dtype
    assert EngineSettings.load(dtype=torch.half).dtype == "float16"  # an alias is the same torch.dtype


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_unsupported_torch_dtype_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    assert_names(
        error, f"dtype={dtype}", "explicit", f"dtype={name!r} is not supported", "float32, bfloat16, float16"
    )


def test_llm_takes_a_torch_dtype(tmp_path: Path) -> None:
    from minisgl.llm import LLM

    model = make_model_folder(tmp_path / "m")
    with LLM(
        str(model), device="cpu", dtype=torch.bfloat16, use_dummy_weight=True, cpu_kv_budget_gib=0.01
    ) as llm:
        assert llm.settings.dtype == "bfloat16" and llm.engine.dtype == torch.bfloat16


# -- errors ----------------------------------------------------------------------------------------


def assert_names(error: pytest.ExceptionInfo[BaseException], *parts: str) -> None:
    for part in parts:
        assert part in str(error.value), f"{part!r} not in {str(error.value)!r}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("page_size", 0),
        ("page_size", 257),
        ("page_size", "abc"),
        ("max_running_req", 0),
        ("tp_size", 0),
        ("memory_ratio", 0),
        ("memory_ratio", 1.5),
        ("attention_backend", "flash"),
        ("attention_backend", "fa,flash"),
        ("dtype", "float64"),
        ("moe_backend", "magic"),
        ("device", "tpu"),
        ("cuda_graph_bs", [1, 0]),
        ("cuda_graph_max_bs", -1),
        ("distributed_timeout", 0),
        ("cpu_kv_budget_gib", 0),
        ("use_dummy_weight", "maybe"),
        ("max_prefill_tokens", 0),
        ("overlap_scheduling", "maybe"),
    ],
)
def test_invalid_value_names_key_value_and_origin(
    key: str, value: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(**{key: value})
    assert_names(error, key, repr(value), "explicit")

    config = write_yaml(tmp_path / "s.yaml", {key: value})
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(config)
    assert_names(error, key, repr(value), f"yaml {config}")

    env_value = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    monkeypatch.setenv(EngineSettings.env_var(key), env_value)
    with pytest.raises(SettingsError) as error:
        EngineSettings.load()
    assert_names(error, key, repr(env_value), f"env MINISGL_{key.upper()}")


def test_unknown_yaml_key(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "s.yaml", {"pagesize": 32})
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(config)
    assert_names(error, "pagesize=32", f"yaml {config}", "unknown setting", "page_size")


def test_unknown_explicit_key() -> None:
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(max_running_requests=4)
    assert_names(error, "max_running_requests=4", "explicit", "max_running_req")


def test_unknown_minisgl_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_PAGESIZE", "32")
    with pytest.raises(SettingsError) as error:
        EngineSettings.load()
    assert_names(
        error, "MINISGL_PAGESIZE", "'32'", "MINISGL_PAGE_SIZE", "MINISGL_MEMORY_RATIO", "MINISGL_CONFIG"
    )


def test_several_errors_are_reported_together() -> None:
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(page_size=0, dtype="int8")
    assert_names(error, "2 invalid", "page_size=0", "dtype='int8'")


def test_missing_yaml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError) as error:
        EngineSettings.load(missing)
    assert_names(error, str(missing))
    monkeypatch.setenv("MINISGL_CONFIG", str(missing))
    with pytest.raises(FileNotFoundError) as error:
        EngineSettings.load()
    assert_names(error, str(missing), "MINISGL_CONFIG")


@pytest.mark.parametrize("text", ["- page_size\n- 16\n", "just a string\n", "42\n"])
def test_yaml_top_level_must_be_a_mapping(text: str, tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "s.yaml", text)
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(config)
    assert_names(error, str(config), "mapping")


def test_invalid_yaml_syntax(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "s.yaml", "page_size: [16\n")
    with pytest.raises(SettingsError) as error:
        EngineSettings.load(config)
    assert_names(error, str(config), "not valid YAML")


def test_yaml_is_read_safely(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "s.yaml", "model_path: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(SettingsError):
        EngineSettings.load(config)


def test_empty_yaml_sets_nothing(tmp_path: Path) -> None:
    settings = EngineSettings.load(write_yaml(tmp_path / "s.yaml", "# nothing\n"))
    assert set(settings.sources().values()) == {"default"}


# -- to_yaml ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_sources", [False, True])
def test_to_yaml_round_trips(with_sources: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CUDA_GRAPH_BS", "1,2,4")
    config = write_yaml(tmp_path / "s.yaml", {"memory_ratio": 0.5, "dtype": "bfloat16"})
    settings = EngineSettings.load(
        config, page_size=32, attention_backend="fa,fi", cpu_kv_budget_gib=1.5, distributed_addr="tcp://h:1"
    )
    text = settings.to_yaml(with_sources=with_sources)
    monkeypatch.delenv("MINISGL_CUDA_GRAPH_BS")

    reloaded = EngineSettings.load(write_yaml(tmp_path / "out.yaml", text))

    assert reloaded.model_dump() == settings.model_dump()
    if with_sources:
        assert "cuda_graph_bs: [1, 2, 4]  # env MINISGL_CUDA_GRAPH_BS" in text
        assert f"memory_ratio: 0.5  # yaml {config}" in text


def test_to_yaml_writes_one_line_per_setting_with_its_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_PAGE_SIZE", "32")
    settings = EngineSettings.load(dtype="float32")
    lines = settings.to_yaml(with_sources=True).splitlines()
    assert len(lines) == len(EngineSettings.model_fields)
    assert "page_size: 32  # env MINISGL_PAGE_SIZE" in lines
    assert "dtype: float32  # explicit" in lines
    assert "memory_ratio: 0.9  # default" in lines
    assert yaml.safe_load(settings.to_yaml()) == settings.model_dump(mode="json")


# -- EngineConfig ----------------------------------------------------------------------------------


def test_h200_preset_builds_engine_config() -> None:
    settings = EngineSettings.load(H200_PRESET, device="cpu")  # the preset says cuda; CI has none
    config = settings.to_engine_config()
    assert Path(config.model_path) == (CONFIGS / "models" / "qwen3-0.6b").resolve()
    assert config.model_config.num_layers == 28
    assert config.use_dummy_weight is True
    assert config.dtype == torch.bfloat16
    assert (config.page_size, config.max_running_req, config.cuda_graph_max_bs) == (256, 256, 256)
    assert config.memory_ratio == 0.9 and config.attention_backend == "auto"
    assert config.tp_info == DistributedInfo(0, 1)
    assert settings.sources()["device"] == "explicit"
    assert settings.sources()["page_size"] == f"yaml {H200_PRESET}"


def test_cpu_preset_loads(fake_default_model: Path) -> None:
    settings = EngineSettings.load(CPU_PRESET)
    assert (settings.device, settings.dtype, settings.attention_backend) == ("cpu", "float32", "torch")
    config = settings.to_engine_config()
    assert config.model_path == str(fake_default_model)
    assert config.torch_device == torch.device("cpu") and config.torch_dtype == torch.float32


@pytest.mark.parametrize("model_path", [None, "smollm2-135m"])
def test_default_model_resolution(model_path: str | None, fake_default_model: Path) -> None:
    config = EngineSettings.load(model_path=model_path, device="cpu").to_engine_config()
    assert config.model_path == str(fake_default_model)
    assert config.model_config.num_layers == 2


def test_to_engine_config_converts_types(tmp_path: Path) -> None:
    model = str(make_model_folder(tmp_path / "m"))
    settings = EngineSettings.load(
        model_path=model,
        device="cpu",
        dtype="float16",
        tp_size=2,
        cuda_graph_bs=[1, 2, 8],
        max_seq_len_override=64,
    )
    config = settings.to_engine_config(rank=1)
    assert config.tp_info == DistributedInfo(rank=1, size=2)
    assert config.dtype == torch.float16
    assert config.cuda_graph_bs == (1, 2, 8)
    assert config.configured_max_seq_len == 64
    with pytest.raises(ValueError, match="rank"):
        settings.to_engine_config(rank=2)


def test_engine_config_errors_name_the_origin(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "s.yaml", {"model_path": str(tmp_path / "missing")})
    with pytest.raises(FileNotFoundError) as error:
        EngineSettings.load(config, device="cpu").to_engine_config()
    assert_names(error, "model_path=", f"model_path from yaml {config}")


# -- model configs ---------------------------------------------------------------------------------

MODEL_FACTS = {
    # folder: (architecture, layers, hidden, heads, kv heads, head_dim, vocab, tied, eos)
    "qwen3-0.6b": ("Qwen3ForCausalLM", 28, 1024, 16, 8, 128, 151936, True, (151645,)),
    "llama-3.2-1b": ("LlamaForCausalLM", 16, 2048, 32, 8, 64, 128256, True, (128001, 128008, 128009)),
    "qwen3-8b": ("Qwen3ForCausalLM", 36, 4096, 32, 8, 128, 151936, False, (151645,)),
    "mistral-7b-v0.1": ("MistralForCausalLM", 32, 4096, 32, 8, 128, 32000, False, (2,)),
    "mistral-7b-v0.3": ("MistralForCausalLM", 32, 4096, 32, 8, 128, 32768, False, (2,)),
}


@pytest.mark.parametrize("name", sorted(MODEL_FACTS))
def test_model_config_json_parses(name: str) -> None:
    folder = CONFIGS / "models" / name
    arch, layers, hidden, heads, kv_heads, head_dim, vocab, tied, eos = MODEL_FACTS[name]
    config = ModelConfig.from_path(folder)
    assert (config.architecture, config.num_layers, config.hidden_size) == (arch, layers, hidden)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, kv_heads, head_dim)
    assert (config.vocab_size, config.tie_word_embeddings, config.eos_token_ids) == (vocab, tied, eos)
    assert config.torch_dtype == "bfloat16"

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    assert hf.architectures == [arch]
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads) == (layers, hidden, heads)
    assert (hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (kv_heads, head_dim, vocab)
    assert hf.tie_word_embeddings is tied


def test_llama_3_2_rope_scaling() -> None:
    rope = ModelConfig.from_path(CONFIGS / "models" / "llama-3.2-1b").rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 32.0)
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (
        1.0,
        4.0,
        8192,
    )


# -- docs/settings.md ------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_docs_settings_table_is_generated_from_the_fields() -> None:
    expected = settings_markdown()
    assert DOCS.is_file() and DOCS.read_text() == expected, (
        "docs/settings.md is out of date: run `python -m minisgl.settings --markdown > docs/settings.md`"
    )
    for name, field in EngineSettings.model_fields.items():
        assert f"| `{name}` | `MINISGL_{name.upper()}` |" in expected and field.description in expected


@pytest.mark.parametrize("preset", sorted(CONFIGS.glob("*.yaml")), ids=lambda path: path.name)
def test_every_preset_loads_and_builds_its_configs(preset: Path) -> None:
    settings = EngineSettings.load(preset, device="cpu", dtype="float32")  # the GPU presets, here too
    assert Path(settings.resolved_model_path(), "config.json").is_file()
    engine_config = settings.to_engine_config(rank=0)
    assert settings.to_scheduler_config().cache_type in ("radix", "naive")
    if preset.name == "h200-qwen3-0.6b-prefix.yaml":  # the prefix-heavy preset: finer pages, radix
        assert engine_config.page_size == 64 and settings.cache_type == "radix"
