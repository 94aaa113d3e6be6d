"""The import layers of minisgl: every import points down, and no modules import each other in a circle.

Bottom to top (a module may import from its own layer and the layers below it, never from above):

    entry        cli, __main__ (`python -m minisgl`)
    server       server (the HTTP server: OpenAI and SGLang APIs, guards, scheduler processes, replicas)
    bench        bench (the benchmarks: offline on an LLM in this process; serving, a client of a server)
    llm          llm (the LLM front end: tokenizer, scheduler, TP ranks)
    launch       launch (tensor-parallel ranks as processes; later the server's processes)
    settings     settings (YAML, MINISGL_*, --key and LLM(key=...) -> the engine's config)
    scheduler    scheduler
    engine       engine (Engine, its config, batching, sampler, CUDA graphs)
    lora         lora (PEFT adapters read and sharded, the device slot pool)
    models       models
    ops          attention, moe (the backends behind the layers' custom ops)
    layers       layers (pure functions: norms, projections, RoPE, the attention op)
    kvcache      kvcache
    kernels      kernels (Triton)
    distributed  distributed (rank info, process groups, collectives, head sharding)
    base         minisgl, core (data), compile (compiler policy), config_fields (setting declarations), metrics

Every import counts: at module level, under TYPE_CHECKING and inside functions. A new module must be
given a layer in LAYERS below.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "minisgl"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# bottom to top: (layer, the modules and packages in it)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "minisgl",
            "minisgl.core",
            "minisgl.compile",
            "minisgl.config_fields",
            "minisgl.embeddings",  # imports nothing from minisgl (pooling names, vector encodings)
            "minisgl.metrics",
            "minisgl.templates",
            "minisgl.harmony",  # gpt-oss's chat format in a reply (imports nothing from minisgl)
        ),
    ),
    ("distributed", ("minisgl.distributed",)),
    ("kernels", ("minisgl.kernels",)),
    ("kvcache", ("minisgl.kvcache",)),
    ("layers", ("minisgl.layers",)),
    ("ops", ("minisgl.attention", "minisgl.moe")),
    ("models", ("minisgl.models",)),
    ("multimodal", ("minisgl.multimodal",)),  # image inputs: media, preprocessing, prompts with images
    ("lora", ("minisgl.lora",)),
    ("engine", ("minisgl.engine",)),
    ("scheduler", ("minisgl.scheduler",)),
    ("settings", ("minisgl.settings",)),
    ("launch", ("minisgl.launch",)),
    ("llm", ("minisgl.llm",)),
    ("chat", ("minisgl.chat",)),
    ("bench", ("minisgl.bench",)),
    ("server", ("minisgl.server",)),
    ("entry", ("minisgl.cli", "minisgl.__main__")),
]


@dataclass(frozen=True)
class Import:
    """`source` imports `target` (both minisgl modules) at line `line` of `file`."""

    source: str
    target: str
    file: Path  # relative to the folder that holds the package
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (a package's name for its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` lands in: itself, or its longest known parent (a name imported from a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool) -> list[str]:
    """Every dotted name one import statement may load (relative imports resolved against `source`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = source.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def imports_of(source: str, path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Import]:
    """The minisgl modules that `source` (at `path` in the package at `root`) imports anywhere in its
    file, one entry per statement and target."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    file = path.relative_to(root.parent)
    found: dict[tuple[str, int], Import] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets = _targets(node, source, path.name == "__init__.py")
        if isinstance(node, ast.ImportFrom):  # `from pkg import name`: the submodule if it is one, else pkg
            named = [t for t in targets[:-1] if t in modules]
            targets = named if len(named) == len(targets) - 1 else [*named, targets[-1]]
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            known = _known(target, modules)
            if known is not None and known != source:
                found.setdefault((known, node.lineno), Import(source, known, file, node.lineno))
    return list(found.values())


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """Index in `layers` of the longest entry that is `module` or a package holding it (the top-level
    package only holds itself)."""
    best, best_len = None, -1
    for index, (_, members) in enumerate(layers):
        for member in members:
            inside = module == member or (member != PACKAGE and module.startswith(member + "."))
            if inside and len(member) > best_len:
                best, best_len = index, len(member)
    return best


def upward_imports(imports: list[Import], layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """One line per import from a lower layer into a higher one."""
    bad = []
    for imp in imports:
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            bad.append(f"{imp} (layer {layers[high][0]!r}) from layer {layers[low][0]!r}")
    return bad


def import_cycles(imports: list[Import]) -> list[list[Import]]:
    """One cycle (its chain of imports) through every group of modules that import each other."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        graph.setdefault(imp.source, {}).setdefault(imp.target, imp)
    cycles, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        path = _path_back(graph, start)
        if path:
            cycles.append(path)
            seen.update(imp.source for imp in path)
    return cycles


def _path_back(graph: dict[str, dict[str, Import]], start: str) -> list[Import]:
    """The shortest chain of imports from `start` back to `start` (breadth first), or []."""
    parents: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target, imp in sorted(graph.get(module, {}).items()):
                if target == start:
                    chain = [imp]
                    while chain[0].source != start:
                        chain.insert(0, parents[chain[0].source])
                    return chain
                if target not in parents:
                    parents[target] = imp
                    following.append(target)
        frontier = following
    return []


@pytest.fixture(scope="module")
def all_imports() -> list[Import]:
    modules = find_modules()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def test_every_module_has_a_layer():
    missing = [name for name in find_modules() if layer_of(name) is None]
    assert not missing, f"modules without a layer (add them to LAYERS in tests/test_layers.py): {missing}"


def test_imports_point_down(all_imports):
    bad = upward_imports(all_imports)
    assert not bad, "imports from a higher layer (see tests/test_layers.py):\n" + "\n".join(bad)


def test_no_import_cycles(all_imports):
    cycles = import_cycles(all_imports)
    described = [" -> ".join(str(imp) for imp in cycle) for cycle in cycles]
    assert not cycles, "modules that import each other:\n" + "\n".join(described)


def test_the_checks_name_the_offending_import(tmp_path):
    """The checker on a fake package: an upward import under TYPE_CHECKING and a circle through a
    function-local import are both found and named."""
    pkg = tmp_path / PACKAGE
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from .a import x\n")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minisgl.high import y\nx = 1\n"
    )
    (pkg / "high.py").write_text("from minisgl.low import x\ndef f():\n    from minisgl.low.a import x\n")
    (pkg / "low" / "b.py").write_text("def g():\n    import minisgl.low.c\n")
    (pkg / "low" / "c.py").write_text("from minisgl.low import b\n")
    modules = find_modules(pkg)
    imports = [imp for name, path in modules.items() for imp in imports_of(name, path, modules, pkg)]
    layers = [("base", ("minisgl", "minisgl.low")), ("top", ("minisgl.high",))]

    high, a, b, c = (
        Path(PACKAGE, *parts) for parts in (["high.py"], ["low", "a.py"], ["low", "b.py"], ["low", "c.py"])
    )

    assert upward_imports(imports, layers) == [f"{a}:3 imports minisgl.high (layer 'top') from layer 'base'"]
    cycles = [[str(imp) for imp in cycle] for cycle in import_cycles(imports)]
    assert [f"{high}:3 imports minisgl.low.a", f"{a}:3 imports minisgl.high"] in cycles
    assert [f"{b}:2 imports minisgl.low.c", f"{c}:1 imports minisgl.low.b"] in cycles


def test_core_protocols_are_met_by_the_backends(tmp_path):
    """core declares what it holds of the layers above as protocols; the real classes meet them."""
    import torch

    from minisgl.attention import TorchAttnBackend
    from minisgl.core import AttnBackend, KVCachePool
    from minisgl.kvcache import MHAKVCachePool

    pool = MHAKVCachePool(1, 4, 2, 1, 8, torch.float32, torch.device("cpu"))
    assert isinstance(pool, KVCachePool)
    backend = TorchAttnBackend(pool, torch.zeros(2, 8, dtype=torch.int32), torch.device("cpu"))
    assert isinstance(backend, AttnBackend)
