"""The docs site (``mkdocs.yml``, ``docs/``): its strict build (broken links and references
fail it), every page in the navigation, and the examples marked ``<!-- runnable -->`` run as
written, their shown output included. ``<!-- runnable: slow -->`` examples (a whole
training run) run only with ``MCORE_RL_DOCS_SLOW=1``; ``<!-- runnable: gpu -->`` ones need
CUDA."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = re.compile(r"^\s*<!-- runnable(?::\s*(slow|gpu))? -->\s*$")


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly_with_the_generated_config_reference_and_api_pages(tmp_path):
    out = _mkdocs(REPO / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    for field in ("clip_ratio_high", "backends", "tracking_uri", "micro_batch_tokens"):
        assert f"<code>{field}</code>" in config_page, field  # every section, nested ones too
    api_page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "RLTrainer" in api_page and "ControllerGroup" in api_page


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "mcore_rl").symlink_to(REPO / "mcore_rl")
    page = tmp_path / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the page that is not](no_such_page.md).\n")
    out = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no_such_page.md" in out.stdout + out.stderr


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation_once():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = _nav_pages(nav)
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk and len(pages) == len(set(pages))


def examples() -> list:
    """(page, line, kind, language, code) of every marked example."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.match(line)
            if not m:
                continue
            fence = lines[i + 1]
            indent = len(fence) - len(fence.lstrip())
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip().startswith("```"))
            code = textwrap.dedent("\n".join(l[indent:] for l in lines[i + 2:end]))
            found.append((str(page.relative_to(DOCS)), i + 1, m.group(1) or "ci",
                          fence.strip()[3:] or "console", code))
    return found


def _params():
    params = []
    for page, line, kind, language, code in examples():
        marks = [pytest.mark.gpu] if kind == "gpu" else []
        if kind == "slow" and not os.environ.get("MCORE_RL_DOCS_SLOW"):
            continue  # a whole training run: outside CI (MCORE_RL_DOCS_SLOW=1 runs them)
        params.append(pytest.param(language, code, marks=marks, id=f"{page}:{line}"))
    return params


def test_there_are_runnable_examples_on_several_pages():
    ci = [e for e in examples() if e[2] == "ci"]
    assert len({e[0] for e in ci}) >= 4, ci


def _commands(code: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) of a console block (``$ `` prompts), or
    each command of a script block (no output shown)."""
    joined = code.replace("\\\n", " ")
    lines = joined.splitlines()
    if not any(l.startswith("$ ") for l in lines):
        return [(l, []) for l in lines if l.strip() and not l.lstrip().startswith("#")]
    out: list[tuple[str, list[str]]] = []
    for l in lines:
        if l.startswith("$ "):
            out.append((l[2:], []))
        elif out:
            out[-1][1].append(l)
    return out


def _shown_in(expected: str, output: str) -> bool:
    """An output line as the docs show it, ``...`` standing for what varies."""
    pos = 0
    for part in (p.strip() for p in expected.split("...")):
        if part:
            pos = output.find(part, pos)
            if pos < 0:
                return False
            pos += len(part)
    return True


@pytest.mark.parametrize("language, code", _params())
def test_a_runnable_example_runs_as_written(language, code, tmp_path):
    """In a scratch directory with the checkout's configs/ and examples/, the console
    script on PATH: a command shown with its output must print it, and fail when that
    output is an error; any other must succeed."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}
    if language == "python":
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return
    for command, shown in _commands(code):
        out = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        printed = out.stdout + out.stderr
        if not shown or not any("error:" in line for line in shown):
            assert out.returncode == 0, f"{command}\n{printed[-3000:]}"
        else:  # an error shown: the command fails
            assert out.returncode != 0, f"{command}\n{printed[-3000:]}"
        for line in shown:
            assert _shown_in(line, printed), f"{command}\nshown: {line}\nprinted:\n{printed[-3000:]}"
