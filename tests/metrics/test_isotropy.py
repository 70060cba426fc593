"""Isotropy scores on point clouds with known answers, invariances and an independent IsoScore reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llm.metrics.isotropy import (
    basis_alignment,
    effective_rank,
    isoscore,
    isotropy_metrics,
    mean_cosine_similarity,
)

D = 16


def haar_rotation(d: int, seed: int, count: int | None = None) -> torch.Tensor:
    """Haar-random orthogonal matrices (QR of a Gaussian with the sign fix of Mezzadri 2007)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (d, d) if count is None else (count, d, d)
    q, r = torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64))
    return q * torch.diagonal(r, dim1=-2, dim2=-1).sign().unsqueeze(-2)


def gaussian(n: int, d: int = D, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def equal_variance_subspace(n: int, k: int, d: int = D, seed: int = 0) -> torch.Tensor:
    """Points whose covariance has exactly k equal non-zero eigenvalues on a random k-dim subspace."""
    z = gaussian(n, k, seed)
    z, _ = torch.linalg.qr(z - z.mean(dim=0))  # centred, orthonormal columns: Z^T Z = I exactly
    basis = haar_rotation(d, seed + 1)[:, :k]
    return 5.0 + z @ basis.T  # the offset checks that the spectrum is of the *centred* cloud


def isoscore_reference(points: np.ndarray) -> float:
    """Rudman et al. 2022, Algorithm 1 as published (numpy; PCA by SVD projection, np.cov diagonal)."""
    centred = points - points.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    pca = centred @ vt.T
    n = points.shape[1]
    cov_diag = np.diag(np.cov(pca.T))
    normalized = cov_diag * np.sqrt(n) / np.linalg.norm(cov_diag)
    defect = np.linalg.norm(normalized - np.ones(n)) / np.sqrt(2 * (n - np.sqrt(n)))
    return ((n - defect**2 * (n - np.sqrt(n))) ** 2 - n) / (n * (n - 1))


def test_isotropic_gaussian() -> None:
    x = gaussian(20_000)
    assert isoscore(x) > 0.99
    assert abs(mean_cosine_similarity(x)) < 1e-3
    assert effective_rank(x) > 0.995 * D
    assert basis_alignment(x) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_k_equal_directions(k: int) -> None:
    """Variance spread equally over k axes: IsoScore = (k - 1) / (d - 1) and eff. rank = k exactly."""
    x = equal_variance_subspace(200, k)
    assert isoscore(x, finite_sample_correction=False) == pytest.approx((k - 1) / (D - 1), abs=1e-9)
    assert effective_rank(x) == pytest.approx(k, rel=1e-9)


def test_points_on_one_ray() -> None:
    direction = gaussian(1, seed=3)[0]
    scales = torch.rand(100, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.1
    x = scales[:, None] * direction
    assert mean_cosine_similarity(x) == pytest.approx(1.0, abs=1e-12)
    assert isoscore(x, finite_sample_correction=False) == pytest.approx(0.0, abs=1e-9)
    # corrected, one axis: q_hat = n^2/((n-1)(n+2)) (1 - 1/n) lambda^2 = n/(n+2) lambda^2, so k = (n+2)/n
    n = 99  # 100 points
    assert isoscore(x) == pytest.approx((2 / n) / (D - 1), rel=1e-9)
    assert effective_rank(x) == pytest.approx(1.0, abs=1e-9)


def test_isoscore_matches_the_published_algorithm() -> None:
    scales = torch.logspace(-2, 1, D, dtype=torch.float64)
    x = gaussian(500, seed=5) * scales @ haar_rotation(D, 6).T
    raw = isoscore(x, finite_sample_correction=False)
    assert raw == pytest.approx(isoscore_reference(x.numpy()), abs=1e-10)
    assert 0.05 < raw < 0.9  # a case in between, not an end point


def test_effective_rank_of_a_known_spectrum() -> None:
    """Singular values of the centred matrix (2, 1, 1, 0 ...) -> p = (1/2, 1/4, 1/4): erank = exp(H(p))
    (Roy & Vetterli eq. 1-2), not the entropy of the covariance eigenvalues (4, 1, 1)."""
    z, _ = torch.linalg.qr(gaussian(300, 3, seed=7) - gaussian(300, 3, seed=7).mean(dim=0))
    x = (z * torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)) @ haar_rotation(D, 8)[:, :3].T
    p = np.array([2.0, 1.0, 1.0]) / 4.0
    assert effective_rank(x) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-9)


def test_effective_rank_equals_roy_vetterli_on_the_svd() -> None:
    """An independent reference: exp(entropy) of the normalised singular values of the centred matrix."""
    x = gaussian(400, 64, seed=17) * torch.logspace(-1, 1, 64, dtype=torch.float64) + 3.0
    s = torch.linalg.svdvals(x - x.mean(dim=0))
    p = s / s.sum()
    assert effective_rank(x) == pytest.approx(math.exp(-(p * p.log()).sum().item()), rel=1e-10)


@pytest.mark.parametrize("d", [384, 512, 768])  # the 83m, 134m and 250m widths
def test_isoscore_of_an_isotropic_gaussian_does_not_depend_on_the_sample(d: int) -> None:
    """With the training default of 2,048 samples the sample's own IsoScore is ~1 / (1 + d/N) (0.73 at
    d = 768); the finite-sample correction estimates the distribution's, 1."""
    x = gaussian(2048, d, seed=d)
    assert isoscore(x) >= 0.95
    assert isoscore(x, finite_sample_correction=False) == pytest.approx(1 / (1 + d / 2048), abs=0.01)


def test_corrected_isoscore_estimates_the_population_value() -> None:
    """Variance 1 on half of 512 axes and 0.25 on the rest: population k = t^2 / q = 409.6 dimensions."""
    d = 512
    scales = torch.cat([torch.ones(d // 2), torch.full((d // 2,), 0.5)]).double()
    x = gaussian(2048, d, seed=18) * scales @ haar_rotation(d, 19).T
    t, q = (scales**2).sum().item(), (scales**4).sum().item()
    population = (t * t / q - 1) / (d - 1)
    assert isoscore(x) == pytest.approx(population, abs=0.02)
    assert isoscore(x, finite_sample_correction=False) < population - 0.1  # the uncorrected bias


def test_mean_cosine_matches_all_pairs_and_skips_zero_rows() -> None:
    x = gaussian(50, seed=9) + 0.7
    unit = x / x.norm(dim=1, keepdim=True)
    sims = unit @ unit.T
    pairs = sims[~torch.eye(50, dtype=torch.bool)].mean().item()
    with_zeros = torch.cat([x[:20], torch.zeros(3, D, dtype=torch.float64), x[20:]])
    assert mean_cosine_similarity(x) == pytest.approx(pairs, abs=1e-13)
    assert mean_cosine_similarity(with_zeros) == pytest.approx(pairs, abs=1e-13)
    assert mean_cosine_similarity(torch.stack([x[0], -x[0]])) == pytest.approx(-1.0, abs=1e-15)


def laplace(n: int, d: int = D, seed: int = 0) -> torch.Tensor:
    """Axis-aligned heavy tails: i.i.d. Laplace coordinates (kurtosis 6)."""
    u = torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.5
    return -u.sign() * torch.log1p(-2 * u.abs())


def test_basis_alignment_of_axis_aligned_heavy_tails() -> None:
    """i.i.d. coordinates of kurtosis K: E[sum x_i^4] / E[|x|^4] = K / (K + d - 1), so the score is
    K (d + 2) / (3 (K + d - 1)) = 108/63 for Laplace in d = 16; the same cloud rotated scores ~1."""
    x = laplace(200_000)
    assert basis_alignment(x) == pytest.approx(6 * (D + 2) / (3 * (6 + D - 1)), rel=0.02)
    assert basis_alignment(x @ haar_rotation(D, 10).T) == pytest.approx(1.0, abs=0.03)


def test_basis_alignment_of_one_massive_feature() -> None:
    """A large constant on one coordinate (massive activations) drives the score to its maximum (d+2)/3."""
    x = gaussian(1000, seed=11)
    x[:, 3] += 1e4
    assert basis_alignment(x) == pytest.approx((D + 2) / 3, rel=1e-3)
    equal_coordinates = torch.ones(10, D, dtype=torch.float64)  # the minimum (d + 2) / (3 d)
    assert basis_alignment(equal_coordinates) == pytest.approx((D + 2) / (3 * D), rel=1e-14)


def test_basis_alignment_closed_form_equals_the_average_over_sampled_rotations() -> None:
    """kappa(X) / mean_R kappa(X R^T) over many Haar rotations converges to the closed form used."""
    x = laplace(300, d=8, seed=12)

    def kappa(points: torch.Tensor) -> torch.Tensor:
        sq = points * points
        return (sq * sq).sum(-1).mean(-1) / (sq.sum(-1) ** 2).mean(-1)

    rotated = torch.einsum("nd,red->rne", x, haar_rotation(8, 13, count=4000))
    sampled = (kappa(x) / kappa(rotated).mean()).item()
    assert basis_alignment(x) == pytest.approx(sampled, rel=0.01)


def test_rotation_translation_and_scale() -> None:
    """IsoScore and effective rank see only the spectrum; basis alignment sees the basis."""
    x = laplace(2000, seed=14) * torch.linspace(0.5, 2.0, D, dtype=torch.float64)
    moved = 3.0 * x @ haar_rotation(D, 15).T + 7.0
    assert isoscore(moved) == pytest.approx(isoscore(x), abs=1e-10)
    assert effective_rank(moved) == pytest.approx(effective_rank(x), rel=1e-10)
    assert basis_alignment(x @ haar_rotation(D, 15).T) < basis_alignment(x) - 0.3


def test_isotropy_metrics_agrees_with_the_single_functions() -> None:
    x = laplace(300, seed=16).float()  # float32 input is computed in float64
    assert isotropy_metrics(x) == {
        "isoscore": isoscore(x),
        "mean_cos": mean_cosine_similarity(x),
        "eff_rank": effective_rank(x),
        "basis_alignment": basis_alignment(x),
    }


@pytest.mark.parametrize("shape", [(10,), (1, 8), (8, 1), (2, 3, 4)])
def test_rejects_non_point_clouds(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="X: expected a"):
        isoscore(torch.zeros(shape))


def test_degenerate_clouds_are_nan() -> None:
    same = torch.ones(5, D)
    assert math.isnan(isoscore(same)) and math.isnan(effective_rank(same))
    assert math.isnan(basis_alignment(torch.zeros(5, D)))
    assert math.isnan(mean_cosine_similarity(torch.zeros(5, D)))
