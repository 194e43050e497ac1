"""The state record format (runtime/persist/records.py): arrays come back bit for bit; a truncated, bit-flipped,
foreign or wrong-version file is refused with one DamagedState line naming it, and nothing of it is returned."""

import os

import ml_dtypes
import numpy as np
import pytest

from decodert.artifact.artifact_files import FileRecord
from decodert.artifact.manifest import load_manifest
from decodert.errors import DamagedState, DecodertError
from decodert.runtime.persist import records
from decodert.runtime.persist.records import artifact_identity, read_record, write_record

ARRAYS = {"ids": np.arange(7, dtype=np.int64), "kv": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4),
          "bf": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16), "state0": np.frombuffer(b"\x01\x02\x03", np.uint8),
          "empty": np.zeros((0, 4), np.float16)}


def _write(path, identity="id1", kind="prefix-block"):
    return write_record(path, identity, kind, ARRAYS, meta={"key": "ab", "tokens": 7})


def test_round_trip_keeps_every_array_and_the_meta(tmp_path):
    n = _write(tmp_path / "a.rec")
    assert n == (tmp_path / "a.rec").stat().st_size
    rec = read_record(tmp_path / "a.rec", identity="id1", kind="prefix-block")
    assert rec.meta == {"key": "ab", "tokens": 7} and rec.kind == "prefix-block" and list(rec.arrays) == list(ARRAYS)
    for name, a in ARRAYS.items():
        assert rec.arrays[name].dtype == a.dtype and rec.arrays[name].shape == a.shape
        assert rec.arrays[name].tobytes() == a.tobytes()
    assert rec.arrays["kv"].flags.writeable  # a copy, not a view of the file's bytes
    assert [p.name for p in tmp_path.iterdir()] == ["a.rec"]  # no temp file left


def test_a_dtype_outside_the_table_is_refused(tmp_path):
    with pytest.raises(DecodertError, match="dtype object"):
        write_record(tmp_path / "o.rec", "id", "x", {"o": np.array([object()], dtype=object)})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("cut", [0, 5, 11, 40, -33, -1])
def test_truncated_files_are_refused(tmp_path, cut):
    path = tmp_path / "t.rec"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])
    with pytest.raises(DamagedState, match=str(path)) as e:
        read_record(path)
    assert "\n" not in str(e.value)


def test_every_flipped_byte_is_caught(tmp_path, rng):
    path = tmp_path / "f.rec"
    _write(path)
    data = bytearray(path.read_bytes())
    places = sorted(set(rng.integers(0, len(data), 40).tolist()) | {0, 9, 12, len(data) - 1, len(data) - 40})
    for at in places:
        bad = bytearray(data)
        bad[at] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(DamagedState, match="f.rec"):
            records.decode_record(bytes(bad), path)


def test_foreign_identity_kind_and_version_are_refused(tmp_path):
    path = tmp_path / "x.rec"
    _write(path, identity="other")
    with pytest.raises(DamagedState, match="another artifact"):
        read_record(path, identity="id1")
    _write(path)
    with pytest.raises(DamagedState, match="holds 'prefix-block', not 'session'"):
        read_record(path, kind="session")
    with pytest.MonkeyPatch.context() as mp:  # a record of a newer decodert
        mp.setattr(records, "FORMAT_VERSION", 2)
        _write(path)
    with pytest.raises(DamagedState, match="format version 2; this decodert reads version 1"):
        read_record(path)


def test_a_file_that_is_not_a_record_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes, not a record, long enough to hold a header and a digest of the file")
    with pytest.raises(DamagedState, match="not a decodert state record"):
        read_record(path)


def test_a_failed_write_leaves_the_old_record_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "a.rec"
    _write(path)
    before = path.read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        write_record(path, "id1", "prefix-block", {"x": np.ones(3, np.float32)})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["a.rec"]


def test_identity_changes_with_weights_graphs_dtype_kv_and_adapter(tiny_art):
    m = load_manifest(tiny_art("llama"))
    base = artifact_identity(m)
    assert base == artifact_identity(load_manifest(tiny_art("llama"))) and len(base) == 24
    other = FileRecord(size=1, sha256="0" * 64)
    changed = [
        m.replace(files={**m.files, m.weights.file: other}),
        m.replace(files={**m.files, m.graphs["decode"].file: other}),
        m.replace(dtype="fp16"),
        m.replace(kv_dtype="int8"),
        m.replace(kv=m.kv.replace(num_kv_heads=m.kv.num_kv_heads + 1)),
    ]
    keys = {base, artifact_identity(m, adapter="sql-abc")} | {artifact_identity(c) for c in changed}
    assert len(keys) == 2 + len(changed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(records, "STATE_VERSION", records.STATE_VERSION + 1)
        assert artifact_identity(m) != base
    with pytest.raises(DecodertError, match="no hash for weights"):
        artifact_identity(m.replace(files={k: v for k, v in m.files.items() if k != m.weights.file}))
