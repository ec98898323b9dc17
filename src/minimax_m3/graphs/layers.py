"""A whole model's figure from graphs traced with a few layers: every per-rank figure the report reads (bytes read,
FLOPs, instructions, collectives) is ``fixed + dense x n_dense + sparse x n_sparse`` for a model of ``n_dense``
dense layers and ``n_sparse`` sparse MoE layers (the layers of one kind are the same graph), so three traces with
independent layer counts give the three terms, and the model's own counts (MiniMax-M3: 3 dense + 57 sparse) its
figure. A fourth trace checks the fit. Pure arithmetic on the report's numbers."""

from __future__ import annotations

from fractions import Fraction

from ..errors import M3Error


class LayerFitError(M3Error, ValueError):
    """Traced layer counts that do not determine the three terms."""


def fit(points: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """``(fixed, per dense layer, per sparse layer)`` from ``{(n_dense, n_sparse): figure}`` (three points whose
    layer counts are independent; exact rational arithmetic)."""
    if len(points) != 3:
        raise LayerFitError(f"need three traced layer counts, got {sorted(points)}")
    rows = [(Fraction(1), Fraction(d), Fraction(s), Fraction(v)) for (d, s), v in sorted(points.items())]

    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    a = [r[:3] for r in rows]
    d = det(a)
    if d == 0:
        raise LayerFitError(f"layer counts {sorted(points)} are not independent: trace another mix of dense and "
                            "sparse layers")
    out = []
    for col in range(3):
        m = [list(r) for r in a]
        for i, r in enumerate(rows):
            m[i][col] = r[3]
        out.append(float(det(m) / d))
    return out[0], out[1], out[2]


def project(terms: tuple[float, float, float], n_dense: int, n_sparse: int) -> float:
    """The figure of a model with ``n_dense`` dense and ``n_sparse`` sparse layers."""
    fixed, dense, sparse = terms
    return fixed + dense * n_dense + sparse * n_sparse
