"""Code that runs on ranks names the device of what it builds (a static check of tests/*.py).

On a GPU machine a rank computes on its GPU and its collectives go through NCCL, which has
no CPU tensors: a tensor or layer made on the CPU by default fails there (or meets a CUDA
model), while on the CPU every test passes regardless. So in every function that runs on
ranks - those handed to run_on_ranks / run_once / a pool's run, and everything of tests/
they reference, transitively - each torch factory (torch.zeros, torch.randn, ...) and each
constructor that takes `device=` (nn.Linear, GPTModel, ColumnParallelLinear, ...) must pass
`device=` (megalite.device.current_device(), or "cpu" where the CPU is meant, e.g. beside a
transformers reference), be moved at once (`torch.randint(..., generator=g).to(device)`) or
be read at once into Python (`.tolist()`, `.item()`).
"""
import ast
import functools
import importlib
import inspect
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
FACTORIES = {"arange", "empty", "eye", "full", "linspace", "ones", "rand", "randint", "randn",
             "randperm", "tensor", "zeros"}
POOL_CALLS = {"run_on_ranks": 1, "run_once": 1, "run": 0}  # where the function argument is


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)):
        return f"{head}.{node.attr}"
    return None


def _resolve(path: str):
    """The object a dotted path names (module attributes included), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


class _Module:
    """One tests/*.py file: its top-level definitions, imported names and parent links."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tree = ast.parse(_path(name).read_text())
        self.defs = {n.name: n for n in self.tree.body
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        self.aliases, self.parent = {}, {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
            if isinstance(node, ast.Import):
                self.aliases.update({a.asname or a.name.split(".")[0]:
                                     a.name if a.asname else a.name.split(".")[0]
                                     for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module:
                self.aliases.update({a.asname or a.name: f"{node.module}.{a.name}"
                                     for a in node.names})

    def full_path(self, node: ast.expr) -> str | None:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head not in self.aliases:
            return None
        return f"{self.aliases[head]}.{rest}" if rest else self.aliases[head]


def _path(module: str) -> pathlib.Path:
    """The file of a module of tests/ ("tests.helpers.gpt_run" -> tests/helpers/gpt_run.py)."""
    return TESTS.parent.joinpath(*module.split(".")).with_suffix(".py")


@functools.cache
def _module(name: str) -> _Module:
    return _Module(name)


def _tests_def(path: str | None) -> tuple[str, str] | None:
    """(module, name) of a top-level function or class of tests/ that `path` names."""
    if not path or not path.startswith("tests."):
        return None
    module, _, name = path.rpartition(".")
    if _path(module).exists() and name in _module(module).defs:
        return module, name
    return None


def _referenced(module: _Module, node: ast.AST) -> set[tuple[str, str]]:
    """The definitions of tests/ that code under `node` names."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in module.defs:
            found.add((module.name, sub.id))
        elif isinstance(sub, (ast.Name, ast.Attribute)):
            if target := _tests_def(module.full_path(sub)):
                found.add(target)
    return found


def _pool_argument(module: _Module, call: ast.Call) -> ast.expr | None:
    """The function a call hands to ranks: run_on_ranks(n, fn), run_once(n, fn), pool.run(fn)
    (`run` of a local object, not of a module such as subprocess)."""
    if isinstance(call.func, ast.Name):
        name = call.func.id
    elif isinstance(call.func, ast.Attribute) and module.full_path(call.func.value) is None:
        name = call.func.attr
    else:
        return None
    position = POOL_CALLS.get(name)
    return call.args[position] if position is not None and len(call.args) > position else None


def _rank_entry_points() -> tuple[set[tuple[str, str]], list[str]]:
    """(the definitions handed to rank pools, 'file:line' of pool calls whose function the
    check cannot follow). tests/helpers/multirank.py is the pool's own plumbing."""
    entries, unknown = set(), []
    for path in TESTS.rglob("*.py"):
        module = _module(".".join(path.relative_to(TESTS.parent).with_suffix("").parts))
        for call in ast.walk(module.tree):
            if module.name == "tests.helpers.multirank" or not isinstance(call, ast.Call):
                continue
            if (argument := _pool_argument(module, call)) is not None:
                found = _referenced(module, argument)
                entries |= found
                if not found:
                    unknown.append(f"{path.relative_to(TESTS.parent)}:{call.lineno}")
    return entries, unknown


def _needs_device(module: _Module, call: ast.Call) -> str | None:
    """The dotted name of a factory / device-taking constructor this call makes its tensors
    with, when the call neither names a device nor is moved at once; else None."""
    if any(k.arg in ("device", None) for k in call.keywords):
        return None
    parent = module.parent.get(call)
    if isinstance(parent, ast.Attribute) and parent.attr in ("to", "cuda", "tolist", "item"):
        return None
    path = module.full_path(call.func)
    if path is None:
        return None
    if path.startswith("torch.") and path.removeprefix("torch.") in FACTORIES:
        return path
    target = _resolve(path)
    if not inspect.isclass(target):
        return None
    try:
        takes_device = "device" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return path if takes_device else None


def rank_code() -> set[tuple[str, str]]:
    """(module, name) of every definition of tests/ that runs on ranks."""
    seen, todo = set(), list(_rank_entry_points()[0])
    while todo:
        key = todo.pop()
        if key not in seen:
            seen.add(key)
            todo.extend(_referenced(_module(key[0]), _module(key[0]).defs[key[1]]) - seen)
    return seen


def undeviced_calls() -> list[str]:
    """'file:line dotted.name' of every call on ranks that builds on the default device, and
    'file:line cannot be followed' of every pool call whose function the check cannot name."""
    found = [f"{where} cannot be followed" for where in _rank_entry_points()[1]]
    for module_name, name in rank_code():
        module = _module(module_name)
        for call in ast.walk(module.defs[name]):
            if isinstance(call, ast.Call) and (what := _needs_device(module, call)):
                found.append(f"{_path(module_name).relative_to(TESTS.parent)}:{call.lineno} {what}")
    return sorted(set(found))


def test_the_check_follows_rank_code_through_helpers_and_classes():
    reached = rank_code()
    assert {("tests.test_tp_layers", "_check_column"),
            ("tests.helpers.parallel_step", "global_batch"),
            ("tests.helpers.dp_reference", "Reference"), ("tests.helpers.gpt_run", "train"),
            ("tests.test_zero_bubble", "_NormedColumn")} <= reached
    assert ("tests.test_tp_layers", "test_tp_layers_match_torch_on_8_ranks") not in reached


def test_rank_code_names_the_device_of_its_tensors_and_layers():
    assert not undeviced_calls(), "\n".join(undeviced_calls())
