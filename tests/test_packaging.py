"""The wheel carries every module of every room, and each one imports from the installed wheel alone."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs the wheel and runs its console script

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("dsl", "controller", "serving", "agents", "cli")

IMPORT_ALL = r"""
import importlib, pkgutil, sys
target = sys.argv[1]
import evocache.dsl, evocache.controller, evocache.serving, evocache.agents, evocache.cli
names = []
for room in ("dsl", "controller", "serving", "agents", "cli"):
    pkg = importlib.import_module("evocache." + room)
    assert pkg.__file__.startswith(target), (room, pkg.__file__)
    names.append(pkg.__name__)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
print("\n".join(names))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
    )
    (path,) = out.glob("evocache-*.whl")
    return path


def test_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for room in ROOMS:
        for source in (ROOT / room).rglob("*.py"):
            rel = source.relative_to(ROOT / room).as_posix()
            assert f"evocache/{room}/{rel}" in names, f"{room}/{rel} missing from the wheel"
    assert not any(n.startswith("evocache/__init__") for n in names), "evocache must stay a namespace package"


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    # -S: no site processing, so the editable install of the working tree is invisible; dependencies come
    # from this environment's site-packages, evocache only from the wheel.
    env = {"PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_ALL, str(target)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    imported = done.stdout.split()
    assert "evocache.controller._cache_if" in imported and "evocache.dsl._parser" in imported
    assert "evocache.controller.tiers._redis" in imported and "evocache.controller.eviction._s3fifo" in imported


def test_console_script_is_installed():
    done = subprocess.run([str(Path(sys.executable).parent / "evocache"), "version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "0.1.0"
