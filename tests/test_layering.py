"""The import graph of `raylm/`, read from the source with `ast`: no import
circle between raylm modules, and every import points down the layers of
docs/architecture.md ("The import rule").

Every import statement counts, wherever it is written (module level, inside a
function, under `if TYPE_CHECKING:`): a function-level import only hides a
circle until the function runs. The implicit import of a package's
`__init__` when one of its submodules is imported is not counted, since every
module would then reach `raylm/__init__.py`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raylm"

# The layers, highest first. A module may import modules of its own layer and
# of any layer below it, never of one above. A layer is named by packages
# (the package and everything under it) or by single top-level modules;
# the bare package `raylm` means `raylm/__init__.py` only.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Test support (tiny models, the Hugging Face oracle): may use anything;
    # the engine never imports it.
    ("testing", ("raylm.testing",)),
    ("entrypoints", ("raylm.entrypoints", "raylm.ray_serve", "raylm.ray_serve_pd")),
    # `from raylm import LLM, SamplingParams`: the offline facade that the CLI
    # and the server import too.
    ("facade", ("raylm",)),
    ("engine", ("raylm.engine",)),
    ("core", ("raylm.core",)),
    ("executor", ("raylm.executor",)),
    ("worker", ("raylm.worker",)),
    # K/V movement between engines (live migration's stages; prefix pulls and
    # P/D hand-offs to come): the transport interface the engine talks to,
    # and the ranks' side of each transfer kind (files in shared memory, the
    # sealed network), the copies beside the steps and their CPU budget.
    ("kv_transfer", ("raylm.kv_transfer",)),
    # LoRA adapters (issue 53): the PEFT-format loader, the front end's
    # registry of checked adapters, the workers' slots on the model's linear
    # layers. Above config (it reads LoRAConfig) and model (it fills the
    # layers' `lora` hook); its request handle is a plain value (below).
    ("lora", ("raylm.lora",)),
    # The resolved settings: read by every layer above; built from what model/
    # reads in a model folder (architecture, generation defaults, hub).
    ("config", ("raylm.config",)),
    # The model code uses the TP/PP groups and collectives of distributed/
    # (parallel linear layers all-reduce through them); distributed/ knows
    # nothing of models. DESIGN's drawing lists distributed/ above model/, but
    # both sit below worker/ and this is the direction the code has (and
    # vLLM's model_executor -> distributed).
    ("model", ("raylm.model",)),
    ("distributed", ("raylm.distributed",)),
    # Plain values that cross layers: wire messages and sampling settings,
    # user-facing outputs, the chat-template sandbox (chat_template, the way in;
    # its bounds, its measures and its Jinja environment beside it), CPU-core arithmetic; and
    # the start-up heap's freeze, which every serving process calls; client
    # text escaped for the logs; what Linux says of a process's threads (CPU
    # time, names, run-queue wait), read by the placement's governance and the
    # K/V copies' CPU budget.
    (
        "values",
        (
            "raylm.messages",
            "raylm.sampling_params",
            "raylm.outputs",
            "raylm.chat_template",
            "raylm.chat_template_budget",
            "raylm.chat_template_prediction",
            "raylm.chat_template_sandbox",
            "raylm.cpu_bind",
            "raylm.startup_heap",
            "raylm.log_text",
            "raylm.thread_accounting",
            # `LoRARequest`, carried by the request on every layer's message.
            "raylm.lora.request",
        ),
    ),
]

# Import circles that exist today and are being taken apart (issue 21, item
# 4). Each is one elementary cycle, written from its alphabetically first
# module. This set MUST END EMPTY: the test fails on any circle not listed here,
# and on a listed one that no longer exists (then delete its line).
KNOWN_CYCLES_BEING_REMOVED: set[str] = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of raylm/."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The raylm module that defines `name` (a module, or a name inside one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The raylm modules that `module` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(_owner(alias.name, modules) for alias in node.names if alias.name.split(".")[0] == "raylm")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "raylm":
                continue
            for alias in node.names:
                # `from pkg import submodule` imports the submodule.
                candidate = f"{source}.{alias.name}"
                targets.add(candidate if candidate in modules else _owner(source, modules))
    targets.discard(None)
    targets.discard(module)
    return targets  # type: ignore[return-value]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imported(module, path, modules) for module, path in modules.items()}


def elementary_cycles(graph: dict[str, set[str]]) -> set[str]:
    """Every simple cycle, as 'a -> b -> a' starting at its smallest module
    (each cycle found once: from its smallest node, through larger ones)."""
    found: set[str] = set()

    def walk(start: str, path: list[str]) -> None:
        for target in sorted(graph.get(path[-1], ())):
            if target == start:
                found.add(" -> ".join([*path, start]))
            elif target > start and target not in path:
                walk(start, [*path, target])

    for start in sorted(graph):
        walk(start, [start])
    return found


def layer_of(module: str) -> int | None:
    """Index into LAYERS (0 = top) of the longest name that covers `module`."""
    best, best_len = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "raylm" and module.startswith(name + "."))
            if covers and len(name) > best_len:
                best, best_len = index, len(name)
    return best


def test_the_parser_reads_imports_wherever_they_are_written(tmp_path):
    # The circles this test exists for hide in function bodies; a parser that
    # only read module-level imports would pass vacuously.
    source = tmp_path / "mod.py"
    source.write_text(
        "import raylm.config\n"
        "def f():\n"
        "    from raylm.model import registry\n"
        "    from raylm.engine.llm import LLM\n"
        "    from .. import outputs\n"
    )
    names = ["raylm", "raylm.config", "raylm.model", "raylm.model.registry", "raylm.engine.llm", "raylm.outputs"]
    modules = dict.fromkeys([*names, "raylm.core.mod"], source)
    expected = {"raylm.config", "raylm.model.registry", "raylm.engine.llm", "raylm.outputs"}
    assert _imported("raylm.core.mod", source, modules) == expected


def test_cycles_are_found_once_each():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "d": {"a"}}
    assert elementary_cycles(graph) == {"a -> b -> a", "a -> b -> c -> a"}


def test_no_import_circle():
    cycles = elementary_cycles(import_graph())
    new = sorted(cycles - KNOWN_CYCLES_BEING_REMOVED)
    gone = sorted(KNOWN_CYCLES_BEING_REMOVED - cycles)
    problems = []
    if new:
        problems.append("new import circles (break them; do not list them):\n  " + "\n  ".join(new))
    if gone:
        problems.append(
            "circles listed in KNOWN_CYCLES_BEING_REMOVED no longer exist; delete their lines:\n  " + "\n  ".join(gone)
        )
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, f"modules outside every layer of LAYERS (place them in the table): {unplaced}"


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in sorted(import_graph().items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs < mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not upward, "imports that point up the layers:\n  " + "\n  ".join(upward)
