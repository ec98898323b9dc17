"""The suites' result cache key (``test.support.neuron.result_cache.inputs_key``): the same tree in two clones gives
the same key (a second CI run on the machine must hit what the first stored), and any change to an input does not.

Oracle: two copies of a miniature repository built here, one with the ``*.egg-info`` folder an editable install may
leave under ``src/`` (text files the key once hashed, so a clone with it and one without never shared a result); a
``constraints/`` file written here; a fake list of installed distributions (a changed pin, torch-xla's say, once
reused results stored under the old version)."""

import shutil
from types import SimpleNamespace

import pytest

from test.support.neuron import result_cache


def _repo(root, egg_info: bool):
    (root / "src" / "minimax_m3").mkdir(parents=True)
    (root / "src" / "minimax_m3" / "a.py").write_text("x = 1\n")
    (root / "test" / "support").mkdir(parents=True)
    (root / "test" / "support" / "b.py").write_text("y = 2\n")
    if egg_info:
        (root / "src" / "pkg.egg-info").mkdir()
        (root / "src" / "pkg.egg-info" / "SOURCES.txt").write_text(f"{root}/src/minimax_m3/a.py\n")
    return root


def test_two_clones_of_one_tree_share_keys_and_a_change_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv("NXDI_SRC", raising=False)
    monkeypatch.delenv("NXD_SRC", raising=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    keys = []
    for name, egg in (("one", True), ("two", False)):
        monkeypatch.setattr(result_cache, "REPO", _repo(tmp_path / name, egg))
        keys.append(result_cache.inputs_key("mod", ["--tp", "2"], [ckpt]))
    assert keys[0] == keys[1]
    (tmp_path / "two" / "src" / "minimax_m3" / "a.py").write_text("x = 3\n")
    assert result_cache.inputs_key("mod", ["--tp", "2"], [ckpt]) != keys[1]
    shutil.rmtree(tmp_path / "two" / "src" / "minimax_m3")
    _repo(tmp_path / "three", False)
    (ckpt / "config.json").write_text('{"a": 1}')
    monkeypatch.setattr(result_cache, "REPO", tmp_path / "three")
    assert result_cache.inputs_key("mod", ["--tp", "2"], [ckpt]) != keys[0]


def test_a_run_not_kept_runs_again_and_a_kept_one_does_not(tmp_path, monkeypatch):
    """``cached(keep=...)``: a launch that failed (a timeout, a taken port) is not stored; one that passed is read
    back, output folder and stdout, without running."""
    monkeypatch.setenv("MINIMAX_M3_TRACE_CACHE", str(tmp_path / "cache"))
    ran = []

    def produce(rc):
        def run():
            ran.append(rc)
            (tmp_path / "out").mkdir(exist_ok=True)
            (tmp_path / "out" / "report.txt").write_text(f"rc={rc}")
            return f"rc={rc}"
        return run

    keep = lambda stdout: stdout == "rc=0"  # noqa: E731
    for rc in (1, 1, 0, 0):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        got = result_cache.cached("launch", ["2"], [], tmp_path / "out", produce(rc), keep=keep)
        assert (tmp_path / "out" / "report.txt").read_text() == got
    assert ran == [1, 1, 0]  # the failed run ran twice, the passing one once: the fourth call read it back


@pytest.fixture
def fresh_versions():
    """``installed_versions`` is read once per process: clear it around a test that fakes the installed set."""
    result_cache.installed_versions.cache_clear()
    yield
    result_cache.installed_versions.cache_clear()


def test_a_changed_pin_or_installed_version_changes_the_key(tmp_path, monkeypatch, fresh_versions):
    monkeypatch.delenv("NXDI_SRC", raising=False)
    monkeypatch.delenv("NXD_SRC", raising=False)
    root = _repo(tmp_path / "repo", False)
    monkeypatch.setattr(result_cache, "REPO", root)
    (root / "constraints").mkdir()
    (root / "constraints" / "nxdi.txt").write_text("torch-xla==2.9.0\n")
    dists = [("torch-xla", "2.9.0"), ("Zeta_Pkg", "1.0"), ("numpy", "2.1.0")]
    monkeypatch.setattr(result_cache.importlib.metadata, "distributions", lambda: [
        SimpleNamespace(metadata={"Name": n}, version=v) for n, v in dists])

    def key():
        result_cache.installed_versions.cache_clear()
        return result_cache.inputs_key("mod", ["--tp", "2"], [])

    first = key()
    assert result_cache.installed_versions() == (("numpy", "2.1.0"), ("torch-xla", "2.9.0"), ("zeta-pkg", "1.0"))
    dists.reverse()  # the order distributions are found in is not an input
    assert key() == first
    dists[-1] = ("torch-xla", "2.9.1")
    bumped = key()
    assert bumped != first
    dists[-1] = ("torch-xla", "2.9.0")
    assert key() == first
    dists.append(("vllm", "0.13.0"))
    assert key() != first
    dists.pop()
    (root / "constraints" / "nxdi.txt").write_text("torch-xla==2.9.1\n")
    pinned = key()
    assert pinned not in (first, bumped)
    (root / "constraints" / "vllm.txt").write_text("vllm==0.13.0\n")
    assert key() not in (first, bumped, pinned)
    shutil.rmtree(root / "constraints")
    assert key() not in (first, bumped, pinned)
