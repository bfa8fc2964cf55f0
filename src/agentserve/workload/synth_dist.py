"""Quantile-matched distributions for the synthesizer (closed form, no fitting loops).

`Spliced.fit([(u1, x1), (u2, x2), (u3, x3)])` is a lognormal whose log-quantile function is
piecewise linear in the normal score z = Phi^-1(u): through (z1, ln x1) and (z2, ln x2) for
the body (and below), and through (z2, ln x2), (z3, ln x3) for the upper tail. With two
points it is a plain lognormal: sigma = (ln x2 - ln x1) / (z2 - z1), mu = ln x1 - sigma z1.
Published p50/p90/p99 therefore map to parameters exactly, and sampling is inverse-CDF.

`stratified(rng, n)` draws n uniforms one per stratum [k/n, (k+1)/n) in random order (Latin
hypercube), so corpus-level marginals (turns per session, group sizes) land on their
targets with far less seed-to-seed noise than iid draws, while staying random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_N = NormalDist()
Z50, Z90, Z99 = 0.0, _N.inv_cdf(0.90), _N.inv_cdf(0.99)


def z(u: float) -> float:
    return _N.inv_cdf(u)


def cdf(x: float) -> float:
    return _N.cdf(x)


@dataclass(frozen=True, slots=True)
class Spliced:
    """Lognormal body (mu, sigma) spliced at z_split onto a tail of slope sigma_tail."""

    mu: float
    sigma: float
    z_split: float = math.inf
    sigma_tail: float = 0.0

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> Spliced:
        """Match quantiles: points are (probability, value), 2 or 3 of them, increasing."""
        (u1, x1), (u2, x2) = points[0], points[1]
        z1, z2 = z(u1), z(u2)
        sigma = (math.log(x2) - math.log(x1)) / (z2 - z1)
        mu = math.log(x1) - sigma * z1
        if len(points) == 2:
            return cls(mu, sigma)
        u3, x3 = points[2]
        return cls(mu, sigma, z2, (math.log(x3) - math.log(x2)) / (z(u3) - z2))

    def ppf_z(self, zs: np.ndarray) -> np.ndarray:
        """Quantile at normal scores `zs` (vectorised)."""
        zs = np.asarray(zs, dtype=np.float64)
        body = self.mu + self.sigma * zs
        if math.isfinite(self.z_split):
            split = self.mu + self.sigma * self.z_split
            body = np.where(zs > self.z_split, split + self.sigma_tail * (zs - self.z_split), body)
        return np.exp(body)

    def ppf(self, u: np.ndarray | float) -> np.ndarray:
        """Quantile at probabilities `u`."""
        return self.ppf_z(normal_scores(np.atleast_1d(u)))

    def sample(self, rng: np.random.Generator, size: int | tuple = ()) -> np.ndarray:
        return self.ppf_z(rng.standard_normal(size))

    def mean(self, lo: float = 0.0, hi: float = math.inf, n: int = 20000) -> float:
        """Mean of the distribution clipped to [lo, hi], by midpoint quadrature in u."""
        return float(np.clip(self.ppf((np.arange(n) + 0.5) / n), lo, hi).mean())


def stratified(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniforms, one in each of n equal strata, randomly permuted."""
    return (rng.permutation(n) + rng.random(n)) / n


def normal_scores(u: np.ndarray) -> np.ndarray:
    """Phi^-1 of an array (NormalDist per element: called once per corpus, n ~ 1e3)."""
    return np.array([z(min(max(x, 1e-12), 1 - 1e-12)) for x in np.asarray(u).ravel()])
