"""Embeddings (export/lowering/embed_graph.py, runtime/embedding.py): tiny random embedding checkpoints against
transformers' own vectors (AutoModel's last hidden state, pooled as the checkpoint says, the Dense layers in numpy,
normalised; sentence-transformers is not installed here), batch == singles, the pooling rules, ``dimensions``,
the one-line errors, and the artifact without the graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from decodert.artifact.manifest import load_manifest
from decodert.cli import main as cli_main
from decodert.errors import DecodertError, RequestError
from decodert.export.pipeline import export_model
from decodert.runtime.llm import LLM
from tiny import make_tiny_checkpoint
from tiny_embedding import make_tiny_embedding, reference_vectors

# held-out texts of different lengths (none is in the tokenizer's training corpus)
TEXTS = ["Quartz watches hum.", "A", "Seventeen violet kites drifted over the harbour while gulls argued.",
         "zebra 42 ~ umbrella", "The committee postponed its decision until the spring meeting of next year."]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """A Qwen3-Embedding-style checkpoint (qwen3, last-token pooling, <|endoftext|> appended) and its ort export."""
    root = tmp_path_factory.mktemp("qwen3_embedding")
    src = make_tiny_embedding(root / "hf")
    out = root / "art"
    export_model(src, out, max_seq=64, max_batch=2, progress=False)  # an embedding checkpoint: embed.onnx by default
    return src, out


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_qwen3_embedding_matches_transformers(qwen3_embedding, tmp_path, target):
    src, out = qwen3_embedding
    if target != "ort":
        out = tmp_path / target
        export_model(src, out, target=target, max_seq=64, max_batch=2, progress=False)
    llm = LLM.load(out)
    m = load_manifest(out)
    assert (m.embedding.pooling, m.embedding.causal, m.embedding.matryoshka) == ("last", True, True)
    vectors = llm.embed(TEXTS)  # 5 texts over max_batch 2: three calls
    expected = reference_vectors(src, TEXTS, "lasttoken", padding_side="left")  # the model card's left padding
    assert vectors.shape == (len(TEXTS), 64) and vectors.dtype == np.float32
    assert np.abs(vectors - expected).max() < 1e-4
    assert (vectors * expected).sum(axis=1).min() > 0.9999
    singles = np.concatenate([llm.embed(t) for t in TEXTS])
    assert np.abs(vectors - singles).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_the_tokenizers_special_tokens_count(qwen3_embedding):
    """Text is encoded with the tokenizer's post-processor (Qwen3-Embedding appends <|endoftext|>), ids as given."""
    _, out = qwen3_embedding
    llm = LLM.load(out)
    ids = llm.embedder.token_ids(["Quartz watches hum."])[0]
    assert ids[-1] == 0 and ids[-2] != 0
    assert np.abs(llm.embed([ids.tolist()]) - llm.embed("Quartz watches hum.")).max() < 1e-6
    assert np.abs(llm.embed(ids[:-1].tolist()) - llm.embed("Quartz watches hum.")).max() > 1e-3  # without: another vector


def test_matryoshka_dimensions_truncate_then_renormalise(qwen3_embedding):
    src, out = qwen3_embedding
    llm = LLM.load(out)
    short = llm.embed(TEXTS[:3], dimensions=16)
    assert short.shape == (3, 16)
    assert np.abs(short - reference_vectors(src, TEXTS[:3], dimensions=16)).max() < 1e-4
    with pytest.raises(RequestError, match="dimensions 65: this model's vectors have 64 dimensions; it allows 1 to 64"):
        llm.embed("x", dimensions=65)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_mean_and_cls_pooling_with_dense_layers(tmp_path, pooling):
    src = make_tiny_embedding(tmp_path / "hf", family="llama", pooling=pooling, dense=(48, 24), append_eos=False)
    out = tmp_path / "art"
    export_model(src, out, max_seq=64, max_batch=3, progress=False)
    m = load_manifest(out, verify="full")
    assert m.embedding.pooling == pooling and m.embedding.dimensions == 24 and not m.embedding.matryoshka
    assert [d.out_features for d in m.embedding.dense] == [48, 24]
    llm = LLM.load(out)
    vectors = llm.embed(TEXTS)
    expected = reference_vectors(src, TEXTS, pooling, padding_side="right")
    assert vectors.shape == (len(TEXTS), 24)
    assert np.abs(vectors - expected).max() < 1e-4 and (vectors * expected).sum(axis=1).min() > 0.9999
    assert np.abs(vectors - np.concatenate([llm.embed(t) for t in TEXTS])).max() < 1e-5
    with pytest.raises(RequestError, match="dimensions 8: this model's vectors have 24 dimensions; it allows only 24"):
        llm.embed("x", dimensions=8)
    assert llm.embed("x", dimensions=24).shape == (1, 24)


def test_plain_causal_lm_defaults_to_last_token(tmp_path):
    """A checkpoint without sentence-transformers files: embed.onnx only when asked, last-token pooling."""
    src = make_tiny_checkpoint("llama", tmp_path / "hf")
    plain = tmp_path / "plain"
    export_model(src, plain, max_seq=64, max_batch=2, progress=False)
    assert load_manifest(plain).embedding is None and not (plain / "embed.onnx").exists()
    assert "embedding" not in json.loads((plain / "manifest.json").read_text())  # the manifest as before
    with pytest.raises(DecodertError, match="has no embedding graph; re-export the model with .*--embeddings"):
        LLM.load(plain).embed("hi")
    out = tmp_path / "art"
    export_model(src, out, max_seq=64, max_batch=2, progress=False, embeddings=True)
    m = load_manifest(out)
    assert m.embedding.pooling == "last" and m.embedding.source.startswith("default: last-token")
    graph = onnx.load(str(out / "embed.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]  # the ort target's own prompt kernel over no cache; no lm_head read
    assert ops.count("GroupQueryAttention") == 2 and [i.name for i in graph.input] == ["input_ids", "seq_lengths"]
    assert "lm_head" not in {i.name for i in graph.initializer}
    for kind in ("prefill", "decode", "verify"):  # the generation graphs do not change
        assert (out / f"{kind}.onnx").read_bytes() == (plain / f"{kind}.onnx").read_bytes()
    vectors = LLM.load(out).embed(TEXTS)
    expected = reference_vectors(src, TEXTS, "lasttoken", padding_side="right")
    assert np.abs(vectors - expected).max() < 1e-4


def test_bad_inputs_are_one_line_errors(qwen3_embedding):
    _, out = qwen3_embedding
    llm = LLM.load(out)
    cases = [([], "input must be a non-empty list"), ("word " * 80, "input\\[0\\] has \\d+ tokens; this model takes "
                                                                   "at most 64"),
             ([[]], "input\\[0\\] has no tokens"), ([[5, 999]], "token id 999 is not below the vocabulary size 512"),
             (["ok", 3.5], "input\\[1\\] is a float"), ("x", None)]
    for value, message in cases:
        if message is None:
            assert llm.embed(value).shape == (1, 64)
            continue
        with pytest.raises(RequestError, match=message) as e:
            llm.embed(value)
        assert "\n" not in str(e.value)
    # an empty text: the tokenizer's own encoding (here its appended <|endoftext|>) is embedded
    assert llm.embed("").shape == (1, 64)


def test_embed_cli(qwen3_embedding, tmp_path, capsys):
    src, out = qwen3_embedding
    assert cli_main(["embed", str(out), TEXTS[0], TEXTS[2]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1]
    got = np.array([x["embedding"] for x in lines], np.float32)
    assert np.abs(got - reference_vectors(src, [TEXTS[0], TEXTS[2]])).max() < 1e-4
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n\n")
    npy = tmp_path / "v.npy"
    assert cli_main(["embed", str(out), "--file", str(texts), "-o", str(npy), "--dimensions", "32"]) == 0
    assert np.load(npy).shape == (len(TEXTS), 32)
    capsys.readouterr()
    for argv, message in [([str(out), "a", "--dimensions", "99"], "dimensions 99"),
                          ([str(out)], "give the texts as arguments or --file"),
                          ([str(out), "a", "-o", str(tmp_path / "v.txt")], "name the file \\*.npy")]:
        assert cli_main(["embed", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("decodert: error:")
        assert __import__("re").search(message, err)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "gpt_oss", "qwen3_moe", "phi3", "smollm3"])
def test_families_last_hidden_state_matches_transformers(tmp_path, family):
    """Sliding windows with local RoPE (gemma3), softcapping (gemma2), sinks and experts (gpt_oss), experts
    (qwen3_moe), partial rotary (phi3), NoPE layers and tied embeddings (smollm3): the decoder's own body."""
    src = make_tiny_checkpoint(family, tmp_path / "hf")
    export_model(src, tmp_path / "art", max_seq=64, max_batch=2, progress=False, embeddings=True)
    vectors = LLM.load(tmp_path / "art").embed(TEXTS)
    assert np.abs(vectors - reference_vectors(src, TEXTS, "lasttoken", padding_side="right")).max() < 1e-4


@pytest.mark.parametrize("family, message", [("lfm2", "lfm2 has layers with conv or recurrent state"),
                                             ("gemma4", "gemma4 has layers that read another layer's K/V")])
def test_models_embed_onnx_cannot_take_are_refused_in_one_line(tmp_path, family, message):
    src = make_tiny_checkpoint(family, tmp_path / "hf")
    with pytest.raises(DecodertError, match=f"--embeddings: {message}"):
        export_model(src, tmp_path / "art", max_seq=64, max_batch=2, progress=False, embeddings=True)
    assert not (tmp_path / "art" / "manifest.json").exists()


def test_embeddinggemma_style_bidirectional_mean_dense(tmp_path):
    """gemma3_text with use_bidirectional_attention (a bare Gemma3TextModel, sliding layers |i - j| < window//2 + 1),
    mean pooling and two Dense layers: transformers' AutoModel + the Dense layers in numpy (sentence-transformers is
    not installed here). Batch == singles holds although every valid token sees the later ones."""
    src = make_tiny_embedding(tmp_path / "hf", family="gemma3", pooling="mean", dense=(128, 64), append_eos=False,
                              bidirectional=True)
    with pytest.raises(DecodertError, match="use_bidirectional_attention=true is an embedding model"):
        export_model(src, tmp_path / "plain", max_seq=64, max_batch=2, progress=False, embeddings=False)
    out = tmp_path / "art"
    export_model(src, out, max_seq=64, max_batch=2, progress=False)
    m = load_manifest(out)
    assert (m.embedding.pooling, m.embedding.causal, m.embedding.dimensions, m.embedding.matryoshka) == \
        ("mean", False, 64, True)
    llm = LLM.load(out)
    vectors = llm.embed(TEXTS)
    expected = reference_vectors(src, TEXTS, "mean", padding_side="right")
    assert np.abs(vectors - expected).max() < 1e-4 and (vectors * expected).sum(axis=1).min() > 0.9999
    assert np.abs(vectors - np.concatenate([llm.embed(t) for t in TEXTS])).max() < 1e-5
    with pytest.raises(RequestError, match="embedding model with bidirectional attention .* does not generate"):
        llm.generate("hello", max_new_tokens=2)
