"""Import layering of megalite, read from the source with `ast` (nothing is imported).

A unit is a subpackage of megalite (megalite.mpu, megalite.schedules, ...) or a top-level
module (megalite.config, megalite.training, ...). Every import statement counts, those inside
functions included: an import deferred into a function to dodge a cycle is still a cycle.
The configuration and the parallel layers sit below the schedules, the models and the
training loop (megalite/config.py and megalite/mpu/ import none of them), and the units
import one another without a cycle.
"""
import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1] / "megalite"
LOW = ["config", "mpu"]  # below the units in HIGH
HIGH = {"megalite.schedules", "megalite.models", "megalite.training", "megalite.tasks"}
TOP = {"config", "layout", "placement", "device"}  # the modules everything reads
LEAVES = {f"megalite.{name}" for name in TOP - {"config", "layout"}}  # import no other unit
# unit -> the only units it may import
ONLY = {"megalite.config": LEAVES, "megalite.mpu": LEAVES | {"megalite.config"},
        **{leaf: set() for leaf in LEAVES}}
# unit -> units it must not import: the checkpoint format knows nothing of the loop, the
# planner's closed forms nothing of the loop they describe, the loop nothing of the tasks on it
NOT = {"megalite.checkpoint": {"megalite.training", "megalite.tasks", "megalite.planning"},
       "megalite.planning": {"megalite.training", "megalite.tasks"},
       "megalite.training": {"megalite.tasks"}}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    """megalite.X of a megalite module (None outside megalite and for the package itself)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "megalite" and len(parts) > 1 else None


def _imported(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> list[str]:
    """Absolute names of what `node` imports (for `from a import b`: a.b, which is a module
    when b is one, and otherwise resolves to the unit of a anyway)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[:len(module.split(".")) - node.level + package]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def imports(path: Path) -> set[str]:
    """Absolute names imported anywhere in the file at `path`."""
    module, package = _module(path), path.name == "__init__.py"
    return {name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in _imported(node, module, package)}


def unit_graph() -> dict[str, set[str]]:
    """megalite unit -> the other megalite units its modules import."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(_module(path))
        if unit is None:
            continue
        targets = {_unit(name) for name in imports(path)}
        graph.setdefault(unit, set()).update(t for t in targets if t and t != unit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, then "done"

    def visit(path: list[str]) -> list[str] | None:
        state[path[-1]] = "open"
        for nxt in sorted(graph.get(path[-1], ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(path + [nxt])):
                return cycle
        state[path[-1]] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit([start])):
            return cycle
    return None


def unit_files(name: str) -> list[Path]:
    """The files of megalite unit `name` ("config", "mpu"): a module or a package."""
    module = ROOT / f"{name}.py"
    return [module] if module.exists() else sorted((ROOT / name).rglob("*.py"))


def test_config_and_mpu_import_no_schedules_models_or_training():
    files = [f for low in LOW for f in unit_files(low)]
    assert len(files) > 5
    bad = {f"{path.relative_to(ROOT.parent)} imports {name}"
           for path in files for name in imports(path)
           if _unit(name) in HIGH}
    assert not bad, sorted(bad)


def test_megalite_units_import_one_another_without_a_cycle():
    graph = unit_graph()
    assert {"megalite.mpu", "megalite.schedules", "megalite.training"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_low_units_import_only_what_lies_below_them():
    graph = unit_graph()
    assert ONLY.keys() <= graph.keys()
    bad = {f"{unit} imports {target}" for unit, allowed in ONLY.items()
           for target in graph[unit] - allowed}
    assert not bad, sorted(bad)


def test_checkpoint_planning_and_training_import_nothing_above_them():
    graph = unit_graph()
    assert NOT.keys() <= graph.keys()
    bad = {f"{unit} imports {target}" for unit, banned in NOT.items()
           for target in graph[unit] & banned}
    assert not bad, sorted(bad)


def test_only_the_tasks_import_the_tasks():
    bad = {f"{unit} imports megalite.tasks" for unit, targets in unit_graph().items()
           if "megalite.tasks" in targets and unit != "megalite.tasks"}
    assert not bad, sorted(bad)


def test_the_top_of_megalite_holds_only_the_modules_everything_reads():
    modules = {path.stem for path in ROOT.glob("*.py")} - {"__init__"}
    assert modules <= TOP, sorted(modules - TOP)
