"""``POST /v1/embeddings`` (serve/protocols/embeddings.py) on loopback, driven by the openai client and raw httpx: a tiny
Qwen3-Embedding-style model and SmolLM2 exported as `decodert serve smollm2` exports it (the cache's export)."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from serve_helpers import running  # noqa: E402
from tiny_embedding import make_tiny_embedding, reference_vectors  # noqa: E402

from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.llm import LLM  # noqa: E402
from decodert.serve.protocols.embeddings import MAX_ITEMS  # noqa: E402

TEXTS = ["Quartz watches hum.", "Seventeen violet kites drifted over the harbour.", "zebra 42"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_embed")
    src = make_tiny_embedding(root / "hf")
    export_model(src, root / "art", max_seq=64, max_batch=2, progress=False)
    return src, LLM.load(root / "art")


def test_openai_client_embeddings(tiny):
    src, llm = tiny
    with running(llm, "tiny") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        batch = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
        vectors = np.array([d.embedding for d in batch.data], np.float32)
        assert [d.index for d in batch.data] == [0, 1, 2] and vectors.shape == (3, 64)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        assert np.abs(vectors - reference_vectors(src, TEXTS)).max() < 1e-4
        for i, text in enumerate(TEXTS):  # alone equals in a batch
            alone = client.embeddings.create(model="tiny", input=text, encoding_format="float")
            assert np.abs(np.array(alone.data[0].embedding, np.float32) - vectors[i]).max() < 1e-5
        ids = llm.embedder.token_ids(TEXTS)
        assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(x) for x in ids)
        short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
        assert len(short.data[0].embedding) == 16
        assert abs(np.linalg.norm(short.data[0].embedding) - 1.0) < 1e-5


def test_base64_equals_float_and_token_ids(tiny):
    _, llm = tiny
    ids = [x.tolist() for x in llm.embedder.token_ids(TEXTS)]
    with running(llm, "tiny") as (url, _):
        as_float = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS}).json()
        as_b64 = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS,
                                                          "encoding_format": "base64"}).json()
        by_ids = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": ids}).json()
        one_list = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": ids[1]}).json()
    floats = np.array([d["embedding"] for d in as_float["data"]], np.float32)
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in as_b64["data"]])
    assert as_float["object"] == "list" and as_float["model"] == "tiny"
    assert np.array_equal(floats, decoded)
    assert np.array_equal(np.array([d["embedding"] for d in by_ids["data"]], np.float32), floats)
    assert np.array_equal(np.array(one_list["data"][0]["embedding"], np.float32), floats[1])


def test_bad_requests_are_one_line_400s(tiny):
    _, llm = tiny
    cases = [({"input": []}, "input must be a string, a list of strings"),
             ({"input": ["a", [1, 2]]}, "mixes strings and token id lists"),
             ({"input": [1.5]}, "input[0] must be a string or a list of token ids"),
             ({"input": "word " * 100}, "tokens; this model takes at most 64"),
             ({"input": [[]]}, "input[0] has no tokens"),
             ({"input": [[9999]]}, "not below the vocabulary size 512"),
             ({"input": ["a"] * (MAX_ITEMS + 1)}, f"at most {MAX_ITEMS} a request"),
             ({"input": "a", "dimensions": 65}, "it allows 1 to 64"),
             ({"input": "a", "dimensions": 0}, "dimensions must be a positive integer"),
             ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
             ({"input": "a", "dimensions": "8"}, "dimensions")]
    with running(llm, "tiny") as (url, _):
        for extra, message in cases:
            r = httpx.post(url + "/v1/embeddings", json={"model": "tiny", **extra})
            error = r.json()["error"]
            assert r.status_code == 400 and message in error["message"] and "\n" not in error["message"], (extra, error)
        r = httpx.post(url + "/v1/embeddings", json={"model": "other", "input": "a"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_model_without_embed_graph_says_how_to_export_it(tmp_path):
    from tiny import make_tiny_checkpoint

    export_model(make_tiny_checkpoint("llama", tmp_path / "hf"), tmp_path / "art", max_seq=64, max_batch=2,
                 progress=False)
    with running(LLM.load(tmp_path / "art"), "tiny") as (url, _):
        r = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": "a"})
    assert r.status_code == 400 and "--embeddings" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "model_not_supported"


def test_embeddings_run_while_a_generation_streams(tiny):
    """An embedding request answers while the engine is generating: its session is not the engine's."""
    _, llm = tiny
    with running(llm, "tiny") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        done: list = []

        def generate() -> None:
            done.append(client.completions.create(model="tiny", prompt="hello", max_tokens=40, temperature=0))

        worker = threading.Thread(target=generate)
        worker.start()
        vectors = [client.embeddings.create(model="tiny", input=TEXTS[0]).data[0].embedding for _ in range(3)]
        worker.join(60)
    assert done and done[0].choices[0].text is not None
    assert all(np.abs(np.array(v) - np.array(vectors[0])).max() < 1e-6 for v in vectors)


def test_smollm2_served_embeddings(smollm2_gguf, smollm2_hf_model, tmp_path):
    """SmolLM2 with embed.onnx, as the cache's export for `decodert serve smollm2` holds it: unit vectors, alone ==
    batched, and transformers' last hidden state at the last token (last-token pooling, the causal-LM default)."""
    import torch

    out = tmp_path / "smollm2"
    export_model(smollm2_gguf, out, max_seq=128, max_batch=4, progress=False, embeddings=True)
    llm = LLM.load(out)
    texts = ["The capital of France is", "Write a short poem about the sea and the wind.", "def fib(n):"]
    with running(llm, "smollm2") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        batch = np.array([d.embedding for d in client.embeddings.create(model="smollm2", input=texts).data])
        alone = np.array([client.embeddings.create(model="smollm2", input=t).data[0].embedding for t in texts])
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert np.abs(batch - alone).max() < 1e-5
    model, _ = smollm2_hf_model
    for text, v in zip(texts, batch):
        ids = torch.from_numpy(llm.embedder.token_ids([text])[0])[None]
        with torch.no_grad():
            h = model.model(input_ids=ids).last_hidden_state[0, -1].numpy()
        assert float(v @ (h / np.linalg.norm(h))) > 0.9999
