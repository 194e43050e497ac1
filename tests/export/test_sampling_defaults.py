"""Sampling defaults from the model (export/checkpoints/sampling_defaults.py): found at export, recorded in the
manifest, used by the API (and the CLI) for every parameter the caller does not pass."""

import json

import pytest

from tiny import make_tiny_gguf  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.export.checkpoints.sampling_defaults import sampling_record  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def sampled_art(tiny_checkpoint, tmp_path_factory):
    """A tiny llama whose generation_config.json asks for sampling at T=0.6, top_p 0.8."""
    import shutil

    src = shutil.copytree(tiny_checkpoint("llama"), tmp_path_factory.mktemp("gc") / "hf")
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.6,
                                                            "top_p": 0.8}))
    out = src.parent / "art"
    export_model(src, out, max_seq=64, max_batch=2, progress=False)
    return out


def test_generation_config_recorded_and_used_by_the_api(sampled_art, monkeypatch):
    from decodert.runtime.decoding import generate

    manifest = json.loads((sampled_art / "manifest.json").read_text())
    # transformers' own defaults fill what the file leaves out (top_k 50 while sampling)
    assert manifest["sampling"]["defaults"] == {"temperature": 0.6, "top_k": 50, "top_p": 0.8}
    assert manifest["sampling"]["source"].startswith("generation_config.json")
    llm = LLM.load(sampled_art)
    seen = []
    real = generate.Sequence.__init__
    monkeypatch.setattr(generate.Sequence, "__init__", lambda self, ids, params, *a: seen.append(params)
                        or real(self, ids, params, *a))
    implicit = llm.generate("hello", max_new_tokens=12, seed=3)
    explicit = llm.generate("hello", max_new_tokens=12, seed=3, temperature=0.6, top_k=50, top_p=0.8)
    assert seen[0] == seen[1] == SamplingParams(max_new_tokens=12, seed=3, temperature=0.6, top_k=50, top_p=0.8)
    assert implicit.token_ids == explicit.token_ids
    greedy = llm.generate("hello", max_new_tokens=12, temperature=0)  # an explicit argument overrides
    assert seen[2].temperature == 0 and seen[2].top_p == 0.8
    sampled = [llm.generate("hello", max_new_tokens=12, seed=s).token_ids for s in range(4)]
    assert any(t != greedy.token_ids for t in sampled)  # the defaults really sample
    seen.clear()
    llm.stream("hi", max_new_tokens=2).close()
    llm.generate_many([Request("a", None), {"prompt": "b", "top_p": 0.5}, Request("c", SamplingParams())])
    assert [(p.temperature, p.top_p) for p in seen] == [(0.6, 0.8), (0.6, 0.8), (0.6, 0.5), (0.0, 1.0)]


def test_inspect_prints_the_defaults(sampled_art):
    from decodert.export.artifact.inspect import inspect_artifact

    line = next(x for x in inspect_artifact(sampled_art).splitlines() if x.startswith("sampling"))
    assert "temperature 0.6, top_k 50, top_p 0.8" in line and "generation_config.json" in line
    assert "explicit arguments override" in line


def test_bad_defaults_in_a_manifest_fail_at_load(sampled_art, tmp_path):
    import shutil

    art = shutil.copytree(sampled_art, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    for bad, message in (({"temperature": -1.0}, "manifest sampling.defaults: temperature must be a number >= 0"),
                         ({"temperature": "hot"}, "sampling.defaults.temperature must be a finite number"),
                         ({"beam_width": 4}, "sampling.defaults.beam_width is not a generation parameter")):
        (art / "manifest.json").write_text(json.dumps({**manifest, "sampling": {"defaults": bad, "source": "x"}}))
        with pytest.raises(DecodertError, match=message):
            LLM.load(art)


def test_hf_greedy_or_silent_generation_config(tiny_checkpoint, tmp_path):
    import shutil

    src = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "hf")
    # save_pretrained's file (no sampling keys) declares nothing: greedy, since no model card matches
    assert sampling_record(open_checkpoint(src), None) == {"defaults": {"temperature": 0.0},
                                                           "source": "none: greedy decoding"}
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.3}))
    record = sampling_record(open_checkpoint(src), None)
    assert record["defaults"] == {"temperature": 0.0, "repetition_penalty": 1.3}
    (src / "generation_config.json").write_text("{not json")  # an optional file: never fails the export
    assert sampling_record(open_checkpoint(src), None)["defaults"] == {"temperature": 0.0}


def test_gguf_general_sampling_keys(tmp_path):
    path = make_tiny_gguf("llama", tmp_path / "s.gguf", meta={"general.sampling.temp": 0.5,
                                                               "general.sampling.top_k": 20})
    record = sampling_record(open_checkpoint(path), "tpl")
    # the rest at llama.cpp's defaults: the keys are llama.cpp settings
    assert record["defaults"] == {"temperature": 0.5, "top_k": 20, "top_p": 0.95, "min_p": 0.05}
    assert "general.sampling" in record["source"]
    plain = make_tiny_gguf("llama", tmp_path / "p.gguf")
    assert sampling_record(open_checkpoint(plain), "tpl")["defaults"] == {"temperature": 0.0}
    named = make_tiny_gguf("llama", tmp_path / "n.gguf", meta={"general.basename": "SmolLM2"})
    assert sampling_record(open_checkpoint(named), "tpl")["defaults"] == {"temperature": 0.2, "top_p": 0.5}
    assert sampling_record(open_checkpoint(named), None)["defaults"] == {"temperature": 0.0}  # base model: no card


def test_smollm2_gguf_gets_its_model_card_defaults(smollm2_gguf):
    ckpt = open_checkpoint(smollm2_gguf)
    record = sampling_record(ckpt, ckpt.meta.get("tokenizer.chat_template"))
    assert record["defaults"] == {"temperature": 0.2, "top_p": 0.5} and "SmolLM2" in record["source"]
