"""The package's shape: the library apart from the experiment app, every module named."""

import ast
from pathlib import Path

import pytest

import lags_hvd

LIBRARY = Path(lags_hvd.__file__).parent


def library_modules():
    """Every module and subpackage of the library (the experiment app aside)."""
    return sorted(
        [p for p in LIBRARY.glob("*.py") if p.name != "__init__.py"]
        + [p for p in LIBRARY.iterdir() if (p / "__init__.py").exists() and p.name != "experiments"]
    )


def library_sources():
    return sorted(p for p in LIBRARY.rglob("*.py") if "experiments" not in p.parts)


def test_the_library_imports_nothing_from_the_experiment_app():
    for path in library_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert "experiments" not in target, f"{path.name} imports {target}"
            elif isinstance(node, ast.Import):
                assert not any("experiments" in alias.name for alias in node.names), path.name


def test_the_package_docstring_names_every_module():
    for path in library_modules() + [LIBRARY / "experiments"]:
        assert f"``{path.stem}``" in lags_hvd.__doc__, path.stem


@pytest.mark.horovod
def test_horovods_training_api_is_offered_whole():
    """``import lags_hvd as hvd`` offers every name of ``horovod.torch`` (Horovod's own tests
    use ccl_built, SyncBatchNorm, reducescatter, ...), but its build-time check_extension."""
    import inspect

    import horovod.torch

    missing = [
        name
        for name in dir(horovod.torch)
        if not name.startswith("_")
        and name != "check_extension"
        and not inspect.ismodule(getattr(horovod.torch, name))
        and not hasattr(lags_hvd, name)
    ]
    assert missing == []


def test_only_the_horovod_collectives_and_api_import_horovod():
    """The collectives seam: a second backend is a new module, not branches in the library."""
    allowed = {LIBRARY / "collectives" / "horovod.py", LIBRARY / "horovod_api.py", LIBRARY / "__init__.py"}
    for path in library_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            if any(name.split(".")[0] == "horovod" for name in names):
                assert path in allowed, f"{path.relative_to(LIBRARY)} imports {names}"
