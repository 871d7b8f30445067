"""decay_curve, layout conversion and weight permutation."""

import numpy as np
import pytest

import rotary


def test_decay_curve_matches_direct_sum():
    d, base = 16, 100.0
    theta = base ** (-np.arange(0, d, 2) / d)
    curve = rotary.decay_curve(d, 50, base=base)
    for r in (0, 1, 7, 50):
        direct = np.mean([abs(sum(np.exp(1j * r * theta[i]) for i in range(j))) for j in range(1, d // 2 + 1)])
        assert curve[r] == pytest.approx(direct, rel=1e-12)
    assert curve[0] == pytest.approx((d / 2 + 1) / 2)
    assert curve.shape == (51,) and curve.dtype == np.float64


def test_decay_curve_decays():
    curve = rotary.decay_curve(128, 4096)
    assert curve[0] > 4 * curve[4000:].mean()


def test_permute_weights_equals_hf_permute(rng):
    """HF's convert_llama_weights_to_hf.permute: w.view(h, hd//2, 2, dim).transpose(1, 2).reshape(dim, dim)."""
    h, hd, dim = 3, 8, 24
    w = rng.standard_normal((h * hd, dim))
    hf = w.reshape(h, hd // 2, 2, dim).transpose(0, 2, 1, 3).reshape(h * hd, dim)
    np.testing.assert_array_equal(rotary.permute_weights(w, h, head_dim=hd), hf)
    np.testing.assert_array_equal(rotary.permute_weights(hf, h, head_dim=hd, to="interleaved"), w)


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_converted_weights_give_same_scores(rotary_dim, rng):
    """Meta (interleaved) weights + interleaved RoPE == converted weights (and bias) + half RoPE."""
    h, hd, dim, S = 2, 8, 12, 5
    wq, wk = rng.standard_normal((2, h * hd, dim))
    bq = rng.standard_normal(h * hd)
    x = rng.standard_normal((S, dim))

    def scores(wq, bq, wk, layout):
        q = (x @ wq.T + bq).reshape(S, h, hd)
        k = (x @ wk.T).reshape(S, h, hd)
        q, k = rotary.apply_qk(q, k, seq_axis=-3, layout=layout, rotary_dim=rotary_dim, base=50.0)
        return np.einsum("thd,shd->hts", q, k)

    conv = dict(head_dim=hd, rotary_dim=rotary_dim)
    ref = scores(wq, bq, wk, "interleaved")
    got = scores(rotary.permute_weights(wq, h, **conv), rotary.permute_weights(bq, h, **conv),
                 rotary.permute_weights(wk, h, **conv), "half")
    np.testing.assert_allclose(got, ref, atol=1e-12)


def test_permute_weights_bad_shape():
    with pytest.raises(ValueError, match="w must have shape"):
        rotary.permute_weights(np.zeros((10, 4)), 2, head_dim=8)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary.permute_weights(np.zeros((16, 4)), 2, head_dim=8, rotary_dim=10)
    with pytest.raises(ValueError, match="to must be"):
        rotary.convert_layout(np.zeros((2, 8)), to="neox")
