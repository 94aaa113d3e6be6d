"""`python -m perf.gpu.lora --shape cpu`, the dry run of LoRA's GPU benchmark: a tiny Qwen3 with dummy
weights and two random adapters on the CPU, every figure of the report there and the adapters' rows run
under their adapters."""

from __future__ import annotations

import json

from perf.gpu import lora


def test_the_cpu_dry_run_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "lora.json"
    results = lora.main(["--shape", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert (results["shape"], results["adapters"], results["rank"]) == ("cpu", 2, 16)
    assert results["max_lora_rank"] == 64
    assert list(results["batches"]) == ["1", "2"]
    for batch, rows in results["batches"].items():
        for name in ("no_slots", "slots_base", "mixed"):
            assert rows[name]["wall_ms"] > 0
            assert rows[name]["device_ms"] is None  # recorded on CUDA only
        for name in ("slots_base", "mixed"):
            assert rows[name]["ratio"] == rows[name]["wall_ms"] / rows["no_slots"]["wall_ms"]
        # base requests give the same tokens with and without slots; every adapter row gives others
        assert rows["base_same_tokens"] is True
        assert rows["rows_changed"] == int(batch)
        assert rows["resident"] == min(int(batch), 2)
    load = results["load_ms"]
    assert len(load["runs"]) == 2 and all(ms > 0 for ms in load["runs"])
    assert load["median"] == sum(load["runs"]) / 2
    printed = capsys.readouterr().out.split("--- LoRA (cpu;")[1]
    lines = printed.splitlines()
    assert lines[2].split()[:4] == ["batch", "no_slots", "slots_base", "mixed"]
    assert [line.split()[0] for line in lines[3:5]] == ["1", "2"]
    assert "goal <= 1.031x" in lines[3] and "goal <= 1.1x" in lines[3]
    assert lines[5].startswith("adapter load (LLM.load_lora, rank 16): median ")


def test_adapters_are_written_as_peft_folders(tmp_path):
    from safetensors import safe_open

    config = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}
    config |= {"intermediate_size": 12, "num_hidden_layers": 2}
    folder = lora.write_adapter(tmp_path / "a", config, rank=3, seed=0, dtype=lora.torch.float32)
    adapter_config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 3 and len(adapter_config["target_modules"]) == 7
    with safe_open(f"{folder}/adapter_model.safetensors", "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    prefix = "base_model.model.model.layers.1"
    assert len(shapes) == 2 * 7 * 2
    assert shapes[f"{prefix}.self_attn.k_proj.lora_A.weight"] == (3, 8)
    assert shapes[f"{prefix}.self_attn.k_proj.lora_B.weight"] == (4, 3)
    assert shapes[f"{prefix}.mlp.down_proj.lora_A.weight"] == (3, 12)
    assert shapes[f"{prefix}.mlp.up_proj.lora_B.weight"] == (12, 3)


def test_the_kernels_dry_run_times_every_variant_against_the_reference(tmp_path, capsys):
    """`--kernels`: the four packed projections of the tiny Qwen3 at one row, every expand block with and
    without the slots' ranks (Triton's interpreter on the CPU), each equal to the torch reference."""
    out = tmp_path / "kernels.json"
    results = lora.main(["--shape", "cpu", "--kernels", "--batch", "1", "--out", str(out)])
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels == json.loads(json.dumps(results["kernels"])) and kernels["layers"] == 3
    assert list(kernels["projections"]) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    variants = [f"{block}{ranked}" for block in lora.KERNEL_BLOCKS for ranked in ("", "r")]
    for by_rows in kernels["projections"].values():
        assert list(by_rows) == ["1"] and list(by_rows["1"]) == variants
        for figures in by_rows["1"].values():
            assert figures["us"] > 0 and figures["error"] < 1e-5  # float32
    lines = capsys.readouterr().out.split("--- LoRA (cpu;")[1].splitlines()
    assert lines[1].split() == ["projection", "rows", *variants, "max", "error"]
    assert [line.split()[0] for line in lines[2:7]] == [
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        "all,",
    ]
