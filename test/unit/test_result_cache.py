"""The suites' result cache key (``test.support.neuron.result_cache.inputs_key``): the same tree in two clones gives
the same key (a second CI run on the machine must hit what the first stored), and any change to an input does not.

Oracle: two copies of a miniature repository built here, one with the ``*.egg-info`` folder an editable install may
leave under ``src/`` (text files the key once hashed, so a clone with it and one without never shared a result)."""

import shutil

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
