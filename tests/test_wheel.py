"""The built wheel is what a user installs into an existing SGLang environment: it carries every
package, the embedded default model, the plugin entry points and the console scripts, declares
its dependencies, and SGLang's own plugin loader finds kvguard in it and loads it. The wheel is
built from a copy of the checkout (``pip wheel --no-deps --no-build-isolation``) and installed
alone into a temporary directory that comes first on ``sys.path``, ahead of this checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Not part of a source tree: environments, build outputs, caches, campaign results.
NOT_SOURCE = shutil.ignore_patterns(
    ".venv", ".git", "build", "runs", ".cache", "*_cache", "__pycache__", "*.egg-info", "*.so",
    "results",
)  # fmt: skip
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "kvguard"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        timeout=600,
    )
    [whl] = out.glob("kvguard-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [*PIP, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    return target


def _metadata(whl: zipfile.ZipFile, name: str) -> str:
    [path] = [n for n in whl.namelist() if n.endswith(f".dist-info/{name}")]
    return whl.read(path).decode()


def test_wheel_contents(wheel: Path):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = _metadata(whl, "METADATA")
        entry_points = _metadata(whl, "entry_points.txt")
    for module in (
        "kvguard/__init__.py",
        "kvguard/patches/plugin.py",
        "kvguard/patches/targets.py",
        "kvguard/patches/sgl_kernel_finder.py",
        "kvguard/patches/sgl_kernel_compat.py",
        "kvguard/kernels/kv_checksum.py",
        "kvguard/serve/cli.py",
        "kvguard/fuzz/plugin.py",
        "kvguard/bench/guard.py",
        "kvguard/quant/quantize.py",
        "kvguard/serve/default_model/checkpoint/model.safetensors",
        "kvguard/serve/default_model/checkpoint/tokenizer.json",
    ):
        assert module in names, module
    assert not any(n.startswith(("tests/", "scripts/", "fuzz/results")) for n in names)
    declared = (REPO / "pyproject.toml").read_text().count("[[tool.setuptools.ext-modules]]")
    compiled = [n for n in names if n.endswith(".so")]
    assert len(compiled) == declared, f"{declared} extension(s) declared, wheel has {compiled}"
    assert "Requires-Dist: sglang==0.5.23" in metadata
    assert "Requires-Dist: torch==2.14.1" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "[sglang.srt.plugins]" in entry_points
    assert "kvguard = kvguard.patches.plugin:load" in entry_points
    assert "kvguard-serve = kvguard.serve.cli:main" in entry_points


LOADER = """
import importlib.metadata as md, json, sys
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
from sglang.srt.plugins.hook_registry import HookRegistry

found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)  # SGLang's discovery, as load_plugins() does
found["kvguard"][0]()  # run the plugin: it registers its hooks (applying them is SGLang's job)
hooks = {t: sorted({h.__module__ for _, h, _ in rows}) for t, rows in HookRegistry._hooks.items()}
dists = {ep.name: str(ep.dist.locate_file("")) for ep in md.entry_points(group=GENERAL_PLUGINS_GROUP)}
print("RESULT", json.dumps({
    "found": {name: dist for name, (_, dist) in found.items()},
    "dists": dists,
    "hooks": hooks,
    "kvguard": sys.modules["kvguard"].__file__,
}))
"""


def test_sglangs_plugin_loader_loads_kvguard_from_the_wheel(installed: Path, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "SGLANG_PLUGINS"))}
    env.update(PYTHONPATH=str(installed), KVGUARD_MODE="sampled", SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", LOADER],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,  # not the checkout: nothing of it on sys.path
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0].split(" ", 1)[1])
    assert out["found"].get("kvguard") == "kvguard", out["found"]
    assert "kvguard_fuzz" in out["found"]
    assert Path(out["dists"]["kvguard"]).resolve() == installed.resolve(), out["dists"]
    assert Path(out["kvguard"]).resolve().is_relative_to(installed.resolve()), out["kvguard"]
    attach = out["hooks"].get("sglang.srt.managers.scheduler.Scheduler.__init__")
    # the options it cannot check refused before the scheduler builds anything; then the guard
    assert attach == ["kvguard.patches.engine_options", "kvguard.patches.lifecycle"], out["hooks"]


def test_declared_dependencies_hold_in_the_locked_environment():
    """Every [project] dependency and extra accepts the version requirements/ pins, so the
    wheel's constraints never contradict the environment the tests run in."""
    import tomllib  # Python 3.11+, as the project venv
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for name in ("lock.txt", "sglang.txt", "torch.txt"):
        for line in (REPO / "requirements" / name).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                pkg, version = line.split("==", 1)
                pins[canonicalize_name(pkg)] = version.strip()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        declared += extra
    for spec in declared:
        req = Requirement(spec)
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"{spec}: not pinned in requirements/"
        assert req.specifier.contains(pinned, prereleases=True), f"{spec} rejects the pin {pinned}"
