"""The typed manifest (artifact/manifest.py, artifact/records.py): schema versions, one-line field errors,
unknown keys kept on rewrite, and artifacts written by the dict-based exporter (format_version 1) loading."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest


from decodert.errors import DecodertError  # noqa: E402
from decodert.artifact.manifest import FORMAT_VERSION, Manifest, load_manifest, write_manifest  # noqa: E402
from decodert.artifact.records import Record, read_record, to_json  # noqa: E402


def _raw(art: Path) -> dict:
    return json.loads((art / "manifest.json").read_text())


def _rewrite(art: Path, raw: dict) -> None:
    (art / "manifest.json").write_text(json.dumps(raw))


def _one_line_error(art: Path, match: str) -> str:
    with pytest.raises(DecodertError, match=match) as e:
        load_manifest(art, verify="none")
    assert "\n" not in str(e.value) and "manifest.json" in str(e.value)
    return str(e.value)


def test_round_trip_is_the_same_json(art):
    m = load_manifest(art)
    assert isinstance(m, Manifest) and m.format_version == FORMAT_VERSION
    before = _raw(art)
    write_manifest(art, m)
    assert _raw(art) == before  # every key, nested ones too, comes back as it was read
    assert dataclasses.is_dataclass(m) and m.graphs["decode"].io()["logits"].shape == ("batch", m.model.vocab_size)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.max_seq = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.files["x"] = m.files["weights.bin"]  # type: ignore[index]


def test_newer_and_older_schema_versions_say_what_to_do(art):
    raw = _raw(art)
    _rewrite(art, {**raw, "format_version": FORMAT_VERSION + 1})
    assert "upgrade decodert or re-export" in _one_line_error(art, "written by a newer decodert")
    _rewrite(art, {**raw, "format_version": 0})
    assert "re-export the model with 'decodert export'" in _one_line_error(art, "too old")
    _rewrite(art, {**raw, "format_version": "1"})
    _one_line_error(art, "format_version is missing or not an integer; re-export")
    _rewrite(art, {**raw, "format": "something-else"})
    _one_line_error(art, "not a decodert artifact")


@pytest.mark.parametrize("path, value, match", [
    (("kv",), None, r"kv must be an object"),
    (("model", "vocab_size"), "512", r"model\.vocab_size must be an integer"),
    (("graphs", "decode", "inputs", 1, "shape"), [1.5], r"graphs\.decode\.inputs\[1\]\.shape\[0\] must be an integer or a string"),
    (("tokenizer", "add_bos_token"), 1, r"tokenizer\.add_bos_token must be true or false"),
    (("files", "weights.bin", "size"), True, r"files\.weights\.bin\.size must be an integer"),
])
def test_a_wrong_type_names_the_field(art, path, value, match):
    raw = _raw(art)
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    _rewrite(art, raw)
    _one_line_error(art, match)


@pytest.mark.parametrize("field", ["model", "kv", "graphs", "files", "max_seq"])
def test_a_missing_field_names_it(art, field):
    raw = _raw(art)
    del raw[field]
    _rewrite(art, raw)
    _one_line_error(art, f"{field} is missing")


def test_unknown_keys_survive_a_rewrite(art):
    """A newer decodert's extra fields are kept when this one rewrites the manifest (decodert build)."""
    raw = _raw(art)
    raw["future_field"] = {"a": [1, 2]}
    raw["kv"]["future_kv"] = "x"
    _rewrite(art, raw)
    m = load_manifest(art, verify="none")
    assert m.extra["future_field"] == {"a": [1, 2]} and m.kv.extra["future_kv"] == "x"
    write_manifest(art, m.replace(max_batch=1))
    again = _raw(art)
    assert again["future_field"] == {"a": [1, 2]} and again["kv"]["future_kv"] == "x" and again["max_batch"] == 1


def test_an_artifact_written_before_the_typed_manifest_loads(art):
    """format_version 1 as the dict-based exporter wrote it: no sampling, plugins, verify graph or vocab_size."""
    raw = _raw(art)
    for key in ("sampling", "plugins", "engines", "quant", "decodert_version", "onnx_version", "created", "source"):
        raw.pop(key, None)
    raw["graphs"].pop("verify", None)
    raw["tokenizer"].pop("vocab_size", None)
    _rewrite(art, raw)
    m = load_manifest(art, verify="none")
    assert m.sampling is None and m.plugin_ops == () and m.engines is None and "verify" not in m.graphs


def test_a_manifest_with_a_format_1_model_spec_loads_with_the_spec_converted(tmp_path):
    """An artifact exported before the layers were declared by kind (tests/fixtures/manifest_v1_qwen3_5.json, written
    by that exporter): its flat model dict reads as today's spec, the images / experts accessors read it, and a
    rewrite (``decodert build``) stores today's layout."""
    from tiny import tiny_config

    from decodert.models import family_for

    art = tmp_path / "old"
    art.mkdir()
    flat = json.loads((Path(__file__).parents[1] / "fixtures" / "manifest_v1_qwen3_5.json").read_text())
    assert "layer_kinds" in flat["model"] and "layers" not in flat["model"]
    _rewrite(art, flat)
    m = load_manifest(art, verify="none")
    config = tiny_config("qwen3_5")
    assert m.model.spec() == family_for(config["model_type"]).spec_from_hf(config)
    assert (m.model.num_layers, m.model.num_heads, m.model.head_dim, m.model.images, m.model.mrope) == (3, 4, 32, None, None)
    assert m.model.experts == (0, 0) and m.kv.layer_kinds == ("linear_attention", "attention", "linear_attention")
    write_manifest(art, m)
    again = _raw(art)
    assert again["model"]["spec_format"] == 2 and "layer_kinds" not in again["model"]
    assert load_manifest(art, verify="none").model.spec() == m.model.spec()
    assert {k: v for k, v in again.items() if k != "model"} == {k: v for k, v in flat.items() if k != "model"}


@dataclasses.dataclass(frozen=True)
class Sub(Record):
    n: int


@dataclasses.dataclass(frozen=True)
class Rec(Record):
    name: str
    sub: Sub | None = None
    new_field: tuple[int, ...] = ()  # the one line


def test_adding_a_field_is_one_line():
    """The recipe docs/ARCHITECTURE.md gives: a field with a default is read, checked and written."""
    r = read_record(Rec, {"name": "a", "new_field": [1, 2]}, "rec")
    assert r.new_field == (1, 2) and to_json(r) == {"name": "a", "sub": None, "new_field": [1, 2]}
    assert read_record(Rec, {"name": "a"}, "rec").new_field == ()  # files written before it still load
    with pytest.raises(DecodertError, match=r"^rec\.new_field\[1\] must be an integer$"):
        read_record(Rec, {"name": "a", "new_field": [1, "2"]}, "rec")
    with pytest.raises(DecodertError, match=r"^rec\.sub\.n is missing$"):
        read_record(Rec, {"name": "a", "sub": {}}, "rec")


@pytest.fixture(scope="module")
def gqa_art(tiny_checkpoint, tmp_path_factory):
    """An ort artifact whose prefill graph also runs one-row verify passes (GroupQueryAttention)."""
    from decodert.export.pipeline import export_model

    out = tmp_path_factory.mktemp("gqa") / "art"
    m = export_model(tiny_checkpoint("llama"), out, target="ort", max_seq=64, max_batch=2, progress=False)
    assert m.graphs["prefill"].verifies_rows
    return out


def _io_entry(raw: dict, kind: str, name: str) -> dict:
    return next(t for t in raw["graphs"][kind]["inputs"] + raw["graphs"][kind]["outputs"] if t["name"] == name)


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw["graphs"].pop("verify"), r"graphs\.prefill takes per_position but there is no graphs\.verify"),
    (lambda raw: _io_entry(raw, "prefill", "per_position").update(dtype="int32"),
     r"graphs\.prefill: 'per_position' is missing or disagrees with model\.vocab_size"),
    (lambda raw: _io_entry(raw, "prefill", "seq_logits").update(shape=["batch", "positions", 7]),
     r"graphs\.prefill: 'seq_logits' is missing"),
    (lambda raw: raw["graphs"]["prefill"]["outputs"].remove(_io_entry(raw, "prefill", "next_tokens")),
     r"graphs\.prefill: 'next_tokens' is missing"),
])
def test_a_damaged_one_row_verify_contract_is_one_line(gqa_art, tmp_path, damage, match):
    """The prefill graph's per_position input comes with its outputs and a verify graph beside it:
    a manifest that says otherwise is refused before any session opens."""
    art = shutil.copytree(gqa_art, tmp_path / "art")
    load_manifest(art, verify="none")  # intact, it loads
    raw = _raw(art)
    damage(raw)
    _rewrite(art, raw)
    _one_line_error(art, match)
