"""The package reaches mlx-lm through one module, and only through public names."""

import ast
from pathlib import Path

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
