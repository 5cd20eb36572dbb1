"""The package reaches mlx-lm through one module: public names, and the private members that
module lists (each behind a function of its own)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import eagle_mlx
from eagle_mlx import mlxlm
from eagle_mlx.targets.target import SUPPORTED_MODEL_TYPES

PACKAGE = Path(eagle_mlx.__file__).parent


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
            text = ast.unparse(node.args[0])
            yield node.lineno, text.strip("'\"f")


def test_no_module_but_the_boundary_imports_mlx_lm():
    offenders = [f"{p.relative_to(PACKAGE)}:{line} imports {name}"
                 for p in sorted(PACKAGE.rglob("*.py")) if p.name != "mlxlm.py"
                 for line, name in _imports(p) if name.split(".")[0] == "mlx_lm"]
    assert not offenders, offenders
    assert any(name.startswith("mlx_lm") for _, name in _imports(PACKAGE / "mlxlm.py"))


def test_the_boundary_names_only_public_mlx_lm_names_and_each_exists():
    for name, module in mlxlm._NAMES.items():
        assert not name.startswith("_") and not any(part.startswith("_")
                                                    for part in module.split("."))
        assert getattr(mlxlm, name) is not None, name
    for model_type in SUPPORTED_MODEL_TYPES:
        arch = mlxlm.model_module(model_type)
        assert hasattr(arch, "Model") and hasattr(arch, "ModelArgs")


def _private_accesses(path: Path, own: set):
    """`x._name` (and getattr/setattr/hasattr with a "_name") on anything but the module's
    own objects: `self`, `cls`, or a class or module of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in own):
                continue
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in \
                ("getattr", "setattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        else:
            continue
        if name.startswith("_") and not name.startswith("__"):
            yield node.lineno, ast.unparse(node), name


def test_private_members_of_other_libraries_only_through_the_boundary():
    files = sorted(PACKAGE.rglob("*.py"))
    own = {"eagle_mlx"} | {n.name for p in files for n in ast.walk(ast.parse(p.read_text()))
                           if isinstance(n, ast.ClassDef)}
    allowed = {"os._exit"}  # the standard library's exit without cleanup
    offenders = [f"{p.relative_to(PACKAGE)}:{line} {text}" for p in files
                 if p.name != "mlxlm.py" for line, text, _ in _private_accesses(p, own)
                 if text not in allowed]
    assert not offenders, offenders
    # every private member the boundary reaches is listed there with why
    listed = " ".join(mlxlm.PRIVATE)
    reached = {name for _, _, name in _private_accesses(PACKAGE / "mlxlm.py", set())}
    assert reached and all(name in listed for name in reached), (reached, listed)


GROUND = {"errors", "mlxlm", "outputs", "hub", "tensorfiles"}
# what each layer may import besides the ground modules and itself
BELOW = {"targets": set(), "heads": {"targets"}, "decoding": {"targets"},
         "training": {"targets", "heads"}}
TOOLS_ABOVE_BENCH = {"benchmark"}  # bench/ stands on every tool but the one over it


def _package_imports(path: Path):
    """(line, imported module relative to the package: 'targets.cache', 'errors', ...)."""
    here = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(here[:-1])
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                yield node.lineno, ".".join(base + [node.module])
            else:
                yield from ((node.lineno, ".".join(base + [a.name])) for a in node.names)
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            for name in names:
                if name and name.split(".")[0] == "eagle_mlx":
                    yield node.lineno, name.partition(".")[2]


def test_layers_import_downhill():
    """ground <- targets <- heads, decoding <- training <- the API and tools <- bench/ <-
    benchmark.py: no module imports from a layer above its own (nor heads and decoding from
    each other)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        layer = parts[0] if len(parts) > 1 else ("ground" if parts[0] in GROUND else None)
        if layer == "bench":
            offenders += [f"{path.relative_to(PACKAGE)}:{line} imports {module}"
                          for line, module in _package_imports(path)
                          if module.split(".")[0] in TOOLS_ABOVE_BENCH]
            continue
        if layer is None:
            continue  # the API, the CLI and the tools may import anything below them
        allowed = GROUND | ({layer} | BELOW[layer] if layer != "ground" else set())
        for line, module in _package_imports(path):
            top = module.split(".")[0]
            if module and top not in allowed:
                offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not offenders, offenders


def test_no_module_takes_another_modules_private_name():
    """`from .x import _name` or `x._name` with `x` a module of the package: a name that
    crosses a file is public."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                     .startswith("eagle_mlx")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {a.name}")
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules |= {(a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.startswith("eagle_mlx")}
        offenders += [f"{path.relative_to(PACKAGE)}:{n.lineno} {ast.unparse(n)}"
                      for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in modules
                      and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not offenders, offenders


def test_functions_and_classes_stay_small():
    """No function of the package longer than 80 lines, no class longer than 250."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = 80 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                250 if isinstance(n, ast.ClassDef) else None
            if limit and n.end_lineno - n.lineno + 1 > limit:
                offenders.append(f"{path.relative_to(PACKAGE)}:{n.lineno} {n.name}: "
                                 f"{n.end_lineno - n.lineno + 1} lines")
    assert not offenders, offenders


def test_the_layout_table_names_every_module_and_only_modules_that_exist():
    """CONTRIBUTING.md's layout table: every module of the package in a row, and every
    file a row names is there."""
    import re

    root = PACKAGE.parent
    text = (root / "CONTRIBUTING.md").read_text(encoding="utf-8")
    table = text[text.index("## The layout"):text.index("## Adding a target family")]
    named = set(re.findall(r"`([\w/]+\.py)`", table))
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.parent == PACKAGE or p.name != "__init__.py"}
    assert not modules - named, sorted(modules - named)
    missing = [n for n in named if not any((where / n).is_file()
                                           for where in (PACKAGE, root / "scripts", root))]
    assert not missing, missing


LIGHT_TOOLS = ["generate", "chat", "convert", "server", "benchmark", "regen"]
REFUSE = """
import runpy, sys
sys.argv = ["x", "--max-tokens", "many", "--out", "o", "--mlx-path", "m"]
try:
    runpy.run_module("eagle_mlx.{tool}", run_name="__main__")
except SystemExit as e:
    print(e.code, "mlx_lm" in sys.modules, "transformers" in sys.modules)
"""


@pytest.mark.parametrize("tool", LIGHT_TOOLS)
def test_a_bad_flag_is_refused_before_mlx_lm_is_imported(tool):
    """Refusing a flag costs no model library: mlx-lm (and transformers, which it imports)
    stay unloaded until a tool's flags are good."""
    out = subprocess.run([sys.executable, "-c", REFUSE.format(tool=tool)], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["2", "False", "False"], (out.stdout, out.stderr[-500:])
