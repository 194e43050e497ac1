"""The prefix cache's disk tier (runtime/persist/disk_tier.py) on tiny exported models: a new LLM.load on the same
artifact and cache_dir starts with the blocks an earlier one stored, and its greedy tokens equal a cold run's, for a
dense model, hybrids (states at the boundaries) and the emulated trt backend; damaged, foreign or wrong-version files,
a full disk, a read-only folder and two processes on one folder never give a wrong token, never crash, warn once,
and leave every file that is not the tier's alone."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trt_emulator  # noqa: E402

from decodert.errors import DecodertError
from decodert.runtime.llm import LLM
from decodert.runtime.persist import disk_tier, records

NEW = 8


def _prompt(seed: int = 0, n: int = 100) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 200, n)


def _cold(art: Path, prompt: np.ndarray, backend: str = "ort") -> list[int]:
    with LLM.load(art, backend=backend, prefix_cache_mb=0) as llm:
        return llm.generate(prompt, max_new_tokens=NEW, temperature=0).token_ids


def _run(art: Path, cache_dir: Path, prompt: np.ndarray, backend: str = "ort", **kw):
    """One process's life: load with the disk tier, generate greedily, close (the writer finishes) -> (result, stats)."""
    with LLM.load(art, backend=backend, cache_dir=cache_dir, **kw) as llm:
        result = llm.generate(prompt, max_new_tokens=NEW, temperature=0)
        stats = llm.prefix_cache.stats
    return result, stats


def _blocks(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*/*.blk"))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "decodert.prefix_disk" and r.levelno == logging.WARNING]


@pytest.fixture
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


# ---------------------------------------------------------------- restarts
@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen3_5"])
def test_a_restart_loads_from_disk_and_answers_as_cold(tiny_art, tmp_path, family):
    art, prompt = tiny_art(family), _prompt()
    cold = _cold(art, prompt)
    first, s1 = _run(art, tmp_path / "cd", prompt)
    assert first.token_ids == cold and s1.disk_written_blocks >= 3 and s1.disk_hits == 0
    second, s2 = _run(art, tmp_path / "cd", prompt)
    assert second.token_ids == cold
    assert second.metrics.cached_tokens == 96 and s2.disk_hits == 1 and s2.disk_hit_tokens == 96
    longer = np.r_[prompt, _prompt(1, 40)]  # shares 3 blocks with it: loads them, prefills the rest
    third, _ = _run(art, tmp_path / "cd", longer)
    assert third.token_ids == _cold(art, longer) and third.metrics.cached_tokens == 96


def test_hybrid_files_keep_the_states_at_the_boundary(tiny_art, tmp_path):
    art = tiny_art("lfm2")
    _run(art, tmp_path / "cd", _prompt())
    with_states = [p for p in _blocks(tmp_path / "cd") if records.read_record(p).meta["states"]]
    assert len(with_states) == 1  # the block ending at 96, the prompt's last whole block boundary


def test_trt_backend_emulated_restart_and_ort_files_on_trt(tiny_art, tmp_path, emulator):
    art = tiny_art("llama", target="trt")
    trt_emulator.emulate_engines(art, max_seq=64, scratch={"prefill": 8192, "decode": 4096, "verify": 16384})
    prompt = _prompt()
    cold = _cold(art, prompt, backend="trt")
    first, _ = _run(art, tmp_path / "trt", prompt, backend="trt")
    second, stats = _run(art, tmp_path / "trt", prompt, backend="trt")
    assert first.token_ids == second.token_ids == cold and second.metrics.cached_tokens == 96 and stats.disk_hits == 1
    _run(art, tmp_path / "ort", prompt, backend="ort")  # written by the ort backend (host blocks) ...
    third, stats = _run(art, tmp_path / "ort", prompt, backend="trt")  # ... read into device blocks
    assert third.token_ids == cold and stats.disk_hits == 1


def test_a_restart_with_another_block_size_or_artifact_misses(tiny_art, tmp_path):
    art, prompt = tiny_art("llama"), _prompt()
    _run(art, tmp_path / "cd", prompt)
    result, stats = _run(tiny_art("llama", max_seq=160), tmp_path / "cd", prompt)  # another export: another identity
    assert stats.disk_hits == 0 and result.metrics.cached_tokens == 0
    assert len({p.parent.name for p in _blocks(tmp_path / "cd")}) == 2


# ---------------------------------------------------------------- hostile files
def _damage(path: Path, how: str, tmp_path: Path, art: Path) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flipped":
        flipped = bytearray(data)
        flipped[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(flipped))
    elif how == "foreign":  # a whole, valid record of another artifact under this name
        rec = records.read_record(path)
        records.write_record(path, "0" * 24, rec.kind, rec.arrays, rec.meta)
    elif how == "version":
        rec = records.read_record(path)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(records, "FORMAT_VERSION", records.FORMAT_VERSION + 1)
            records.write_record(path, rec.identity, rec.kind, rec.arrays, rec.meta)
    elif how == "wrong-kv":  # the right record, another K/V size (a block of another geometry)
        rec = records.read_record(path)
        records.write_record(path, rec.identity, rec.kind, {**rec.arrays, "kv": rec.arrays["kv"][:-4]}, rec.meta)


@pytest.mark.parametrize("how", ["truncated", "empty", "flipped", "foreign", "version", "wrong-kv"])
def test_a_damaged_block_is_skipped_once_and_deleted(tiny_art, tmp_path, caplog, how):
    art, prompt = tiny_art("llama"), _prompt()
    cold = _cold(art, prompt)
    cd = tmp_path / "cd"
    _run(art, cd, prompt)
    blocks = _blocks(cd)
    ident = blocks[0].parent
    mine = [tmp_path / "cd" / "notes.txt", ident / "keep.me", ident / ("ab" * 16 + ".blk.txt")]
    for p in mine:
        p.write_text("the user's file")
    second_block = _second_block(art, cd, prompt)
    _damage(second_block, how, tmp_path, art)
    caplog.set_level(logging.WARNING, logger="decodert.prefix_disk")
    result, stats = _run(art, cd, prompt)
    assert result.token_ids == cold
    assert result.metrics.cached_tokens == 32  # the first block only; the damaged second ends the chain
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(second_block) in warned[0] and "\n" not in warned[0], warned
    assert stats.disk_damaged == 1
    assert all(p.read_text() == "the user's file" for p in mine)
    again, _ = _run(art, cd, prompt)  # stored again by the run above, read whole now
    assert again.token_ids == cold and again.metrics.cached_tokens == 96


def _second_block(art: Path, cd: Path, prompt: np.ndarray) -> Path:
    """The file of the prompt's second block (the chain from the empty key)."""
    from decodert.runtime.prefix_cache import _chain_key

    key = _chain_key(_chain_key(b"", prompt[:32]), prompt[32:64])
    (path,) = [p for p in _blocks(cd) if p.name == f"{key.hex()}.blk"]
    return path


def test_a_file_named_like_a_block_but_not_one_is_never_loaded_nor_deleted(tiny_art, tmp_path, caplog):
    art, prompt = tiny_art("llama"), _prompt()
    cd = tmp_path / "cd"
    _run(art, cd, prompt)
    second = _second_block(art, cd, prompt)
    text = "a user's text under a block's name, long enough to pass for a header and a digest"
    second.write_text(text)
    caplog.set_level(logging.WARNING, logger="decodert.prefix_disk")
    cold = _cold(art, prompt)
    with LLM.load(art, cache_dir=cd) as llm:
        for _ in range(2):
            llm.prefix_cache.clear()  # only the disk can give the blocks
            result = llm.generate(prompt, max_new_tokens=NEW, temperature=0)
            assert result.token_ids == cold and result.metrics.cached_tokens == 32
    warned = _warnings(caplog)
    assert len(warned) == 1 and "left as it is" in warned[0]
    assert second.read_text() == text  # neither deleted nor written over


def test_a_full_disk_turns_the_tier_off_with_one_warning(tiny_art, tmp_path, caplog, monkeypatch):
    art = tiny_art("llama")
    caplog.set_level(logging.WARNING, logger="decodert.prefix_disk")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_record", full)
    with LLM.load(art, cache_dir=tmp_path / "cd") as llm:
        answers = [llm.generate(_prompt(s), max_new_tokens=NEW, temperature=0).token_ids for s in range(3)]
        assert llm.prefix_cache.disk.flush()
        assert not llm.prefix_cache.disk.enabled
        again = llm.generate(_prompt(0), max_new_tokens=NEW, temperature=0)  # the memory tier goes on
        assert again.metrics.cached_tokens == 96
    assert answers == [_cold(art, _prompt(s)) for s in range(3)] and again.token_ids == answers[0]
    warned = _warnings(caplog)
    assert len(warned) == 1 and "No space left on device" in warned[0] and "off" in warned[0]
    assert not _blocks(tmp_path / "cd")


def test_a_read_only_folder_turns_the_tier_off_at_load(tiny_art, tmp_path, caplog, monkeypatch):
    art = tiny_art("llama")
    caplog.set_level(logging.WARNING, logger="decodert.prefix_disk")
    (tmp_path / "ro").mkdir()
    if os.geteuid() != 0:  # a real read-only folder; root writes anyway, so there the file system's answer is patched
        (tmp_path / "ro").chmod(0o555)
    else:
        def read_only(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(disk_tier.tempfile, "mkstemp", read_only)
    try:
        result, stats = _run(art, tmp_path / "ro", _prompt())
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert result.token_ids == _cold(art, _prompt()) and stats.disk_written_blocks == 0
    warned = _warnings(caplog)
    assert len(warned) == 1 and "ro" in warned[0] and "off" in warned[0]


def test_a_full_queue_drops_writes_instead_of_waiting(tiny_art, tmp_path, monkeypatch):
    art = tiny_art("llama")
    monkeypatch.setattr(disk_tier, "DEFAULT_QUEUE_BYTES", 1000)  # less than one block
    with LLM.load(art, cache_dir=tmp_path / "cd") as llm:
        llm.prefix_cache.disk.queue_bytes = 1000
        assert llm.generate(_prompt(), max_new_tokens=NEW, temperature=0).token_ids == _cold(art, _prompt())
        stats = llm.prefix_cache.stats
    assert stats.disk_dropped >= 3 and stats.disk_written_blocks == 0 and not _blocks(tmp_path / "cd")


def test_the_budget_deletes_the_least_recently_used_leaves(tiny_art, tmp_path):
    art = tiny_art("llama")
    cd = tmp_path / "cd"
    _run(art, cd, _prompt(0))
    one = _blocks(cd)[0].stat().st_size
    budget_gb = 7.5 * one / 1e9  # room for 7 blocks: two prompts of 3 fit, the third evicts
    for seed in (0, 1, 2):
        _run(art, cd, _prompt(seed), cache_dir_gb=budget_gb)
    total = sum(p.stat().st_size for p in _blocks(cd))
    assert total <= budget_gb * 1e9
    result, stats = _run(art, cd, _prompt(2), cache_dir_gb=budget_gb)  # the newest chain is whole
    assert result.metrics.cached_tokens == 96
    result, _ = _run(art, cd, _prompt(0), cache_dir_gb=budget_gb)  # the oldest lost its last block(s) first
    assert result.metrics.cached_tokens < 96 and result.token_ids == _cold(art, _prompt(0))


def test_two_processes_share_one_folder(tiny_art, tmp_path):
    art = tiny_art("llama")
    cd = tmp_path / "cd"
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from decodert.runtime.llm import LLM
        seed = int(sys.argv[1])
        shared = np.random.default_rng(0).integers(3, 200, 64)
        with LLM.load({str(art)!r}, cache_dir={str(cd)!r}) as llm:
            for k in range(6):
                tail = np.random.default_rng(seed * 100 + k).integers(3, 200, 40)
                r = llm.generate(np.r_[shared, tail], max_new_tokens=4, temperature=0)
                print(r.metrics.cached_tokens, *r.token_ids)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for s in (1, 2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert not any("prefix cache" in err for _, err in outs), [o[1][-2000:] for o in outs]  # no damaged file seen
    shared = np.random.default_rng(0).integers(3, 200, 64)
    with LLM.load(art, prefix_cache_mb=0) as cold:
        for seed, (out, _) in zip((1, 2), outs):
            for k, line in enumerate(out.split("\n")[:6]):
                tail = np.random.default_rng(seed * 100 + k).integers(3, 200, 40)
                want = cold.generate(np.r_[shared, tail], max_new_tokens=4, temperature=0).token_ids
                assert [int(x) for x in line.split()[1:]] == want
    for path in _blocks(cd):
        records.read_record(path)  # every file whole
    result, stats = _run(art, cd, np.r_[shared, _prompt(9, 40)])
    assert stats.disk_hits == 1 and result.metrics.cached_tokens == 64


def test_load_arguments_are_checked(tiny_art, tmp_path):
    art = tiny_art("llama")
    with pytest.raises(DecodertError, match="cache_dir_gb must be a number > 0"):
        LLM.load(art, cache_dir=tmp_path, cache_dir_gb=0)
    with pytest.raises(DecodertError, match="give cache_dir"):
        LLM.load(art, cache_dir_gb=1)
    with pytest.raises(DecodertError, match="prefix_cache_mb is 0"):
        LLM.load(art, cache_dir=tmp_path, prefix_cache_mb=0)
