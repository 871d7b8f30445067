"""Numerical checks of docs/theory.md (each section is included in the page; tests/test_docs.py runs this file).

Every check compares ``rotary`` (float32 or float64) with float64 algebra written out here.
"""

# --8<-- [start:setup]
import numpy as np

import rotary
from rotary.testing import rotation_matrix

rng = np.random.default_rng(0)
# --8<-- [end:setup]

# --8<-- [start:two_d]
# 2-D: identify (x0, x1) with z = x0 + i x1 and rotate by m*theta: f(x, m) = z * exp(i m theta).
# With head_dim 2 the only frequency is theta_0 = base**0 = 1, so rotary.apply rotates by m radians.
theta = 1.0
q, k = rng.standard_normal(2), rng.standard_normal(2)
zq, zk = complex(*q), complex(*k)
for m, n in [(0, 0), (5, 2), (105, 102), (-7, -10)]:
    fq, fk = zq * np.exp(1j * m * theta), zk * np.exp(1j * n * theta)
    score = (fq * fk.conjugate()).real                    # = <f(q, m), f(k, n)> as 2-D vectors
    assert np.isclose(score, (zq * zk.conjugate() * np.exp(1j * (m - n) * theta)).real)
    rq, rk = rotary.apply(q[None], [m])[0], rotary.apply(k[None], [n])[0]
    assert np.isclose(np.dot(rq, rk), score)
    rot = np.array([[np.cos(m * theta), -np.sin(m * theta)], [np.sin(m * theta), np.cos(m * theta)]])
    assert np.allclose(rq, rot @ q)                       # the same as a 2x2 rotation matrix
# --8<-- [end:two_d]

# --8<-- [start:block_diagonal]
d = 16
spec = rotary.RopeSpec(d, base=10000.0, layout="interleaved")
inv_freq = spec.inv_freq()                                 # theta_i = 10000**(-2i/d), float64
R = {p: rotation_matrix(p, inv_freq, d, layout="interleaved") for p in (0, 3, 8, 11, 1000)}
assert np.allclose(R[0], np.eye(d))                         # position 0 is the identity
assert np.allclose(R[3].T @ R[3], np.eye(d))                # orthogonal: norms are kept
assert np.allclose(R[3].T @ R[11], R[8])                    # R_m^T R_n = R_(n-m)
x = rng.standard_normal((4, d))
positions = np.array([0, 3, 11, 1000])
y = rotary.apply(x, positions, spec=spec)                   # float64 in, float64 out
assert np.allclose(y, np.stack([R[p] @ x[t] for t, p in enumerate(positions)]), atol=1e-12)
# --8<-- [end:block_diagonal]

# --8<-- [start:complex]
z = x[:, 0::2] + 1j * x[:, 1::2]                           # interleaved pairs as complex numbers
w = z * np.exp(1j * positions[:, None] * inv_freq)          # Meta's freqs_cis multiplication
assert np.allclose(y[:, 0::2] + 1j * y[:, 1::2], w, atol=1e-12)
half = spec.replace(layout="half")                          # half layout: z_i = x_i + i x_(i + d/2)
yh = rotary.apply(x, positions, spec=half)
zh = (x[:, :d // 2] + 1j * x[:, d // 2:]) * np.exp(1j * positions[:, None] * inv_freq)
assert np.allclose(yh, np.concatenate([zh.real, zh.imag], axis=1), atol=1e-12)
# --8<-- [end:complex]

# --8<-- [start:relative]
q = rng.standard_normal((6, 2, 64)).astype(np.float32)      # (seq, heads, d)
k = rng.standard_normal((6, 2, 64)).astype(np.float32)
spec = rotary.RopeSpec(64, base=500000.0)


def scores(offset):
    """q.k logits after RoPE at positions offset + 0..5, float64 accumulation."""
    qr, kr = rotary.apply_qk(q, k, offset, spec=spec, seq_axis=-3)
    return np.einsum("shd,thd->hst", qr.astype(np.float64), kr.astype(np.float64))


base_scores = scores(0)
for offset in (1, 1000, 2**20, 2**31 - 10):                 # shifting every position changes nothing
    assert np.abs(scores(offset) - base_scores).max() < 1e-4
# --8<-- [end:relative]

# --8<-- [start:decay]
curve = rotary.decay_curve(128, 4096, base=10000.0)
assert np.isclose(curve[0], (64 + 1) / 2)                   # r = 0: mean of |S_j| = j over j = 1..64
assert curve[1000:].max() < 0.5 * curve[0]                  # far tokens: the bound has fallen below half
# --8<-- [end:decay]

if __name__ == "__main__":
    print("theory checks passed")
