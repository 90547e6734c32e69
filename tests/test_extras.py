"""Optional features name the extra that installs their package when it is missing."""

from __future__ import annotations

import sys

import pytest

from kvserve.extras import require


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kvserve\[plots\]'") as info:
        require("matplotlib", "plots", "--plot")
    assert info.value.name is None  # kvserve's own message, not an import that failed
    assert require("json", "none", "json") is sys.modules["json"]


def test_require_keeps_a_broken_dependency_error(monkeypatch, tmp_path):
    (tmp_path / "kvserve_broken_extra.py").write_text("import kvserve_missing_inner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("kvserve_broken_extra", "x", "a feature")
    assert info.value.name == "kvserve_missing_inner"


def test_redis_tier_without_the_client_names_the_redis_extra(monkeypatch):
    from kvserve.kv.tiers import RedisTier

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kvserve\[redis\]'"):
        RedisTier("redis://127.0.0.1:1/0")


def test_plot_without_matplotlib_is_a_clean_cli_error(monkeypatch, tmp_path, capsys):
    from kvserve.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", "SmolLM2-135M", "--plot", str(tmp_path / "kv.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --plot needs the 'matplotlib' package") and "kvserve[plots]" in err
    assert not (tmp_path / "kv.png").exists()
