"""The repository layout never shadows the standard library.

The package lives in `platform/gpt2_platform`; `platform/` itself must stay a
plain folder (no `__init__.py`), or it would hide Python's `platform` module
from every tool run in the repository root.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("platform", "jobs", "tools", "tests")
# Stems that are conventions, not importable module names.
ALLOWED_STEMS = {"__init__", "__main__", "conftest"}
SKIPPED_DIRS = {".venv", "__pycache__"}

# Run in a fresh interpreter: where `platform` is found, that it is the stdlib
# module, and that our package still imports beside it.
PROBE = """
import importlib.machinery, json, sys
spec = importlib.machinery.PathFinder.find_spec("platform")
import platform
import gpt2_platform
print(json.dumps({
    "file": platform.__file__,
    "spec_origin": spec.origin if spec else None,
    "has_python_version": hasattr(platform, "python_version"),
    "package": gpt2_platform.__file__,
}))
"""


def _is_under_repo(path: str | None) -> bool:
    if path is None:
        return False
    resolved = Path(path).resolve()
    return resolved == REPO or REPO in resolved.parents


def _is_stdlib_platform(path: str | None) -> bool:
    stdlib_platform = Path(importlib.machinery.PathFinder.find_spec("platform", [str(Path(os.__file__).parent)]).origin)
    return path is not None and Path(path).resolve() == stdlib_platform.resolve()


def test_platform_import_is_the_stdlib_module_in_this_process() -> None:
    import platform

    assert callable(platform.python_version)
    assert not _is_under_repo(platform.__file__), platform.__file__
    # sys.modules may hold a copy imported before pytest set sys.path up; ask the path finder too.
    spec = importlib.machinery.PathFinder.find_spec("platform")
    assert spec is not None and _is_stdlib_platform(spec.origin), spec


@pytest.mark.parametrize(
    "pythonpath",
    [str(REPO), str(REPO / "platform"), "platform", f"{REPO}{os.pathsep}{REPO / 'platform'}"],
    ids=["repo-root", "platform-dir", "platform-relative", "both"],
)
def test_platform_import_is_the_stdlib_module_in_a_subprocess(pythonpath: str) -> None:
    # cwd is the repo root too, as for `python -m pytest` or `python jobs/...` run from there.
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["has_python_version"], probe
    assert not _is_under_repo(probe["file"]), probe
    assert _is_stdlib_platform(probe["spec_origin"]), probe
    assert Path(probe["package"]).parts[-2:] == ("gpt2_platform", "__init__.py"), probe


def test_platform_folder_is_not_a_package() -> None:
    assert (REPO / "platform" / "gpt2_platform" / "__init__.py").is_file()
    assert not (REPO / "platform" / "__init__.py").exists(), (
        "platform/__init__.py would shadow the stdlib platform module"
    )


def _python_names(root: Path) -> list[tuple[str, Path]]:
    """(import name, path) of every module and package-like folder below `root` (root itself excluded)."""
    names = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        here = Path(directory)
        python_files = [f for f in files if f.endswith(".py")]
        if here != root and python_files:
            names.append((here.name, here))
        names.extend((Path(f).stem, here / f) for f in python_files if Path(f).stem not in ALLOWED_STEMS)
    return names


def test_collector_sees_the_package() -> None:
    # Guards the clash check below against walking nothing.
    found = {name for root in SOURCE_ROOTS for name, _ in _python_names(REPO / root)}
    assert {"gpt2_platform", "train", "model", "checkpoint", "config", "probes", "test_layout"} <= found


def test_no_module_or_package_is_named_after_a_stdlib_module() -> None:
    clashes = [
        str(path.relative_to(REPO))
        for root in SOURCE_ROOTS
        for name, path in _python_names(REPO / root)
        if name in sys.stdlib_module_names
    ]
    assert not clashes, f"these shadow standard library modules; rename them: {clashes}"
