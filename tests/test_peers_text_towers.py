"""Towers whose HF code builds positions or pairs in its own way, through the model's own rotary
module and the apply function its attention calls (the zoo, tests/test_hf_zoo.py, checks their cos/sin).

- NeoMME: two-axis (row, col) text RoPE; ``NeoMMEModel.forward`` expands 1-D ``position_ids`` (batch, seq)
  to (2, batch, seq), image tokens carry their own (2, batch, seq) ids. rotary takes (batch, seq, 2):
  ``np.moveaxis(ids, 0, -1)``, or ``np.repeat(ids[..., None], 2, -1)`` for 1-D ids.
- NanoChat: its ``rotate_half`` returns (x2, -x1), so its attention turns every pair by -theta
  (Karpathy's nanochat: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos); ``from_hf_config`` gives the
  negated frequencies, which equals rotary's inverse rotation of the plain spec.
- MusicFlamingo's audio rotary time embedding: a two-axis (window, time) spec with float coordinates
  scaled by the token's timestamp (see the test).
"""

import importlib
import warnings

import numpy as np
import pytest

import rotary
from rotary import RopeSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer, pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                                   reason="needs transformers >= 5 (rope_parameters)")]


def _setup(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(model_type)
    return config, importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_neomme_positions_as_the_model_builds_them(layer_type):
    config, mod = _setup("neomme")
    rope = mod.NeoMMERotaryEmbedding(config)
    spec = RopeSpec.from_hf_config(config.to_dict(), layer_type=layer_type)
    assert spec == RopeSpec.from_hf_config(config, layer_type=layer_type) and spec.n_axes == 2
    rng = np.random.default_rng(0)
    B, S = 2, 9
    q = rng.standard_normal((B, 2, S, config.head_dim)).astype(np.float32)        # (batch, heads, seq, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    ids = torch.arange(S).expand(B, -1) + torch.tensor([[0], [40]])
    hf_ids = ids.unsqueeze(0).expand(2, -1, -1)               # NeoMMEModel.forward: (batch, seq) -> (2, batch, seq)
    image = hf_ids.clone()
    image[:, 1, 3:7] = torch.tensor([[44, 44, 45, 45], [3, 4, 3, 4]])   # a 2 x 2 image block: (row, col)
    for position_ids in (hf_ids, image):
        with torch.no_grad():
            cos, sin = rope(torch.zeros(1), position_ids, layer_type)
            hq, hk = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
        pos = np.moveaxis(position_ids.numpy(), 0, -1)        # (batch, seq, 2)
        oq, ok = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-2)
        np.testing.assert_allclose(oq, hq.numpy(), rtol=0, atol=2e-5 * np.abs(q).max())
        np.testing.assert_allclose(ok, hk.numpy(), rtol=0, atol=2e-5 * np.abs(k).max())
    # 1-D ids: repeated onto both axes, as HF expands them; passed bare they are a clear error
    oq = rotary.apply(q, np.repeat(ids.numpy()[..., None], 2, axis=-1), spec=spec, seq_axis=-2)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1), hf_ids, layer_type)
        hq, _ = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    np.testing.assert_allclose(oq, hq.numpy(), rtol=0, atol=2e-5 * np.abs(q).max())
    with pytest.raises(ValueError, match=r"np.repeat\(ids\[\.\.\., None\], 2, axis=-1\)"):
        rotary.apply(q, ids.numpy(), spec=spec, seq_axis=-2)


def test_nanochat_turns_pairs_by_minus_theta():
    config, mod = _setup("nanochat")
    rope = mod.NanoChatRotaryEmbedding(config)
    head_dim = config.hidden_size // config.num_attention_heads
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 12, head_dim)).astype(np.float32)
    pos = np.arange(12) + 100
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1), torch.from_numpy(pos)[None])
        hq, _ = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    hq = hq.numpy()
    tol = 1e-4 * np.abs(q).max()   # HF's float32 angles at positions ~111
    spec = RopeSpec.from_hf_config(config)
    np.testing.assert_allclose(rotary.apply(q, pos, spec=spec, seq_axis=-2), hq, rtol=0, atol=tol)
    plain = RopeSpec(head_dim, base=spec.base)
    np.testing.assert_allclose(rotary.apply(q, pos, spec=plain, inverse=True, seq_axis=-2), hq, rtol=0, atol=tol)
    assert np.max(np.abs(rotary.apply(q, pos, spec=plain, seq_axis=-2) - hq)) > 0.5   # the plain half-split spec disagrees


def test_musicflamingo_audio_time_rope_fits_the_multi_axis_contract():
    """MusicFlamingo's rotary time embedding: 2 x 128 interleaved pairs of the first 512 of 1280 features,
    the first 128 reading the window axis and the next 128 the time axis, both with base**(-j/128). HF's
    angle of pair j is (w_b * omega_j) * (-2 pi t) and (2 pi s / L * omega_j) * (-2 pi t): a two-axis spec
    with float coordinates c0 = -2 pi t w_b, c1 = -2 pi t (2 pi s / L), where t is the token's timestamp
    (seconds, HF's ``_build_audio_timestamps``), s its frame in the window, w_b = round(t_b0 / window) / L."""
    import math
    import types

    config, mod = _setup("musicflamingo")
    rope = mod.MusicFlamingoRotaryEmbedding(config)
    seq_len, step = 50, config.audio_frame_step * 4
    post_lengths = torch.tensor([seq_len, seq_len, seq_len])            # three 50-frame windows, two samples
    input_ids = torch.full((1, 3 * seq_len + 4), 7)
    input_ids[0, 1:1 + 2 * seq_len] = config.audio_token_id              # sample 1: two windows
    input_ids[0, 3 + 2 * seq_len:3 + 3 * seq_len] = config.audio_token_id  # sample 2: one window
    fake = types.SimpleNamespace(config=config)
    timestamps = mod.MusicFlamingoModel._build_audio_timestamps(fake, input_ids, post_lengths, seq_len)
    assert timestamps.shape == (3, seq_len)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, seq_len, config.head_dim)).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(timestamps, seq_len=seq_len)
        hf = mod.apply_rotary_time_emb(torch.from_numpy(x), cos, sin).double().numpy()
    L = float(config.max_position_embeddings)
    t = timestamps.double().numpy()
    w = np.round(t[:, :1] / (step * seq_len)) / L                          # (windows, 1)
    s = np.arange(seq_len) / L * 2 * math.pi
    coords = np.stack(np.broadcast_arrays(-2 * math.pi * t * w, -2 * math.pi * t * s), axis=-1)   # (3, 50, 2)
    d = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    spec = RopeSpec.axial(config.head_dim, axes=2, rotary_dim=2 * d, base=config.rope_parameters["rope_theta"],
                          layout="interleaved", float_positions=True)
    np.testing.assert_allclose(spec.inv_freq()[: d // 2], rope.inv_freq.double().numpy(), rtol=2e-6)
    ours = rotary.apply(x, coords, spec=spec, seq_axis=-2)
    # HF forms the angles in float32: |angle| <= max|c| * max(omega), error ~ 1e-7 of that
    bound = float(np.max(np.abs(coords))) * 2e-7 + 1e-6
    np.testing.assert_allclose(ours, hf, rtol=0, atol=float(np.abs(x).max()) * math.sqrt(2) * bound)
    np.testing.assert_array_equal(ours[..., 2 * d:], x[..., 2 * d:])
