"""The README's Python snippet runs as written (issue 17: it used undefined names), on a tiny artifact
in place of ``out/``; the README's two commands stay at the top, and the test command is what CI runs."""

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_python_snippet_runs(samples, tmp_path, capsys, monkeypatch):
    from decodert.export.pipeline import export_model

    monkeypatch.chdir(tmp_path)  # the files it writes (a saved session) go there

    art = tmp_path / "art"  # the samples' tiny artifact, with embed.onnx for the snippet's llm.embed
    export_model(samples["hf"], art, target="ort", dtype="fp32", max_seq=256, max_batch=2, progress=False,
                 embeddings=True)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["model"]["eos_token_ids"] = [2]  # structured output needs an eos token; the tiny sample has none
    (art / "manifest.json").write_text(json.dumps(manifest))
    blocks = _python_blocks(README.read_text())
    assert len(blocks) == 1 and '"out/"' in blocks[0]
    assert 'generate_many([{"messages": ' in blocks[0]  # an instruct model gets chat messages, not raw prompts
    code = blocks[0].replace('"out/"', repr(str(art)))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the snippet is the test subject
    assert scope["r"].finish_reason in ("stop", "length") and len(scope["results"]) == 3 and len(scope["rs"]) == 2
    assert scope["v"].shape == (2, scope["llm"].manifest.embedding.dimensions)
    assert "decode_tps" not in capsys.readouterr().out  # printed the figure, not the attribute name
    assert scope["chat"].history[0] == {"role": "system", "content": "Be brief."} and (tmp_path / "hi.session").is_file()


def test_the_two_commands_come_first():
    text = README.read_text()
    first = text.index("```bash\n")
    commands = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:2]
    assert text.index("## Two commands") < first
    # the openvino extra: the OpenVINO execution provider, the prefill's fast CPU candidate (docs/features/placement.md)
    assert commands[0].strip().startswith("pip install '.[openvino]' && decodert run smollm2 --prompt ")
    assert commands[1].strip() == "bash .ci/run"
    before = text[:text.index("bash .ci/run")]
    assert "16 minutes" in before and "active environment" in before  # how long, and what it installs where
    for name in ("torch", "Ray", "TensorRT-RTX"):
        assert name in before.split("Run the tests")[1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert [line for line in ci if line.startswith("python -m pytest")] == ["python -m pytest"]


def test_the_tiny_checkpoint_script_writes_a_family_that_exports(tmp_path, capsys):
    """README: `python scripts/tiny_checkpoint.py FAMILY OUT` makes a checkpoint `decodert run` takes; bad input exits 2."""
    import importlib.util

    from decodert.export.pipeline import export_model

    spec = importlib.util.spec_from_file_location("tiny_checkpoint", README.parent / "scripts" / "tiny_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert "python scripts/tiny_checkpoint.py qwen3 /tmp/tiny-qwen3" in README.read_text()
    assert script.main(["no_such_family", str(tmp_path / "x")]) == 2
    assert "unknown family 'no_such_family'" in capsys.readouterr().err
    assert script.main(["llama", str(tmp_path / "ckpt")]) == 0
    assert script.main(["llama", str(tmp_path / "ckpt")]) == 2  # never writes over a folder that holds files
    manifest = export_model(tmp_path / "ckpt", tmp_path / "art")
    assert manifest.model.num_layers >= 1 and (tmp_path / "art" / "decode.onnx").exists()
