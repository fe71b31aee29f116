"""The package's rooms and the rule between them, read from the source: each module imports only
its own room and the rooms below it, and the light commands load no torch.

    errors, files, logs  <-  config/  <-  data/  <-  cluster/  <-  training/  <-  export, generate, preflight, plot  <-  cli, cli_values, main

and inside training/, floors of their own (TRAINING_FLOORS).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pretrain"

LAYERS = [
    {"errors", "files", "logs"},
    {"config"},
    {"data"},
    {"cluster"},
    {"training"},
    {"export", "generate", "preflight", "plot"},
    {"cli", "cli_values", "main", "__main__", "__init__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)


def room(module: str) -> str:
    """`pretrain.data.loader` -> 'data'; `pretrain.cli` -> 'cli'; `pretrain` -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(module: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room(module) in rooms)


def imports(path: Path) -> set[str]:
    """Every `pretrain` module this file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pretrain":
            for alias in node.names:  # `from pretrain.training import engine` names a module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _exists(sub) else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pretrain")
    return found


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_room():
    for module in graph():
        assert any(room(module) in rooms for rooms in LAYERS), f"{module}: in no room of LAYERS"


def test_no_module_imports_upward():
    upward = [
        f"{module} (layer {layer(module)}) imports {dep} (layer {layer(dep)})"
        for module, deps in graph().items()
        for dep in sorted(deps)
        if layer(dep) > layer(module)
    ]
    assert upward == []


def test_no_import_cycle():
    g = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for dep in g.get(module, ()):
            if dep != module and not dep.startswith(module + "."):
                visit(dep, [*path, module])
        done.add(module)

    for module in g:
        visit(module, [])


# training/ on its own floors: a module imports only the training modules on floors below its own.
# The ground floor knows nothing of the others: who the ranks are (ranks.py rests on ds_internals.py
# alone), the faults, the model. checkpoint.py (the format, saving) sits below resume.py (which one,
# whether, loading) and universal.py (the conversion); the loop above everything it drives.
TRAINING_FLOORS = [
    {
        "ds_internals",
        "faults",
        "model",
        "schedule",
        "metrics",
        "rundir",
        "watchdog",
        "evaluate",
        "checkpoint_io",
    },
    {"ranks", "init_from", "tensor_parallel"},
    {"checkpoint", "guards", "pipeline"},
    {"engine", "resume"},
    {"run", "universal"},
    {"loop"},
    {"entry"},
]


def training_floor(module: str) -> int:
    name = module.split(".")[-1]
    return next(i for i, floor in enumerate(TRAINING_FLOORS) if name in floor)


def test_every_training_module_has_a_floor():
    training = [m for m in graph() if room(m) == "training" and m != "pretrain.training"]
    for module in training:
        assert any(module.split(".")[-1] in floor for floor in TRAINING_FLOORS), f"{module}: on no floor"


def test_training_imports_only_floors_below():
    wrong = [
        f"{module} (floor {training_floor(module)}) imports {dep} (floor {training_floor(dep)})"
        for module, deps in graph().items()
        if room(module) == "training" and module != "pretrain.training"
        for dep in sorted(deps)
        if room(dep) == "training"
        and dep != "pretrain.training"
        and training_floor(dep) >= training_floor(module)
    ]
    assert wrong == []


@pytest.mark.parametrize(
    "modules",
    [
        "pretrain.config.tree, pretrain.config.presets, pretrain.config.ds_render, pretrain.config.ds_read",
        "pretrain.data.prepare, pretrain.data.corpus, pretrain.data.dataset",
        "pretrain.cluster.launch, pretrain.cluster.probe, pretrain.cluster.supervise",
        "pretrain.plot",
        "pretrain.cli",
    ],
)
def test_light_modules_load_no_torch(modules):
    code = (
        f"import sys; import {modules}; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {modules} loads {out.strip()}"
