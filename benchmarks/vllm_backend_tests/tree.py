"""A minimal copy of vLLM's test tree: one test module, what it imports from `tests`, and the
conftest fixtures it uses.

vLLM's top-level `tests/conftest.py` imports half of vLLM's test dependencies (tblib, PIL,
transformers' model classes, ...), which the GPU machine does not have and the attention tests
do not need. So the copy gets a conftest of its own holding only the fixtures the test
functions ask for and the autouse fixtures vLLM's CI runs every test with (`AUTOUSE`), each
taken from vLLM's conftest as source, with the imports and module-level helpers its body
names. Which `tests.*` modules to copy is read from the test module's imports, recursively.
"""

from __future__ import annotations

import ast
import builtins
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# vLLM's autouse fixtures that matter for these tests: `dynamo_reset` drops torch.compile state
# between tests (FLEX_ATTENTION compiles), `cleanup_fixture` frees GPU memory after each.
AUTOUSE = ("cleanup_fixture", "dynamo_reset")
BUILTINS = set(dir(builtins))


@dataclass
class Tree:
    """What `build` copied: paths relative to the copy's root."""

    root: Path
    test_module: Path
    modules: list[str] = field(default_factory=list)
    fixtures: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)


def _tests_imports(path: Path) -> list[str]:
    """`tests.x.y` modules imported by the module at `path` (absolute imports only)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tests" or node.module.startswith("tests."):
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("tests.")]
    return names


def _module_file(tests_dir: Path, module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for candidate in (tests_dir / rel.with_suffix(".py"), tests_dir / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _copy(src: Path, tests_dir: Path, dest_tests: Path) -> None:
    target = dest_tests / src.relative_to(tests_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target)
    # The packages on the way down (vLLM keeps `tests/__init__.py`, `tests/v1/__init__.py`;
    # leaf test folders have none and pytest imports their modules by path).
    for parent in src.relative_to(tests_dir).parents:
        init = tests_dir / parent / "__init__.py"
        if init.is_file() and not (dest_tests / parent / "__init__.py").exists():
            (dest_tests / parent).mkdir(parents=True, exist_ok=True)
            shutil.copy2(init, dest_tests / parent / "__init__.py")


def _requested_fixtures(path: Path) -> list[str]:
    """Argument names of the module's test functions (fixtures and parameters alike)."""
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            names += [a.arg for a in node.args.args if a.arg not in names]
    return names


def _parametrized_models(path: Path) -> list[str]:
    """The values of every `@pytest.mark.parametrize("model", [...])` in the module."""
    models: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize"):
            continue
        if len(node.args) < 2 or not isinstance(node.args[0], ast.Constant):
            continue
        if node.args[0].value != "model" or not isinstance(node.args[1], ast.List | ast.Tuple):
            continue
        for element in node.args[1].elts:
            if isinstance(element, ast.Constant) and element.value not in models:
                models.append(element.value)
    return models


def _is_fixture(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def _free_names(node: ast.AST) -> set[str]:
    """Names a function reads that it does not bind itself (arguments, assignments, imports)."""
    bound: set[str] = set()
    used: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            bound.add(sub.arg)
        elif isinstance(sub, ast.Name):
            (used if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
        elif isinstance(sub, ast.alias):
            bound.add((sub.asname or sub.name).split(".")[0])
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub is not node:
            bound.add(sub.name)
    return used - bound - BUILTINS


def conftest_source(conftest: Path, wanted: list[str]) -> tuple[str, list[str]]:
    """Source of a conftest with the fixtures of `conftest` named in `wanted` (those it has)
    and the `AUTOUSE` ones, plus the fixtures, helpers and imports they need.

    Returns (source, names of the fixtures written). Raises ValueError for a name a fixture
    needs that vLLM's conftest does not define or import.
    """
    text = conftest.read_text()
    tree = ast.parse(text)
    defs: dict[str, ast.AST] = {}
    imports: dict[str, str] = {}  # bound name -> the import statement that binds only it
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[node.name] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound = (a.asname or a.name).split(".")[0]
                imports[bound] = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                alias = f" as {a.asname}" if a.asname else ""
                imports[a.asname or a.name] = f"from {node.module} import {a.name}{alias}"
    todo = [n for n in wanted if n in defs and _is_fixture(defs[n])]
    todo += [n for n in AUTOUSE if n in defs and n not in todo]
    chosen: list[str] = []
    needed_imports = {"import pytest"}
    while todo:
        name = todo.pop(0)
        if name in chosen:
            continue
        chosen.append(name)
        node = defs[name]
        names = _free_names(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names |= {a.arg for a in node.args.args if a.arg in defs}  # fixture dependencies
        for free in sorted(names):
            if free in defs:
                todo.append(free)
            elif free in imports:
                needed_imports.add(imports[free])
            elif free != "pytest":
                raise ValueError(
                    f"{conftest}: {name} needs {free!r}, which the conftest neither defines "
                    "nor imports"
                )
    order = [n for n in defs if n in chosen]  # vLLM's own order
    body = [ast.get_source_segment(text, defs[n], padded=False) for n in order]
    decorated = []
    for n, src in zip(order, body, strict=True):
        decos = "".join(
            "@" + ast.get_source_segment(text, d) + "\n" for d in defs[n].decorator_list
        )
        decorated.append(decos + src)
    fixtures = [n for n in order if _is_fixture(defs[n])]
    header = (
        f'"""Fixtures of {conftest.name} that the copied tests use, taken from vLLM\'s source '
        'by fuselane.benchmarks.vllm_backend_tests."""\n\n'
    )
    return header + "\n".join(sorted(needed_imports)) + "\n\n\n" + "\n\n\n".join(
        decorated
    ) + "\n", fixtures


def build(vllm_tests: Path, dest: Path, test_file: str) -> Tree:
    """Copy `test_file` (relative to the `tests` folder `vllm_tests`) and what it needs into
    `dest/tests`, with a conftest at `dest/tests/conftest.py`."""
    source = vllm_tests / test_file
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such test file in the vLLM tests at {vllm_tests}")
    dest_tests = dest / "tests"
    tree = Tree(root=dest, test_module=dest_tests / test_file)
    seen: set[Path] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        _copy(path, vllm_tests, dest_tests)
        for module in _tests_imports(path):
            found = _module_file(vllm_tests, module)
            if found is None:
                raise FileNotFoundError(f"{path} imports {module}, not found under {vllm_tests}")
            tree.modules.append(module)
            todo.append(found)
    conftest = vllm_tests / "conftest.py"
    if conftest.is_file():
        text, tree.fixtures = conftest_source(conftest, _requested_fixtures(source))
        (dest_tests / "conftest.py").write_text(text)
    tree.models = _parametrized_models(source)
    return tree
