"""Tiny exports shared by the persistence tests, made once per session."""

import pytest


@pytest.fixture(scope="session")
def tiny_art(tiny_checkpoint, tmp_path_factory):
    """export(family, target="ort", **overrides) -> an fp32 artifact folder of a tiny random checkpoint (once per arguments)."""
    pytest.importorskip("transformers")
    from decodert.export.pipeline import export_model

    made = {}

    def export(family: str, target: str = "ort", max_seq: int = 192, **overrides):
        key = (family, target, max_seq, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"art-{family}-{target}") / "art"
            export_model(tiny_checkpoint(family, **overrides), out, target=target, dtype="fp32", max_seq=max_seq,
                         max_batch=2, progress=False)
            made[key] = out
        return made[key]

    return export
