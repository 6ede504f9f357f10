"""A wheel built from the repository carries the config tree and works from any directory."""

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("fleetwise-*.whl")
    return whl


def test_wheel_contains_conf_and_recipes_but_no_platform_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fleetwise/conf/config.yaml" in names
    assert "fleetwise/conf/strategy/hybrid.yaml" in names
    assert "fleetwise/conf/recipe/gpt/gpt3_1.3b.yaml" in names
    assert "fleetwise/data/tokenize_text.py" in names  # `fleetwise tokenize`, which the README uses
    assert not any(n.startswith("platform/") for n in names)


def test_installed_wheel_plans_from_any_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    # Dependencies come from the test environment (appended after the new venv's own site-packages,
    # so `fleetwise` itself resolves to the wheel, not to the editable checkout).
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [str(venv / "bin" / "fleetwise"), "plan", "recipe=gpt/gpt3_1.3b", "--json"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == 1_418_842_112  # 24·(12h²+13h) + 2·50304·h + 2048·h + 2h, h=2048
    where = subprocess.run(
        [str(py), "-c", "import fleetwise; print(fleetwise.__file__)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        check=True,
    ).stdout
    assert str(site) in where
