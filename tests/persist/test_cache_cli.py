"""`decodert cache list` shows the prefix disk tiers ($DECODERT_CACHE/prefix and --cache-dir); `cache clear --prefix`
deletes their files and nothing else; the exports listing is unchanged."""

import io
import json
import sys

import numpy as np
import pytest

from decodert.cli import main
from decodert.runtime.persist.records import write_record


def _tier(root, ident="ab" * 12, blocks=3):
    folder = root / ident
    folder.mkdir(parents=True)
    for k in range(blocks):
        write_record(folder / f"{k:032x}.blk", ident, "prefix-block", {"ids": np.arange(4), "kv": np.zeros(64, np.uint8)})
    (folder / "about.json").write_text(json.dumps({"artifact": "/models/tiny", "dtype": "fp32"}))
    return folder


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DECODERT_CACHE", str(cache))
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "m.gguf").write_bytes(b"x" * 100)
    default = _tier(cache / "prefix")
    other = _tier(tmp_path / "mine", ident="cd" * 12, blocks=2)
    user = [cache / "prefix" / "notes.txt", default / "keep.txt", other.parent / "data.bin",
            other / ("f" * 32 + ".blk")]  # the last one: a user's file under a block's name, no record magic
    for p in user:
        p.write_bytes(b"the user's")
    return cache, other.parent, user


def test_list_shows_the_tiers(dirs, capsys):
    cache, mine, _ = dirs
    assert main(["cache", "list", "--cache-dir", str(mine)]) == 0
    out = capsys.readouterr().out
    assert "models/m.gguf" in out  # the exports and downloads as before
    assert f"prefix disk tier {cache / 'prefix'}:" in out and f"{'ab' * 12}/  3 blocks  (/models/tiny, fp32)" in out
    assert f"prefix disk tier {mine}:" in out and f"{'cd' * 12}/  3 blocks" in out  # a look-alike counts by name


def test_clear_prefix_deletes_only_tier_files(dirs, capsys, monkeypatch):
    cache, mine, user = dirs
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["cache", "clear", "--prefix", "--cache-dir", str(mine)]) == 2  # no terminal, no --yes
    assert "--yes" in capsys.readouterr().err
    assert main(["cache", "clear", "--prefix", "--cache-dir", str(mine), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "deleted 4 files" in out and "deleted 3 files" in out  # 3 blocks + about.json; 2 blocks + about.json
    assert not list(cache.glob("prefix/*/*.blk")) and (cache / "models" / "m.gguf").is_file()
    assert all(p.read_bytes() == b"the user's" for p in user)
    assert main(["cache", "clear", "--cache-dir", str(mine)]) == 2
    assert "clear it with --prefix" in capsys.readouterr().err
