"""Isotropy of a point cloud ``X [N, d]`` (N token vectors of width d), computed in float64.

Four views of "how uniformly do the representations use their space":

- ``isoscore``: spread of variance over the principal axes (1 = every direction used equally), of the distribution
  the points are drawn from (uncorrected, a sample of 2048 isotropic Gaussian points in d = 768 scores 0.73).
- ``mean_cosine_similarity``: do the vectors share a common direction (0 = no, 1 = all the same)?
- ``effective_rank``: how many principal axes carry the spread, from the singular values of the
  centred point matrix (Roy & Vetterli 2007; d = all, 1 = a single one).
- ``basis_alignment``: is the mass concentrated on the *standard-basis* axes (outlier features),
  which the three rotation-invariant scores above cannot see? (1 = no preferred basis.)

Each function is pure; ``isotropy_metrics`` computes all four sharing one eigen-decomposition.
"""

from __future__ import annotations

import math

import torch


def _as_points(X: torch.Tensor) -> torch.Tensor:
    if X.dim() != 2 or X.shape[0] < 2 or X.shape[1] < 2:
        raise ValueError(f"X: expected a [N, d] point cloud with N >= 2 and d >= 2, got shape {tuple(X.shape)}")
    return X.detach().to(torch.float64)


def _covariance_spectrum(X: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of the sample covariance of ``X`` (float64, >= 0, ascending).

    These are the variances of the points after PCA reorientation (the coordinates along the
    principal axes are uncorrelated, so their covariance is the diagonal of eigenvalues).
    """
    return torch.linalg.eigvalsh(torch.cov(X.T)).clamp_min(0.0)  # rounding leaves tiny negative eigenvalues


def _isoscore_from_spectrum(variances: torch.Tensor, n_samples: int | None) -> float:
    """IsoScore from the covariance eigenvalues of ``n_samples`` points; ``None``: no correction.

    Rudman et al. 2022, Algorithm 1, in closed form. With t = sum(lambda) and q = sum(lambda^2), step 4
    rescales the variance vector to norm sqrt(d) (lambda_hat = lambda sqrt(d / q)), step 5 takes the defect
    delta^2 = |lambda_hat - 1|^2 / (2 (d - sqrt(d))) = d (1 - t / sqrt(d q)) / (d - sqrt(d)), and step 6's
    dimensions used, k = (d - delta^2 (d - sqrt(d)))^2 / d, simplify to k = t^2 / q (the participation
    ratio); IsoScore = (k - 1) / (d - 1).

    Finite-sample correction: the eigenvalues of a sample covariance spread around the population's
    (Marchenko-Pastur), which inflates q by about (1 + d/N) and deflates IsoScore accordingly. We use
    Srivastava (2005)'s estimator of the population's tr(Sigma^2), unbiased for Gaussian samples: with
    n = N - 1, ``q_hat = n^2 / ((n - 1)(n + 2)) * (q - t^2 / n)`` (t is unbiased already). k is then
    clipped to [1, d], its range. For a non-Gaussian cloud the correction is approximate.
    """
    d = variances.numel()
    total, sum_sq = variances.sum().item(), variances.pow(2).sum().item()
    if sum_sq == 0:
        return math.nan
    if n_samples is not None:
        n = n_samples - 1
        sum_sq = n * n / ((n - 1) * (n + 2)) * (sum_sq - total * total / n)
    dims_used = min(max(total * total / sum_sq, 1.0), float(d)) if sum_sq > 0 else float(d)
    return (dims_used - 1.0) / (d - 1.0)


def _effective_rank_from_spectrum(variances: torch.Tensor) -> float:
    """Roy & Vetterli's effective rank of the centred point matrix from its covariance eigenvalues:
    its singular values are sqrt((N - 1) lambda), and the constant factor cancels in p.

    Eigenvalues below the rounding level of the eigensolver (``lambda_max * d * eps``, the tolerance of
    ``torch.linalg.matrix_rank``) are zero: their square roots (~1e-8 of the largest) would otherwise add
    phantom directions."""
    tolerance = variances.max() * variances.numel() * torch.finfo(variances.dtype).eps
    singular_values = torch.where(variances > tolerance, variances, 0.0).sqrt()
    total = singular_values.sum()
    if total == 0:
        return math.nan
    p = singular_values / total
    entropy = -torch.special.xlogy(p, p).sum()  # xlogy(0, 0) = 0: empty directions add nothing
    return math.exp(entropy.item())


def isoscore(X: torch.Tensor, finite_sample_correction: bool = True) -> float:
    """IsoScore of the point cloud ``X [N, d]`` in [0, 1]: Rudman, Gillman, Rayne, Eickhoff, "IsoScore: Measuring
    the Uniformity of Embedding Space Utilization", Findings of ACL 2022, Algorithm 1 (its steps in closed form:
    ``_isoscore_from_spectrum``).

    1 for an isotropic cloud, 0 when all variance lies on one axis; exactly ``(k - 1) / (d - 1)``
    when the variance is spread equally over k of the d principal axes. Invariant to rotation,
    translation and scale. ``nan`` when all points coincide.

    By default it estimates the IsoScore of the distribution the points come from (the finite-sample
    correction of ``_isoscore_from_spectrum``): an isotropic Gaussian then scores ~1 at any N and d,
    where the sample's own score is about 1 / (1 + d/N). ``finite_sample_correction=False`` gives
    Algorithm 1 on the sample as published.
    """
    X = _as_points(X)
    return _isoscore_from_spectrum(_covariance_spectrum(X), X.shape[0] if finite_sample_correction else None)


def mean_cosine_similarity(X: torch.Tensor) -> float:
    """Mean cosine similarity over the ``N (N - 1) / 2`` distinct pairs of rows of ``X``.

    With unit vectors ``u_i = x_i / |x_i|`` and ``s = sum_i u_i``,
    ``sum_{i != j} u_i . u_j = |s|^2 - N``, so the mean is ``(|s|^2 - N) / (N (N - 1))``: O(N d)
    time and memory instead of the N x N similarity matrix. Not centred: a common offset of all
    vectors (the "narrow cone" of Ethayarajh 2019) is exactly what it measures. Zero vectors have
    no direction and are left out; ``nan`` if fewer than two remain.
    """
    X = _as_points(X)
    norms = X.norm(dim=1)
    units = X[norms > 0] / norms[norms > 0, None]
    n = units.shape[0]
    if n < 2:
        return math.nan
    s = units.sum(dim=0)
    return ((s @ s).item() - n) / (n * (n - 1))


def effective_rank(X: torch.Tensor) -> float:
    """Effective rank of the centred point matrix ``X - mean(X)`` (``[N, d]``), in [1, d].

    Roy & Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007,
    eq. 1-2: with the matrix's singular values ``s_k`` and ``p_k = s_k / sum_j s_j``,
    ``erank = exp(-sum_k p_k log p_k)``. (The singular values are the square roots of the covariance
    eigenvalues up to a constant, so this differs from the entropy of the eigenvalues themselves,
    which counts fewer dimensions for an anisotropic cloud.) Exactly k when the variance is spread
    equally over k principal axes; invariant to rotation, translation and scale. ``nan`` when all
    points coincide.
    """
    return _effective_rank_from_spectrum(_covariance_spectrum(_as_points(X)))


def basis_alignment(X: torch.Tensor) -> float:
    """How much more the rows of ``X`` concentrate on standard-basis axes than a random basis would.

    The statistic ``kappa(X) = E[sum_i x_i^4] / E[|x|^4]`` (expectations over the rows, not
    centred) is 1 when every row lies on an axis and 1/d when every coordinate is equal in size.
    We score it relative to the same statistic after a random rotation ``R``. Its average
    over Haar-random rotations has a closed form, for every distribution of x: ``Rx`` is uniform
    on the sphere of radius ``|x|``, whose coordinates have ``E[u_i^4] = 3 / (d (d + 2))``, so
    ``E_R[sum_i (Rx)_i^4] = 3 |x|^4 / (d + 2)`` and ``E_R[kappa(XR^T)] = 3 / (d + 2)``. We use this
    exact average instead of a few sampled rotations, so the score carries no sampling noise:

        basis_alignment(X) = kappa(X) (d + 2) / 3,   in [(d + 2) / (3 d), (d + 2) / 3].

    ~1: no preferred basis (exactly 1 in expectation for an isotropic Gaussian). > 1: mass sits
    on a few coordinates, e.g. the outlier / massive-activation features of LLM residual streams
    (not centred, so a large constant offset on one coordinate counts). Not rotation invariant,
    by design. ``nan`` for an all-zero cloud.
    """
    X = _as_points(X)
    squares = X * X
    mean_norm4 = (squares.sum(dim=1) ** 2).mean()
    if mean_norm4 == 0:
        return math.nan
    kappa = (squares * squares).sum(dim=1).mean() / mean_norm4
    return kappa.item() * (X.shape[1] + 2) / 3.0


def isotropy_metrics(X: torch.Tensor) -> dict[str, float]:
    """All four scores of ``X [N, d]`` keyed as in metrics.jsonl, with one eigen-decomposition."""
    X = _as_points(X)
    spectrum = _covariance_spectrum(X)
    return {"isoscore": _isoscore_from_spectrum(spectrum, X.shape[0]), "mean_cos": mean_cosine_similarity(X),
            "eff_rank": _effective_rank_from_spectrum(spectrum), "basis_alignment": basis_alignment(X)}
