"""The package's rooms and the rule between them, read from the source: each module imports only
its own room and the rooms below it, and the light commands load no torch.

    errors, files, logs  <-  config/  <-  data/  <-  cluster/  <-  plan/  <-  training/  <-  export, generate, preflight, plot  <-  cli, cli_values, main

and inside training/, wings by job (WINGS) and floors (TRAINING_FLOORS).
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
    {"plan"},
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


# training/ in wings by job, in this order: the model (model/), the ranks and how each builds its part
# (distributed/), checkpoints (checkpoint/), and the loop's own modules at the top of training/. A wing
# imports its own modules, the wings before it, and the loop's ground floor: leaves that import nothing
# of training (the faults, the LR schedule, metrics, the run dir, the watchdog, evaluation).
WINGS = ["model", "distributed", "checkpoint", "loop"]

# Inside training/, floors: a module imports only the training modules on floors below its own. Who
# the ranks are rests on ds_internals alone; checkpoint.store (the format, saving) sits below resume
# (which one, whether, loading) and universal (the conversion); the loop above everything it drives.
TRAINING_FLOORS = [
    {
        "distributed.ds_internals",
        "faults",
        "model.gpt",
        "schedule",
        "metrics",
        "rundir",
        "watchdog",
        "evaluate",
        "checkpoint.files",
    },
    {"distributed.ranks", "model.init_from", "distributed.tensor_parallel"},
    {"checkpoint.store", "guards", "distributed.pipeline"},
    {"distributed.engine", "checkpoint.resume"},
    {"run", "checkpoint.universal"},
    {"loop"},
    {"entry"},
]


def training_name(module: str) -> str | None:
    """`pretrain.training.model.gpt` -> 'model.gpt'; None for training/ and its wings' packages."""
    name = module.removeprefix("pretrain.training.")
    return None if module == "pretrain.training" or name in WINGS else name


def training_floor(module: str) -> int:
    name = training_name(module)
    return next(i for i, floor in enumerate(TRAINING_FLOORS) if name in floor)


def wing(module: str) -> int:
    name = training_name(module) or ""
    return WINGS.index(name.split(".")[0]) if "." in name else WINGS.index("loop")


def training_modules(g: dict[str, set[str]]) -> list[str]:
    return [m for m in g if room(m) == "training" and training_name(m) is not None]


def test_every_training_module_has_a_floor():
    for module in training_modules(graph()):
        assert any(training_name(module) in floor for floor in TRAINING_FLOORS), f"{module}: on no floor"


def test_training_imports_only_floors_below():
    g = graph()
    wrong = [
        f"{module} (floor {training_floor(module)}) imports {dep} (floor {training_floor(dep)})"
        for module in training_modules(g)
        for dep in sorted(g[module])
        if room(dep) == "training"
        and training_name(dep) is not None
        and training_floor(dep) >= training_floor(module)
    ]
    assert wrong == []


def test_training_wings_import_only_wings_before_and_the_ground_floor():
    g, ground = graph(), TRAINING_FLOORS[0]
    wrong = [
        f"{module} ({WINGS[wing(module)]}) imports {dep} ({WINGS[wing(dep)]})"
        for module in training_modules(g)
        for dep in sorted(g[module])
        if room(dep) == "training"
        and training_name(dep) is not None
        and wing(dep) > wing(module)
        and training_name(dep) not in ground
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
