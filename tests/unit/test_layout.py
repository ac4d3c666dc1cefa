"""The layout of src/dynaresize stays the architecture (docs/architecture.md).

`lint-imports` (run by `make test` before pytest) checks the layer contracts in pyproject.toml
package by package; these tests check what a contract cannot state: no import circle between
any two modules, a small top level, modules that read in one sitting, every package named
by a contract (so a new package cannot slip past the linter), and test files of distinct names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "dynaresize"
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES = 400


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_planted_circle():
    graph = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c", "p.d"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.c", imported="p.d")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_circle_between_modules():
    # grimp counts every import, also those inside functions, as the layer contracts do.
    assert _cycles(grimp.build_graph("dynaresize")) == []


def test_top_level_holds_only_the_cli_and_the_shared_vocabulary():
    modules = sorted(p.name for p in SRC.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_no_module_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_test_files_have_unique_basenames():
    """pytest imports test files by basename (rootdir mode, no __init__.py): two files of one name
    in different folders stop the whole collection."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_every_package_is_named_by_a_layer_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named: set[str] = set()
    for contract in config["contracts"]:
        for entry in contract.get("layers", []) + contract.get("modules", []) + contract.get("source_modules", []):
            named |= {part.strip() for part in entry.replace(":", "|").split("|")}
    packages = {f"dynaresize.{p.parent.name}" for p in SRC.glob("*/__init__.py")}
    assert packages and packages <= named, sorted(packages - named)


def test_roles_and_trainer_import_and_build_without_ray():
    """A GPU check machine has torch and transformers but no Ray: the roles, the trainer's parts
    and the RL math must import there (a contract checks it statically; this runs it)."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import dynaresize.roles.train_fsdp, dynaresize.roles.rollout_hf, dynaresize.roles.factory\n"
            "import dynaresize.roles.weight_sync, dynaresize.rl.grpo, dynaresize.reshard.execute\n"
            "from dynaresize.config import ModelConfig\n"
            "from dynaresize.rl.models import build_model\n"
            "build_model(ModelConfig())\n"
            "assert sys.modules['ray'] is None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
