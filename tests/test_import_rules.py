"""Import layering, read from the source (ast): the runtime never sees the manager; the runtime's
leaf modules (block bookkeeping) and the manager's bookkeeping modules stay free of torch, numpy and
the rest of the runtime; CuPy is only ever imported lazily."""
from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("batch_manager", "runtime", "cuda_src", "samples")

RUNTIME_USERS = {"batch_manager.model_executor", "batch_manager.scheduling.kv_sizing", "batch_manager.legacy.gpt_manager",
                 "batch_manager.legacy.admission", "batch_manager.request_decoder", "batch_manager.engine_builder",
                 "batch_manager.executor.conversion", "batch_manager.guided_decoding", "batch_manager.adapters.lora",
                 "batch_manager.distributed", "batch_manager.executor.request", "batch_manager.doors.tensor_checks"}
# The front doors: each imports the shared pieces (batch_manager.doors, the worker, the scheduler), never
# another door, and nothing of the manager imports a door but the package's public re-exports.
DOORS = ("batch_manager.legacy", "batch_manager.executor")
# Pure-Python runtime modules that batch_manager's pure modules may import (block bookkeeping).
RUNTIME_LEAVES = {"runtime.cache.kv_cache_manager", "runtime.cache.beam_blocks", "runtime.request", "runtime.parallel.world_config"}
PURE_MODULES = {"batch_manager.scheduling.scheduler", "batch_manager.scheduling.llm_request", "batch_manager.stats",
                "batch_manager.options", "batch_manager.legacy.tensor_names", "batch_manager.scheduling.capacity_scheduler",
                "batch_manager.scheduling.micro_batch_scheduler", "batch_manager.scheduling.step", "batch_manager.legacy.callbacks",
                "batch_manager.adapters.peft_cache", "batch_manager.kv_transport.kv_handoff", "batch_manager.doors.front_end"}
HEAVY = ("torch", "numpy")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = all_modules()


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def runtime_import_nodes(tree: ast.AST):
    """Every import statement of `tree` at any depth (lazy ones too) but those under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if is_type_checking_block(node):
            continue   # annotations only: never imported when the program runs
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def imports(module: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of everything `module` imports (for `from x import y`, both x and x.y)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if is_type_checking_block(node):
            return   # annotations only: never imported when the program runs
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(module, path.name == "__init__.py", node)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def touches(names: set[str], top: str) -> bool:
    return any(name == top or name.startswith(top + ".") for name in names)


def non_leaf_runtime(names: set[str]) -> set[str]:
    """The names in `names` that reach into the runtime beyond its leaf modules."""
    return {name for name in names if touches({name}, "runtime")
            and not any(touches({name}, leaf) for leaf in RUNTIME_LEAVES)}


def project_closure(module: str) -> set[str]:
    """Everything `module` imports, following the project's own modules (not parent __init__s)."""
    seen, todo, names = {module}, [module], set()
    while todo:
        direct = imports(todo.pop())
        names |= direct
        for name in direct:
            if name in MODULES and name not in seen:
                seen.add(name)
                todo.append(name)
    return names


def test_the_walk_finds_the_modules_and_their_imports():
    assert RUNTIME_USERS | PURE_MODULES | RUNTIME_LEAVES <= set(MODULES)
    assert "runtime.kernels" in MODULES
    assert touches(imports("batch_manager.engine_builder"), "runtime")
    assert "runtime.cache.kv_cache_manager" in imports("batch_manager.scheduling.scheduler")
    assert "runtime.cache.kv_cache_manager" in imports("runtime.cache.beam_blocks")
    assert non_leaf_runtime({"runtime", "runtime.cache.kv_cache_manager.RELEASED", "runtime.session"}) == {
        "runtime", "runtime.session"}


def test_runtime_never_imports_batch_manager():
    offenders = [m for m in MODULES if m.split(".")[0] == "runtime" and touches(imports(m), "batch_manager")]
    assert offenders == []


def test_only_the_executor_sizing_and_facade_import_runtime_beyond_its_leaves():
    users = {m for m in MODULES if m.split(".")[0] == "batch_manager" and non_leaf_runtime(imports(m))}
    assert users <= RUNTIME_USERS


@pytest.mark.parametrize("module", sorted(PURE_MODULES | RUNTIME_LEAVES))
def test_bookkeeping_modules_import_no_torch_numpy_or_runtime_beyond_its_leaves(module):
    names = project_closure(module)
    assert [top for top in HEAVY if touches(names, top)] == []
    assert non_leaf_runtime(names) == set()


def test_no_arrow_runs_up_into_a_front_door():
    """The worker, the scheduler and the doors' shared pieces (batch_manager.doors) serve every door:
    importing one door from them (or one door from another) ties the others to it."""
    offenders = {(m, door) for m in MODULES if m.split(".")[0] == "batch_manager" and m != "batch_manager"
                 for door in DOORS if not touches({m}, door) and touches(imports(m), door)}
    assert offenders == set()


def test_the_shared_door_pieces_are_where_the_doors_import_them():
    assert "batch_manager.doors.front_end" in imports("batch_manager.worker")
    assert "batch_manager.doors.front_end" in imports("batch_manager.executor.front_end")
    assert "batch_manager.doors.rendering" in imports("batch_manager.legacy.responses")


def module_dependencies(module: str) -> set[str]:
    """The project modules `module` imports when it runs, at any depth of its code (lazy imports
    too; not those under TYPE_CHECKING): for `from pkg import name`, pkg.name where that is a
    module, else pkg."""
    path = MODULES[module]
    found = set()
    for node in runtime_import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(module, path.name == "__init__.py", node)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    modules = set()
    for name in found:
        parts = name.split(".")
        owner = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in MODULES), None)
        if owner is not None and owner != module:
            modules.add(owner)
    return modules


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> the modules it imports), first module repeated last; None: none.
    NOTE: static_order() is a generator: only consuming it runs the check."""
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_the_cycle_check_sees_a_two_module_cycle():
    assert import_cycle({"a": {"b"}, "b": {"a"}, "c": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles_in_the_packages():
    """Not even through a lazy import: a cycle means two modules that should be one, or a third
    one missing (the engine's KV sizing, the model registry's config parsing and the weight-format
    registry's ConfigError had them)."""
    graph = {m: module_dependencies(m) for m in MODULES if m.split(".")[0] in ("runtime", "batch_manager")}
    assert import_cycle(graph) is None


def test_the_runtime_root_holds_at_most_a_dozen_modules():
    root = sorted(p.name for p in (REPO / "runtime").glob("*.py"))
    assert len(root) <= 12, root


def test_the_batch_manager_root_holds_at_most_fifteen_modules():
    """Its folders by responsibility (scheduling, adapters, KV transport and events, the legacy
    door, the Executor) keep its root small."""
    root = sorted(p.name for p in (REPO / "batch_manager").glob("*.py"))
    assert len(root) <= 15, root


def test_the_kernels_root_holds_the_interface_and_three_folders():
    """runtime/kernels/ keeps the backend choice, the interface and what every backend shares at its
    root; the native CPU layer (cpu/), the CUDA path (cuda/) and the torch backend with its
    references (torch_kernels/) each live in their own folder."""
    kernels = REPO / "runtime" / "kernels"
    root = sorted(p.name for p in kernels.iterdir() if p.is_file())
    assert len(root) <= 4, root
    folders = sorted(p.name for p in kernels.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["cpu", "cuda", "torch_kernels"], folders


def test_no_module_imports_cupy_at_top_level():
    offenders = [m for m in MODULES if touches(imports(m, top_level_only=True), "cupy")]
    assert offenders == []


def test_importing_the_packages_does_not_import_cupy(tmp_path):
    (tmp_path / "cupy").mkdir()                     # an importable stand-in, so the check bites
    (tmp_path / "cupy" / "__init__.py").write_text("")     # even where CuPy is not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    code = "import sys, batch_manager, runtime; print(sorted(m for m in sys.modules if m.split('.')[0] == 'cupy'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_batch_manager_never_names_the_runners_kv_pools():
    """The KV pools are the runner's block storage: the manager moves blocks through
    ModelRunner.read_blocks / write_blocks only (an import walk cannot see attribute reaches)."""
    offenders = [m for m, path in MODULES.items() if m.split(".")[0] == "batch_manager"
                 and any(name in path.read_text() for name in ("kv_pool", "kv_scales"))]
    assert offenders == []
