"""LoRA adapters (export/lora/, runtime/adapters.py): PEFT folders against transformers + peft, rows with
different adapters in one batch, --merge-lora, K/V never mixed across adapters, the server's routing, errors."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from tiny import load_torch, make_adapter, make_tiny_checkpoint

from decodert.errors import DecodertError
from decodert.export.pipeline import export_model
from decodert.artifact.lora_layout import LoraLayout
from decodert.runtime.llm import LLM

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 99, 230, 41, 7, 300, 12]
LONG = list(np.random.default_rng(3).integers(3, 500, 70))  # > 2 prefix-cache blocks of 32


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint("llama", root / "base")
    adapters = {"a": make_adapter(base, root / "a", 4, 8, ALL, 1),
                "b": make_adapter(base, root / "b", 8, 16, ["q_proj", "v_proj", "down_proj"], 2, scale=0.06,
                                  use_rslora=True)}
    art = root / "art"
    export_model(base, art, max_seq=128, max_batch=4, progress=False, lora=LoraLayout(2, 8))
    return root, base, adapters, art


def reference(base, adapter, prompt, n):
    """Greedy tokens of transformers (+ peft with ``adapter``)."""
    model = load_torch(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_adapters_match_transformers_peft_and_mix_in_one_batch(world):
    root, base, adapters, art = world
    llm = LLM.load(art, adapters=adapters, prefix_cache_mb=0)
    singles = {}
    for name in (None, "a", "b"):
        singles[name] = llm.generate(PROMPT, max_new_tokens=10, adapter=name, stop_token_ids=[]).token_ids
        assert singles[name] == reference(base, adapters.get(name), PROMPT, 10), name
    assert len({tuple(t) for t in singles.values()}) == 3  # each adapter changes the answer
    mixed = ["a", "b", None, "a", "b", None]  # 6 requests over 4 slots: rows of every kind share steps
    out = llm.generate_many([{"prompt": PROMPT, "max_new_tokens": 10, "adapter": a, "stop_token_ids": []} for a in mixed])
    assert [r.token_ids for r in out] == [singles[a] for a in mixed]
    # speculative decoding verifies drafts through the same adapter slots (the verify passes bind them too)
    spec = llm.generate_many([{"prompt": PROMPT * 2, "max_new_tokens": 12, "adapter": a, "stop_token_ids": [],
                               "speculative": "ngram"} for a in ("a", "b", None)])
    plain = [llm.generate(PROMPT * 2, max_new_tokens=12, adapter=a, stop_token_ids=[]).token_ids for a in ("a", "b", None)]
    assert [r.token_ids for r in spec] == plain


def test_merge_lora_export_equals_the_runtime_adapter(world):
    root, base, adapters, art = world
    merged = root / "merged"
    m = export_model(base, merged, max_seq=128, progress=False, merge_lora=[adapters["a"]])
    assert m.lora is not None and m.lora.slots == 0 and len(m.lora.merged) == 1
    fused = LLM.load(merged).generate(PROMPT, max_new_tokens=10, stop_token_ids=[], logprobs=True)
    slot = LLM.load(art, adapters={"a": adapters["a"]}).generate(PROMPT, max_new_tokens=10, adapter="a",
                                                                   stop_token_ids=[], logprobs=True)
    assert fused.token_ids == slot.token_ids
    np.testing.assert_allclose([t.logprob for t in fused.logprobs], [t.logprob for t in slot.logprobs], atol=1e-4)


def test_portable_target_takes_adapters_and_trt_refuses_slots(world, tmp_path):
    root, base, adapters, _ = world
    art = tmp_path / "portable"
    export_model(base, art, target="portable", max_seq=64, max_batch=2, progress=False, lora=LoraLayout(1, 4))
    llm = LLM.load(art, adapters={"a": adapters["a"]})
    assert llm.generate(PROMPT, max_new_tokens=6, adapter="a", stop_token_ids=[]).token_ids == \
        reference(base, adapters["a"], PROMPT, 6)
    with pytest.raises(DecodertError, match="--target trt graphs take no LoRA"):
        export_model(base, tmp_path / "trt", target="trt", max_seq=64, progress=False, lora=LoraLayout(1, 4))
    from decodert.export.trt_build import read_manifest as build_manifest
    from decodert.runtime.backends.loading import open_backend, read_manifest

    with pytest.raises(DecodertError, match="TensorRT backend does not bind"):  # a portable graph TensorRT could build
        build_manifest(art)
    with pytest.raises(DecodertError, match="run on --backend ort only"):
        open_backend(art, read_manifest(art, "none"), "trt")


def test_serve_lora_flag_is_checked():
    from pathlib import Path

    from decodert.cli.serve import _loras

    assert _loras(["sql=/a", "chat=b"]) == (("sql", Path("/a")), ("chat", Path("b")))
    for bad, match in (("sql", "expected NAME=DIR"), ("a:b=/x", "expected NAME=DIR"), ("=x", "expected NAME=DIR")):
        with pytest.raises(DecodertError, match=match):
            _loras([bad])
    with pytest.raises(DecodertError, match="given twice"):
        _loras(["a=/x", "a=/y"])


def test_kv_and_prefix_cache_never_mix_adapters(world):
    """One row and the prefix cache see the same long prompt under a, none, b, a: each answer equals a
    fresh LLM's, and only a repeat under the same adapter hits the prefix cache."""
    _, _, adapters, art = world
    llm = LLM.load(art, adapters=adapters)
    order = ["a", None, "b", "a", None]
    got = [llm.generate(LONG, max_new_tokens=6, adapter=a, stop_token_ids=[]) for a in order]
    fresh = {a: LLM.load(art, adapters=adapters, prefix_cache_mb=0).generate(LONG, max_new_tokens=6, adapter=a,
                                                                             stop_token_ids=[]).token_ids
             for a in set(order)}
    assert [r.token_ids for r in got] == [fresh[a] for a in order]
    assert [r.metrics.cached_tokens for r in got] == [0, 0, 0, 64, 64]
    # a session's row keeps its K/V between turns: the same turn again under another adapter starts over
    session = llm.session()
    session.chat("hello there, how are you", max_new_tokens=4, adapter="a")
    session.undo()
    switched = session.chat("hello there, how are you", max_new_tokens=4, adapter="b")
    assert switched.token_ids == LLM.load(art, adapters=adapters, prefix_cache_mb=0).session().chat(
        "hello there, how are you", max_new_tokens=4, adapter="b").token_ids
    assert switched.metrics.cached_tokens == 0
    llm.unload_adapter("b")
    with pytest.raises(DecodertError, match="unknown adapter 'b'; loaded: 'a'"):
        llm.generate(PROMPT, adapter="b")
    llm.load_adapter("b", adapters["b"])  # a new tag: nothing cached under the old load is reused
    assert llm.generate(LONG, max_new_tokens=6, adapter="b", stop_token_ids=[]).metrics.cached_tokens == 0
    stream = llm.stream(PROMPT, max_new_tokens=4, adapter="a")
    next(stream)  # a run in progress: its rows' adapters stay as they are
    with pytest.raises(DecodertError, match="a run is in progress"):
        llm.load_adapter("a", adapters["b"])
    with pytest.raises(DecodertError, match="a run is in progress"):
        llm.unload_adapter("a")
    stream.close()
    llm.unload_adapter("a")


def test_bad_adapters_are_one_line_errors(world, tmp_path):
    root, base, adapters, art = world
    llm = LLM.load(art, adapters={"a": adapters["a"]})

    def fails(match, fn, *args, **kwargs):
        with pytest.raises(DecodertError, match=match) as e:
            fn(*args, **kwargs)
        assert "\n" not in str(e.value)

    fails("unknown adapter 'x'", llm.generate, PROMPT, adapter="x")
    fails("request 1: unknown adapter 'x'", llm.generate_many, [{"prompt": PROMPT}, {"prompt": PROMPT, "adapter": "x"}])
    wide = make_adapter(base, tmp_path / "wide", 16, 16, ["q_proj"], 3)
    fails("rank 16, above the artifact's --lora-rank 8", llm.load_adapter, "wide", wide)
    head = make_adapter(base, tmp_path / "head", 4, 8, ["q_proj", "lm_head"], 4)
    fails("cannot be mapped|cannot map", llm.load_adapter, "head", head)
    other = make_tiny_checkpoint("llama", tmp_path / "other", hidden_size=32, head_dim=8)
    fails("does not fit this llama model", llm.load_adapter, "other", make_adapter(other, tmp_path / "o", 4, 8, ALL, 5))
    dora = make_adapter(base, tmp_path / "dora", 4, 8, ["q_proj"], 6, use_dora=True)
    fails("DoRA", llm.load_adapter, "dora", dora)
    fails("all 2 LoRA slots are taken", _fill, llm, adapters)
    fails("takes no LoRA adapters at run time", LLM.load(_plain(base, tmp_path)).load_adapter, "a", adapters["a"])


def _fill(llm, adapters):
    llm.load_adapter("b", adapters["b"])
    llm.load_adapter("c", adapters["a"])


def _plain(base, tmp_path):
    art = tmp_path / "plain"
    export_model(base, art, max_seq=64, progress=False)
    return art


def test_server_routes_by_model_name(world):
    from serve_helpers import running

    _, _, adapters, art = world
    llm = LLM.load(art, adapters=adapters, prefix_cache_mb=0)
    want = {a: llm.generate(PROMPT, max_new_tokens=5, adapter=a, stop_token_ids=[]).token_ids for a in (None, "a", "b")}
    with running(llm, model_name="tiny") as (url, _):
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert ids == ["tiny", "tiny:a", "tiny:b"]
        for model, adapter in (("tiny", None), ("tiny:a", "a"), ("b", "b")):
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 5,
                                                          "temperature": 0, "logprobs": 1}, timeout=30)
            body = r.json()
            assert r.status_code == 200 and body["model"] == model, body
            tokens = body["choices"][0]["logprobs"]["tokens"]
            assert tokens == [llm.tokenizer.id_to_token(t) for t in want[adapter]] or \
                body["choices"][0]["text"] == llm.tokenizer.decode(want[adapter])
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny:zzz", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 404 and "'tiny:a'" in json.dumps(r.json())


def test_fused_peft_modules_of_phi3_split_into_parts(tmp_path):
    """Phi-3 names its fused projections qkv_proj and gate_up_proj: one A for all parts, B split by rows."""
    base = make_tiny_checkpoint("phi3", tmp_path / "phi3")
    adapter = make_adapter(base, tmp_path / "fused", 4, 8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 7)
    art = tmp_path / "art"
    export_model(base, art, max_seq=64, max_batch=2, progress=False, lora=LoraLayout(1, 4))
    llm = LLM.load(art, adapters={"f": adapter})
    got = llm.generate(PROMPT, max_new_tokens=8, adapter="f", stop_token_ids=[]).token_ids
    assert got == reference(base, adapter, PROMPT, 8)
    assert got != llm.generate(PROMPT, max_new_tokens=8, stop_token_ids=[]).token_ids


def test_adapter_slots_with_a_quantized_kv_cache(world, tmp_path):
    """--lora-slots with --kv-dtype int8: the cache's scales are calibrated on the base model and the adapter
    rows read and write the same int8 codes; the answer stays close to the float cache's."""
    root, base, adapters, art = world
    q = tmp_path / "int8"
    m = export_model(base, q, max_seq=128, max_batch=2, progress=False, lora=LoraLayout(2, 8), kv_dtype="int8")
    assert m.kv_dtype == "int8" and m.lora is not None and m.lora.slots == 2
    kw = dict(max_new_tokens=8, adapter="a", stop_token_ids=[], logprobs=True)
    got = LLM.load(q, adapters={"a": adapters["a"]}).generate(PROMPT, **kw)
    want = LLM.load(art, adapters={"a": adapters["a"]}).generate(PROMPT, **kw)
    # the tiny random model's next-token distribution is nearly flat, so int8 rounding may flip a near tie late on
    same = next((i for i, (x, y) in enumerate(zip(got.token_ids, want.token_ids)) if x != y), len(want.token_ids))
    assert same >= 5, (got.token_ids, want.token_ids)
    np.testing.assert_allclose([t.logprob for t in got.logprobs[:same]], [t.logprob for t in want.logprobs[:same]],
                               atol=0.05)


@pytest.mark.parametrize("family,what", [("lfm2", "hybrid"), ("qwen3_5", "hybrid"), ("qwen3_moe", "mixture-of-experts")])
def test_adapters_are_refused_where_they_cannot_map(world, tmp_path, family, what):
    """Slots or a merge on a model whose layers are not all dense attention + MLP: one line, nothing written
    (an adapter's q/k/v/o on a conv or DeltaNet layer, or gate/up/down on experts, has nowhere to go)."""
    root, _, adapters, _ = world
    src = make_tiny_checkpoint(family, tmp_path / "src")
    for kw in ({"lora": LoraLayout(1, 4)}, {"merge_lora": [adapters["a"]]}):
        with pytest.raises(DecodertError, match=f"not supported on a {what}") as e:
            export_model(src, tmp_path / "out", max_seq=32, progress=False, **kw)
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,message", [
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj'] must be one of positive finite numbers, got \"x\""),
    ({"alpha_pattern": {"q_proj": True}}, "alpha_pattern['q_proj'] must be one of positive finite numbers, got true"),
    ({"alpha_pattern": {"q_proj": -8}}, "alpha_pattern['q_proj'] must be one of positive finite numbers, got -8"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must map module names to positive finite numbers"),
    ({"alpha_pattern": {"(q_proj": 8}}, "alpha_pattern key '(q_proj' is not a regular expression"),
    ({"rank_pattern": {"q_proj": 4.0}}, "rank_pattern['q_proj'] must be one of positive integers, got 4.0"),
    ({"rank_pattern": {"q_proj": 2}}, "has rank 4, but adapter_config.json says r 2"),
    ({"r": "4"}, "r must be a positive integer, got \"4\""),
    ({"r": 0}, "r must be a positive integer, got 0"),
    ({"r": True}, "r must be a positive integer, got true"),
    ({"r": 8}, "has rank 4, but adapter_config.json says r 8"),
    ({"lora_alpha": "8"}, "lora_alpha must be a positive finite number, got \"8\""),
    ({"lora_alpha": 0}, "lora_alpha must be a positive finite number, got 0"),
    ({"lora_alpha": -8}, "lora_alpha must be a positive finite number, got -8"),
    ({"lora_alpha": False}, "lora_alpha must be a positive finite number, got false"),
    ({"lora_alpha": 1e300}, "scale lora_alpha / r = 2.5e+299 (lora_alpha 1e+300) is not a finite float32"),
    ({"alpha_pattern": {"v_proj": 4e39}}, "v_proj: lora_B times its scale lora_alpha / r = 1e+39"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false"),
])
def test_bad_adapter_settings_are_one_line_errors(world, tmp_path, change, message):
    """Issue 45 (17, 6): every bad number in adapter_config.json is a DecodertError from load_adapter, with no
    RuntimeWarning on the way (lora_alpha 1e300 overflowed float32 and decoded token 0 forever)."""
    import warnings

    _, _, adapters, art = world
    bad = shutil.copytree(adapters["a"], tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    config.update(change)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    llm = LLM.load(art)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DecodertError) as e:
            llm.load_adapter("bad", bad)
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)
    assert "bad" not in llm.adapters.names


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_adapter_weights_are_refused(world, tmp_path, value):
    from safetensors.numpy import load_file, save_file

    _, _, adapters, art = world
    bad = shutil.copytree(adapters["a"], tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith("k_proj.lora_B.weight"))
    tensors[key][1, 2] = value
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(DecodertError, match=r"k_proj\.lora_B holds 1 NaN or infinite values") as e:
        LLM.load(art).load_adapter("bad", bad)
    assert "\n" not in str(e.value)


def test_disk_tier_keys_adapter_rows_by_the_adapter_content(world, tmp_path):
    """The prefix cache's disk tier (runtime/persist/disk_tier.py): a new LLM reads back the blocks of each adapter
    and of the base model, each only under the same adapter weights (whatever name they are loaded as)."""
    _, _, adapters, art = world
    order = ["a", None, "b"]
    with LLM.load(art, adapters=adapters, cache_dir=tmp_path / "cd") as llm:
        first = [llm.generate(LONG, max_new_tokens=6, adapter=a, stop_token_ids=[]).token_ids for a in order]
    assert len(list((tmp_path / "cd").iterdir())) == 3  # one identity folder per adapter and the base model
    swapped = {"a": adapters["b"], "b": adapters["a"]}  # the names now load the other weights
    with LLM.load(art, adapters=swapped, cache_dir=tmp_path / "cd") as llm:
        again = [llm.generate(LONG, max_new_tokens=6, adapter=a, stop_token_ids=[]) for a in ["b", None, "a"]]
    assert [r.token_ids for r in again] == first and [r.metrics.cached_tokens for r in again] == [64, 64, 64]
