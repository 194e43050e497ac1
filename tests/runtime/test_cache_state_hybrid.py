"""The cache owner's rule for rows with conv / recurrent states (hybrid models;
docs/features/cache-state.md): such a row is rewound only to a point it can return to exactly (its length, 0, or its
snapshot), every other rewind is refused, a row that holds nothing has zero states, and a commit may
carry the states the model computed after the ids (the prefix cache)."""

from __future__ import annotations

import numpy as np
import pytest

from decodert.errors import DecodertError
from decodert.runtime.backends.kv_cache import KVCache


def _cache(states=(("conv.0", (4, 3)), ("recurrent.0", (2, 2, 2)))) -> KVCache:
    return KVCache(3, 16, 1, 2, 4, np.float32, kv_layers=[1], states=list(states))


def _write(cache: KVCache, slot: int, value: float) -> None:
    """What a graph does in place: new states for the row."""
    for buf in cache.states:
        buf[slot] = value


def test_rewind_goes_only_to_length_zero_or_the_snapshot():
    cache = _cache()
    cache.commit([0], [np.arange(5)])
    _write(cache, 0, 1.0)
    cache.snapshot(0)  # states at 5 tokens
    cache.commit([0], [np.arange(5, 9)])
    _write(cache, 0, 2.0)
    assert [cache.rewind_point(0, t) for t in (9, 8, 5, 4, 0)] == [9, 5, 5, 0, 0]
    with pytest.raises(DecodertError, match="cannot be rewound from 9 to 7") as e:
        cache.rewind(0, 7)
    assert "\n" not in str(e.value) and cache.lengths[0] == 9 and cache.states[0][0, 0, 0] == 2.0  # nothing changed
    cache.rewind(0, 9)  # its length: nothing to do
    assert cache.states[0][0, 0, 0] == 2.0
    cache.rewind(0, 5)  # the snapshot: states restored, the ids after it dropped
    assert cache.lengths[0] == 5 and all((buf[0] == 1.0).all() for buf in cache.states)
    np.testing.assert_array_equal(cache.held(0), np.arange(5))
    cache.commit([0], [[7, 7]])
    _write(cache, 0, 3.0)
    cache.rewind(0, 5)  # the snapshot stays valid while the row still holds it
    assert all((buf[0] == 1.0).all() for buf in cache.states)
    cache.rewind(0, 0)  # 0: zero states, no snapshot left
    assert cache.lengths[0] == 0 and all((buf[0] == 0).all() for buf in cache.states)
    cache.commit([0], [np.arange(6)])
    assert cache.rewind_point(0, 5) == 0
    with pytest.raises(DecodertError):
        cache.rewind(0, 5)


def test_rewind_with_the_states_a_pass_computed():
    """Speculation with a verify pass's per-position states: any point of the row, its states given."""
    cache = _cache()
    cache.commit([0], [np.arange(8)])
    _write(cache, 0, 2.0)
    given = {"conv.0": np.full((4, 3), 5.0, np.float32), "recurrent.0": np.full((2, 2, 2), 6.0, np.float32)}
    cache.rewind(0, 6, given)
    assert cache.lengths[0] == 6 and (cache.states[0][0] == 5.0).all() and (cache.states[1][0] == 6.0).all()
    with pytest.raises(ValueError, match="not the row's"):
        cache.rewind(0, 5, {"conv.0": given["conv.0"]})


def test_reset_and_move_leave_empty_rows_with_zero_states():
    cache = _cache()
    cache.commit([0, 1], [np.arange(4), np.arange(3)])
    _write(cache, 0, 1.0)
    _write(cache, 1, 4.0)
    cache.snapshot(1)
    cache.reset(0)
    assert all((buf[0] == 0).all() for buf in cache.states) and all((buf[1] == 4.0).all() for buf in cache.states)
    for buf in cache.states:  # a backend's move_slot copies the buffers, then tells the owner
        buf[2] = buf[1]
    cache.move(1, 2)
    assert all((buf[1] == 0).all() for buf in cache.states) and cache.lengths[1] == 0
    cache.commit([2], [[9]])
    cache.rewind(2, 3)  # the snapshot moved with the row
    np.testing.assert_array_equal(cache.held(2), np.arange(3))


def test_a_cache_without_states_rewinds_by_length():
    cache = KVCache(2, 16, 2, 2, 4, np.float32)
    cache.commit([0], [np.arange(9)])
    cache.snapshot(0)  # nothing to keep
    assert not cache.has_state and cache.rewind_point(0, 7) == 7
    cache.rewind(0, 7)
    assert cache.lengths[0] == 7 and cache.kv_layers == (0, 1)


def test_every_layer_kind_has_its_weights_or_is_refused():
    from decodert.models.canonical import canonical_names
    from decodert.models.layers import (MIXERS, AttentionSpec, DenseMLPSpec, LayerSpec, Mamba2Spec, ShortConvSpec,
                                        kind_from_dict)
    from decodert.models.spec import ModelSpec

    attention, mlp = LayerSpec(AttentionSpec(4, 2, 8), DenseMLPSpec(64)), DenseMLPSpec(64)
    spec = ModelSpec("x", 64, 32, 1e-5, (attention, LayerSpec(ShortConvSpec(3), mlp)))
    assert "layers.1.conv_in" in canonical_names(spec) and spec.layer_kinds == ("attention", "conv")
    mamba = ModelSpec("x", 64, 32, 1e-5, (LayerSpec(Mamba2Spec(2, 4, 8, 1, kernel=3), mlp), attention))
    assert {"layers.0.mamba_in", "layers.0.mamba_a_log", "layers.1.qkv"} <= set(canonical_names(mamba))
    with pytest.raises(ValueError, match="mamba2 layers need positive ssm sizes"):
        Mamba2Spec(0, 4, 8, 1, kernel=3)
    with pytest.raises(ValueError, match="layer kind 'gated_rnn'"):
        kind_from_dict({"kind": "gated_rnn"}, MIXERS)


def test_commit_with_the_states_the_model_computed():
    """The prefix cache's door: K/V copied in for ids, and the states a row had after exactly those ids."""
    cache = _cache()
    cache.commit([0], [np.arange(6)])
    _write(cache, 0, 3.0)
    kept = cache.read_states(0)  # the states after ids 0..5
    assert [len(b) for b in kept] == cache.state_bytes
    _write(cache, 0, 9.0)
    assert all((buf[0] == 9.0).all() for buf in cache.states)  # a copy: the row's later states do not reach it
    cache.commit([1], [np.arange(6)], states=[kept])
    assert cache.lengths[1] == 6 and all((buf[1] == 3.0).all() for buf in cache.states)
    np.testing.assert_array_equal(cache.held(1), np.arange(6))
    with pytest.raises(ValueError, match="are not 1 x"):
        cache.commit([2], [np.arange(3)], states=[kept[:1]])
    assert cache.lengths[2] == 0 and all((buf[2] == 0).all() for buf in cache.states)  # refused: nothing written
    assert KVCache(2, 16, 1, 2, 4, np.float32).read_states(0) == []


def test_a_run_interrupted_before_its_commit_leaves_the_row_as_recorded():
    """``writing``: a graph updated the states of a row in place and the commit never came (an exception,
    Ctrl-C between two prefill chunks): the row goes back to its snapshot, or to 0 without one; a committed
    row, or another row, is left as it is."""
    cache = _cache()
    cache.commit([0], [np.arange(5)])
    _write(cache, 0, 1.0)
    cache.snapshot(0)
    cache.commit([0, 1], [np.arange(5, 9), np.arange(3)])
    _write(cache, 0, 2.0)
    _write(cache, 1, 7.0)
    with pytest.raises(KeyboardInterrupt):
        with cache.writing([0, 1]):
            _write(cache, 0, 3.0)  # the graph ran over both rows
            _write(cache, 1, 8.0)
            cache.commit([1], [[3]])  # row 1's ids recorded, row 0's not
            raise KeyboardInterrupt
    assert cache.lengths[0] == 5 and all((buf[0] == 1.0).all() for buf in cache.states)  # its snapshot
    np.testing.assert_array_equal(cache.held(0), np.arange(5))
    assert cache.lengths[1] == 4 and all((buf[1] == 8.0).all() for buf in cache.states)
    waited = []
    with pytest.raises(DecodertError, match="engine failed"):
        with cache.writing([1], wait=lambda: waited.append(1)):
            _write(cache, 1, 9.0)
            raise DecodertError("engine failed")
    assert waited == [1] and cache.lengths[1] == 0 and all((buf[1] == 0).all() for buf in cache.states)  # no snapshot
    with cache.writing([2]):
        _write(cache, 2, 4.0)
        cache.commit([2], [[1, 2]])
    assert cache.lengths[2] == 2 and (cache.states[0][2] == 4.0).all()
    with cache.writing([2]):  # ended without its commit: not a state of the ids either
        _write(cache, 2, 5.0)
    assert cache.lengths[2] == 0 and (cache.states[0][2] == 0).all()
    plain = KVCache(1, 16, 1, 2, 4, np.float32)
    plain.commit([0], [np.arange(4)])
    with pytest.raises(KeyboardInterrupt), plain.writing([0]):  # K/V alone: positions past the length are unread
        raise KeyboardInterrupt
    assert plain.lengths[0] == 4


def test_switching_adapter_empties_the_states_and_the_snapshot():
    """``use_adapter`` with another adapter: the row holds nothing, so its states are zero and the snapshot taken
    under the other adapter is gone (a later rewind must not restore it); the same adapter keeps the row."""
    cache = _cache()
    cache.use_adapter(0, 1, 11)
    cache.commit([0], [np.arange(5)])
    _write(cache, 0, 1.0)
    cache.snapshot(0)
    cache.use_adapter(0, 1, 11)
    assert cache.lengths[0] == 5 and cache.rewind_point(0, 3) == 0 and (cache.states[0][0] == 1.0).all()
    cache.commit([0], [np.arange(5, 9)])
    _write(cache, 0, 2.0)
    cache.use_adapter(0, 2, 12)
    assert cache.lengths[0] == 0 and all((buf[0] == 0).all() for buf in cache.states)
    cache.commit([0], [np.arange(9)])  # the same ids again, under adapter 12
    _write(cache, 0, 3.0)
    assert cache.rewind_point(0, 6) == 0  # not 5: that snapshot's states were adapter 11's
    cache.rewind(0, 0)
    assert cache.adapter_tag(0) == 12 and int(cache.adapters[0]) == 2
