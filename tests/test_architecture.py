"""Imports go one way (docs/architecture.md).

Two checks: import-linter's contracts (``.importlinter``) over ``mcore_rl/``, and a check of
the source of the folders installed as ``mcore_rl.*`` from outside ``mcore_rl/``
(``kernels/``, ``launch/``, ``benchmarks/``), which import-linter does not walk. Each check
is shown to fail on a forbidden import written into a temporary copy of the tree.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ("mcore_rl", "kernels", "launch", "benchmarks", ".importlinter")

# folder -> (its package, the mcore_rl packages it may import besides its own)
FOLDERS = {
    "kernels": ("mcore_rl.kernels", ()),
    "launch": ("mcore_rl.launch", ("mcore_rl.errors", "mcore_rl.parallel", "mcore_rl.config",
                                   "mcore_rl.registry")),
    "benchmarks": ("mcore_rl.benchmarks", None),  # None: anything but the CLI
}
OUTSIDE = {"kernels": "mcore_rl.kernels", "launch": "mcore_rl.launch", "benchmarks": "mcore_rl.benchmarks"}
CORE_MAY_IMPORT = {"mcore_rl.kernels"}
"""Of the folders outside mcore_rl/, what mcore_rl/ may import (cli/ excepted: it runs
launches and benchmarks)."""
KERNELS_FORBIDDEN = ("megatron", "vllm", "sglang", "transformers")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def folder_violations(root: Path) -> list[str]:
    """Forbidden edges into and out of kernels/, launch/ and benchmarks/, from source."""
    problems = []
    for folder, (package, allowed) in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in _imports(path):
                where = f"{path.relative_to(root)}:{line} imports {module}"
                if folder == "kernels" and module.split(".")[0] in KERNELS_FORBIDDEN:
                    problems.append(f"{where}: kernels import only torch and triton")
                if not _under(module, "mcore_rl") or _under(module, package):
                    continue
                if allowed is None:
                    if _under(module, "mcore_rl.cli"):
                        problems.append(f"{where}: nothing imports the CLI")
                elif not any(_under(module, a) for a in allowed):
                    problems.append(f"{where}: {folder}/ may import only "
                                    f"{', '.join(allowed) or 'itself'} of mcore_rl")
    for path in sorted((root / "mcore_rl").rglob("*.py")):
        if path.relative_to(root / "mcore_rl").parts[0] == "cli":
            continue
        for line, module in _imports(path):
            for outside in OUTSIDE.values():
                if _under(module, outside) and outside not in CORE_MAY_IMPORT:
                    problems.append(f"{path.relative_to(root)}:{line} imports {module}: only the "
                                    f"CLI imports {outside}")
    return problems


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the mcore_rl package in ``root`` (a subprocess: it must import that
    copy, not the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture()
def tree_copy(tmp_path):
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 7 kept, 0 broken" in result.stdout, result.stdout[-2000:]


def test_the_folders_outside_the_package_import_only_what_they_may():
    assert folder_violations(REPO) == []


def broken_by(tree, path: str, line: str, contract: str) -> str:
    """import-linter's report after ``line`` is appended to ``path`` of ``tree``: it must
    fail, naming ``contract`` as broken."""
    _append(tree / path, line)
    result = lint_imports(tree)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout[-3000:]
    return result.stdout


def test_a_model_importing_the_rl_loop_breaks_the_layers_contract(tree_copy):
    out = broken_by(tree_copy, "mcore_rl/models/gpt.py", "import mcore_rl.rl.phases  # forbidden",
                    "Packages depend downwards only")
    assert "mcore_rl.models.gpt -> mcore_rl.rl.phases" in out, out[-3000:]


def test_rl_math_importing_megatron_breaks_its_contract(tree_copy):
    broken_by(tree_copy, "mcore_rl/algos/kl.py", "import megatron.core  # forbidden",
              "RL math is pure torch (no Megatron, no engines, no HF)")


def test_forbidden_edges_of_the_outside_folders_are_found(tree_copy):
    _append(tree_copy / "kernels" / "gae" / "__init__.py", "from mcore_rl.train import engine")
    _append(tree_copy / "mcore_rl" / "trainer.py", "from mcore_rl.launch import stop_signal")
    _append(tree_copy / "launch" / "sbatch.py", "import mcore_rl.rl")
    problems = folder_violations(tree_copy)
    assert len(problems) == 3, problems
    assert any(p.startswith("kernels/gae/__init__.py") and "mcore_rl.train" in p for p in problems)
    assert any(p.startswith("mcore_rl/trainer.py") and "only the CLI imports mcore_rl.launch" in p
               for p in problems)
    assert any(p.startswith("launch/sbatch.py") and "mcore_rl.rl" in p for p in problems)


def test_the_trainer_importing_wandb_breaks_the_trackers_contract(tree_copy):
    broken_by(tree_copy, "mcore_rl/trainer.py", "import wandb  # forbidden",
              "Only the trackers import wandb and mlflow")


def test_an_import_cycle_between_modules_of_a_package_breaks_the_acyclic_contract(tree_copy):
    broken_by(tree_copy, "mcore_rl/flow/streams.py", "import mcore_rl.flow.hub  # a cycle",
              "No import cycles between the modules of a package")


def test_the_config_reading_a_model_breaks_its_contract(tree_copy):
    _append(tree_copy / "mcore_rl" / "config" / "validate.py", "import mcore_rl.models.shape")
    result = lint_imports(tree_copy)
    # the contract's long name is wrapped in the report: its words and BROKEN apart
    assert "The config reads no model" in result.stdout and "BROKEN" in result.stdout, \
        result.stdout[-3000:]
