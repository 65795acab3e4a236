"""The package's import graph: no cycle, and each layer imports only the layers below it.

Built from the source with ``ast`` (nothing is imported): an arrow from module A to module B for
every ``import B`` / ``from B import ...`` in A, at any depth (a function's lazy import is still
a dependency), naming a submodule when ``from package import name`` names one.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mcore_refit"
REFIT = "mcore_refit.refit"
# The refit modules above the transports: they choose and drive a transport.
REFIT_FRONT = {REFIT, f"{REFIT}.refitter", f"{REFIT}.endpoint"}
APPLICATIONS = ("mcore_refit.grpo", "mcore_refit.bench")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package.parent): path for path in sorted(package.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imports_of(path, name, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Arrows that go up a layer (see the module docstring of each rule below)."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            # The library never imports its applications.
            if (not module.startswith(APPLICATIONS) and target.startswith(APPLICATIONS)):
                found.append(f"{module} -> {target} (library imports an application)")
            in_refit = module == REFIT or module.startswith(f"{REFIT}.")
            # Outside refit/, only its front: mcore_refit.refit.
            if not in_refit and target.startswith(f"{REFIT}."):
                found.append(f"{module} -> {target} (past the front, mcore_refit.refit)")
            if in_refit and module not in REFIT_FRONT:
                # Refit's core and its transports never import the front that drives them.
                if target in REFIT_FRONT:
                    found.append(f"{module} -> {target} (refit layer imports the front)")
                # Refit's core never imports a transport.
                if (not module.startswith(f"{REFIT}.transports")
                        and target.startswith(f"{REFIT}.transports")):
                    found.append(f"{module} -> {target} (refit core imports a transport)")
    return found


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_no_layer_imports_a_higher_one():
    assert violations(import_graph()) == []


def test_refit_keeps_a_small_top_level():
    top = [p for p in (PACKAGE / "refit").iterdir() if p.suffix == ".py" or
           (p.is_dir() and (p / "__init__.py").exists())]
    assert len([p for p in top if p.suffix == ".py"]) <= 16, sorted(p.name for p in top)


def test_the_lint_rule_bans_every_refit_module_outside_refit():
    """ruff's TID251 (pyproject.toml) bans each module behind the front; a new one is covered."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    banned = set(config["tool"]["ruff"]["lint"]["flake8-tidy-imports"]["banned-api"])
    behind = {name for name in modules() if name.startswith(f"{REFIT}.")
              and name.count(".") == 2}
    assert behind == banned


def test_the_checks_can_fail(tmp_path):
    """A cycle, an application import and an import past the front are each reported."""
    package = tmp_path / "mcore_refit"
    for name, text in {
        "__init__.py": "",
        "a.py": "from mcore_refit import b\n",
        "b.py": "def f():\n    from mcore_refit.a import x\n",
        "grpo/__init__.py": "",
        "grpo/loop.py": "",
        "low.py": "from mcore_refit.grpo.loop import run\nfrom mcore_refit.refit.plan import P\n",
        "refit/__init__.py": "from mcore_refit.refit.plan import P\n",
        "refit/plan.py": "from .transports import base\n",
        "refit/transports/__init__.py": "",
        "refit/transports/base.py": "from mcore_refit.refit import Refitter\n",
    }.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(package)
    assert find_cycle(graph) == ["mcore_refit.a", "mcore_refit.b", "mcore_refit.a"]
    assert violations(graph) == [
        "mcore_refit.low -> mcore_refit.grpo.loop (library imports an application)",
        "mcore_refit.low -> mcore_refit.refit.plan (past the front, mcore_refit.refit)",
        "mcore_refit.refit.plan -> mcore_refit.refit.transports.base (refit core imports a "
        "transport)",
        "mcore_refit.refit.transports.base -> mcore_refit.refit (refit layer imports the front)",
    ]


@pytest.mark.parametrize("import_line", [
    "from mcore_refit.refit.plan import RefitPlan\n",
    "from mcore_refit.refit.transports.base import RefitSender\n",
    "import mcore_refit.refit.transports.colocated.sender\n",
])
def test_ruff_rejects_an_import_past_the_front(tmp_path, import_line):
    import subprocess
    import sys

    caller = tmp_path / "mcore_refit" / "grpo" / "caller.py"
    caller.parent.mkdir(parents=True)
    caller.write_text(import_line)
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run([str(ruff), "check", "--config", str(ROOT / "pyproject.toml"),
                             "--select", "TID251", "--no-cache", str(caller)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "TID251" in result.stdout and "import it from `mcore_refit.refit`" in result.stdout
