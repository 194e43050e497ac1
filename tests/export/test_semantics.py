"""Checkpoints that are structurally valid but semantically wrong are refused in one line
(export/lowering/semantics.py, the running-offset rule in export/checkpoints/gguf_header.py), as llama.cpp does."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading

import gguf
import numpy as np
import pytest

from decodert.cli import main as cli_main
from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from fuzz_samples import make_gguf
from fuzz_harness import gguf_field


def _refused(path, match):
    with pytest.raises(DecodertError, match=match) as e:
        ckpt = open_checkpoint(path)
        for name in ckpt.names():
            ckpt.tensor(name)
            if ckpt.block_type(name):
                ckpt.blocks(name)
    assert "\n" not in str(e.value)
    return str(e.value)


def _edited(samples, tmp_path, *edits):
    path = tmp_path / "edited.gguf"
    path.write_bytes(gguf_field(samples["gguf"].read_bytes(), *edits))
    return path


def test_the_pristine_sample_passes(samples):
    ckpt = open_checkpoint(samples["gguf"])
    assert all(np.isfinite(ckpt.tensor(n)).all() for n in ckpt.names())


@pytest.mark.parametrize("layers", [1])
def test_block_count_below_the_blocks_present(samples, tmp_path, layers):
    message = _refused(_edited(samples, tmp_path, ("'llama.block_count'", layers)), "declares 1 layers")
    assert "blk.1." in message and "layer 1" in message


def test_a_tensor_the_model_does_not_use(tmp_path):
    path = make_gguf(tmp_path / "x.gguf", extra_tensors={"mystery.weight": np.ones(32)})
    assert "mystery.weight" in _refused(path, "tensors the model does not use")


def test_hf_layers_past_num_hidden_layers(samples, tmp_path):
    hf = shutil.copytree(samples["hf"], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert "model.layers.1." in _refused(hf, "declares 1 layers")


# The second tensor (output_norm.weight) starts at byte 38400 of the data section, right after token_embd.
@pytest.mark.parametrize("offset,what", [(0, "aliases token_embd"), (38400 - 32, "overlaps it"),
                                         (38400 + 32, "leaves a gap"), (38400 + (1 << 20), "1 MiB into other data")])
def test_tensor_data_must_start_at_the_running_offset(samples, tmp_path, offset, what):
    path = _edited(samples, tmp_path, ("data offset of tensor 'output_norm.weight'", offset))
    _refused(path, f"'output_norm.weight' data offset {offset} is not 38400|past the end")


def _poke(path, tensor, data: bytes, at: int = 0):
    """Overwrite bytes of one tensor's data in place."""
    start = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    with open(path, "r+b") as f:
        f.seek(start + at)
        f.write(data)


@pytest.mark.parametrize("tensor,data", [
    ("token_embd.weight", struct.pack("<f", math.nan)),  # F32
    ("blk.0.attn_output.weight", struct.pack("<e", math.inf)),  # F16
    ("blk.0.ffn_up.weight", struct.pack("<e", math.inf)),  # Q8_0 block scale (transcoded exactly too)
    ("blk.1.ffn_gate.weight", struct.pack("<e", math.nan)),  # Q4_0 block scale
    ("blk.0.ffn_down.weight", struct.pack("<e", math.inf)),  # Q4_K super-block scale
])
def test_non_finite_weights_after_dequantization(samples, tmp_path, tensor, data):
    path = tmp_path / "nan.gguf"
    shutil.copyfile(samples["gguf"], path)
    _poke(path, tensor, data)
    _refused(path, f"tensor '{tensor}' holds \\d+ NaN or infinite values")


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_bad_rms_epsilon(samples, tmp_path, value):
    _refused(_edited(samples, tmp_path, ("'llama.attention.layer_norm_rms_epsilon'", value)),
             "rms_norm_eps is .*finite number > 0")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_bad_rope_freq_base(tmp_path, value):
    _refused(make_gguf(tmp_path / "x.gguf", meta={"llama.rope.freq_base": value}), "rope theta .* finite number > 0")


def test_bpe_vocabulary_without_merges(tmp_path):
    ckpt = open_checkpoint(make_gguf(tmp_path / "x.gguf", merges=False))
    with pytest.raises(DecodertError, match="without tokenizer.ggml.merges"):
        ckpt.write_tokenizer(tmp_path / "tok")


def test_a_fifo_source_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    codes = []
    worker = threading.Thread(target=lambda: codes.append(cli_main(["export", str(fifo), "-o", str(tmp_path / "o")])),
                              daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # unblock the open() before failing
        with open(fifo, "wb"):
            pass
    assert codes == [2] and "not a regular file" in capsys.readouterr().err


def test_the_cli_refuses_a_nan_weight_in_one_line(samples, tmp_path, capsys):
    path = tmp_path / "nan.gguf"
    shutil.copyfile(samples["gguf"], path)
    _poke(path, "output.weight", struct.pack("<f", math.nan), at=4 * 100)
    assert cli_main(["export", str(path), "-o", str(tmp_path / "out"), "--max-seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'output.weight' holds 1 NaN" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("template", [5, ["a"], [{"name": "default", "template": 7}]])
def test_a_chat_template_that_is_not_text(samples, tmp_path, template):
    hf = shutil.copytree(samples["hf"], tmp_path / "hf")
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(DecodertError, match="chat_template is a"):
        open_checkpoint(hf).write_tokenizer(tmp_path / "tok")


def test_a_tokenizer_larger_than_the_model_is_refused(samples, tmp_path):
    from tokenizers import Tokenizer

    from decodert.export.pipeline import export_model

    hf = shutil.copytree(samples["hf"], tmp_path / "hf")
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    tok.add_tokens(["<|one-too-many|>"])
    tok.save(str(hf / "tokenizer.json"))
    with pytest.raises(DecodertError, match="tokenizer has 301 tokens but the model embeds only 300"):
        export_model(hf, tmp_path / "out", max_seq=32, progress=False)


def test_a_replaced_smaller_tokenizer_is_refused_at_load(samples, tmp_path):
    from tokenizers import Tokenizer

    from decodert.artifact.artifact_files import file_record
    from decodert.artifact.manifest import MANIFEST, load_manifest, write_manifest
    from decodert.runtime.llm import LLM

    art = shutil.copytree(samples["art"], tmp_path / "art")
    assert json.loads((art / MANIFEST).read_text())["tokenizer"]["vocab_size"] == 300
    tok = json.loads(Tokenizer.from_file(str(art / "tokenizer.json")).to_str())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if not t["content"].startswith("<|x")]
    tok["model"]["vocab"] = {k: v for k, v in tok["model"]["vocab"].items() if v < 250}
    tok["model"]["merges"] = []
    (art / "tokenizer.json").write_text(json.dumps(tok))
    manifest = load_manifest(art, verify="none")
    write_manifest(art, manifest.replace(files={**manifest.files, "tokenizer.json": file_record(art / "tokenizer.json")}))
    with pytest.raises(DecodertError, match="tokenizer was replaced"):
        LLM.load(art)


def test_a_chat_template_jinja_that_is_not_utf8(samples, tmp_path):
    hf = shutil.copytree(samples["hf"], tmp_path / "hf")
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    (hf / "chat_template.jinja").write_bytes(b"{{ 'caf\xe9' }}")
    with pytest.raises(DecodertError, match="chat_template.jinja: cannot be read as UTF-8"):
        open_checkpoint(hf).write_tokenizer(tmp_path / "tok")
