"""lorakit's import graph has no circles and no arrow from a lower floor up to a higher one.

The graph is read with `ast` from every .py file under lorakit/: imports inside functions and under
TYPE_CHECKING count, since a lazy or typing-only import still ties the two rooms together (a circle that
only works because one side imports late is still a circle). Relative imports are resolved against the
importing module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lorakit"

# The layer map, low to high (docs/architecture.md): a module may import its own floor or a lower one.
# The longest matching prefix gives a module's floor.
FLOORS = {
    "lorakit.errors": 1,
    "lorakit.storage": 1,
    "lorakit.rundir": 1,
    "lorakit.runlock": 1,
    "lorakit.lock_holder": 1,
    "lorakit.meter": 1,
    "lorakit.observe": 1,
    "lorakit.dist": 1,  # rank, world and the collectives every rank agrees through
    "lorakit.lazy": 1,  # packages whose names load on first use
    "lorakit.units": 1,
    "lorakit.disclosure": 1,  # redaction of secrets and the umask's file mode: every writer uses them  # byte sizes: storage, the planner and the doctor speak them
    # Makes a CLI module callable; imports nothing of lorakit, so the doctor's package may use it too.
    "lorakit.callable_module": 1,
    "lorakit.recipe": 2,
    "lorakit.data": 3,
    "lorakit.model": 4,
    # What lorakit knows about each architecture (pure records, no model code): the data layer's collators
    # read the decoder start token there (families/start.py).
    "lorakit.model.families": 3,
    "lorakit.testing": 5,
    "lorakit.evaluation": 5,
    "lorakit.objectives": 6,
    "lorakit.backends": 6,
    "lorakit.engine": 6,
    "lorakit.planner": 7,
    "lorakit.export": 8,
    "lorakit.report": 8,
    "lorakit.inference": 8,
    "lorakit.preflight": 8,
    "lorakit.doctor": 9,
    "lorakit.api": 10,
    "lorakit": 10,  # lorakit/__init__.py: the public API
    "lorakit.run": 11,
    "lorakit.prepare": 11,
    "lorakit.merge": 11,
    "lorakit.plan": 11,
    "lorakit.compare": 11,
    "lorakit.generate": 11,
    "lorakit.evaluate": 11,
    "lorakit.push": 11,
    "lorakit.cli": 11,
    # The doctor's own command line sits with the other CLIs.
    "lorakit.doctor.cli": 11,
    "lorakit.doctor.__main__": 11,
    # python -m lorakit.export (docs/export.md), a CLI like lorakit.merge.
    "lorakit.export.__main__": 11,
    # The Slurm job writer and its per-node launcher (docs/multinode.md#slurm).
    "lorakit.slurm": 11,
}

# Arrows up a floor and circles that other parts of issue 43 remove; each names the area whose change
# removes it. These lists only shrink: a new arrow or circle is a failure, and so is an entry here that no
# longer exists.
KNOWN: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a package is its __init__)."""
    mods = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The module an import of `name` loads: itself, or the nearest package above it that exists."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the lorakit modules it imports, anywhere in its file."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                target = _target(name, mods)
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def floor(module: str) -> int:
    """The floor of `module`: that of the longest prefix in FLOORS ("lorakit" itself only for the package)."""
    name = module
    while name not in FLOORS or (name == "lorakit" != module):
        if "." not in name:
            raise AssertionError(f"{module} has no floor in FLOORS: add its room to the layer map")
        name = name.rpartition(".")[0]
    return FLOORS[name]


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module sits on a higher floor."""
    return {(a, b) for a, targets in graph.items() for b in targets if floor(b) > floor(a)}


def test_a_fake_circle_and_a_fake_arrow_up_are_found(tmp_path):
    pkg = tmp_path / "lorakit"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("from .a import x\n")
    (pkg / "data" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "data" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lorakit.data.a import f\n"
    )
    (pkg / "errors.py").write_text("import lorakit.data.b\n")
    graph = import_graph(module_files(pkg))
    assert cycles(graph) == [["lorakit.data.a", "lorakit.data.b"]]
    assert circle_path(graph, ["lorakit.data.a", "lorakit.data.b"]) == [
        "lorakit.data.a",
        "lorakit.data.b",
        "lorakit.data.a",
    ]
    assert upward(graph) == {("lorakit.errors", "lorakit.data.b")}


def circle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the first module of `component`, as the modules in import order, first again last."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:  # breadth first: the shortest way back to start
        node = queue.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"{component} is not a circle")


def test_no_import_circles():
    graph = import_graph(module_files())
    found = cycles(graph)
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    gone = KNOWN_CYCLES - {frozenset(c) for c in found}
    circles = "\n".join("  " + " -> ".join(circle_path(graph, c)) for c in new)
    assert not new, (
        "import circles (each file imports the next, directly, in a function or for typing):\n" + circles
    )
    assert not gone, f"KNOWN_CYCLES lists circles that no longer exist, remove them: {gone}"


def test_no_import_from_a_lower_floor_to_a_higher_one():
    arrows = upward(import_graph(module_files()))
    new = sorted(arrows - KNOWN)
    gone = sorted(KNOWN - arrows)
    lines = [f"  {a} (floor {floor(a)}) -> {b} (floor {floor(b)})" for a, b in new]
    assert not new, "imports up a floor:\n" + "\n".join(lines)
    assert not gone, f"KNOWN lists arrows that no longer exist, remove them: {gone}"


def house_hits(pattern: str, files) -> list[str]:
    """file:line of every source line matching `pattern` (comments and docstrings included: they state
    knowledge as much as code does)."""
    import re

    rx = re.compile(pattern)
    return [
        f"{f.relative_to(PACKAGE.parent)}:{n}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if rx.search(line)
    ]


# The run's strategy compared as an attribute (recipe.distributed.strategy == "deepspeed" and the like).
STRATEGY_COMPARED = r"\.strategy\b\s*(==|!=|\bin\b|\bnot in\b)"


def test_only_backends_compare_the_strategy():
    # Issue 55: the backend answers what others ask of it; model/build.py's compile choice compared
    # `d.strategy == "deepspeed"` until the load plan's kind answered it.
    outside = [f for f in PACKAGE.rglob("*.py") if "backends" not in f.relative_to(PACKAGE).parts]
    assert not house_hits(STRATEGY_COMPARED, outside)
    import re

    for line in ('zero3 = d.strategy == "deepspeed"', 'if recipe.distributed.strategy in ("fsdp",):'):
        assert re.search(STRATEGY_COMPARED, line), line  # the pattern finds what it is for


def test_the_recipe_package_names_no_objective():
    # Objectives bring their settings through their registration (lorakit.objectives.registry).
    names = r"\b(dpo|ipo|orpo|kto|simpo|grpo|dapo)\b"
    assert not house_hits(names, PACKAGE.joinpath("recipe").rglob("*.py"))
    assert house_hits(names, PACKAGE.joinpath("objectives").rglob("*.py")), "the pattern finds none"
