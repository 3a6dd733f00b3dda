"""Delta-space arithmetic on LoRA factors, in one place (pure: no I/O; torch, fp64).

A LoRA module's delta is D = s * B @ A (A [r, in], B [out, r]). Two facts make averaging and
resizing exact and cheap (docs/delta-space.md has the derivations):

- A weighted sum of deltas is itself a LoRA: sum_i c_i * s_i * B_i @ A_i = B_cat @ A_cat with A_cat
  the A_i stacked by rows and B_cat the B_i * (c_i * s_i) concatenated by columns (`stack_terms`),
  rank sum(r_i). Nothing is approximated and no base weight is touched.
- The best rank-k approximation of D = B @ A (Eckart-Young, Frobenius and spectral norm) comes from
  the SVD of the small r x r core of two thin QRs: A^T = Qa Ra, B = Qb Rb, so D = Qb (Rb Ra^T) Qa^T and
  Rb Ra^T = U S V^T gives D = (Qb U) S (Qa V)^T (`truncate`). The d x d product is never formed.

Everything is computed in fp64; callers round the results once (to fp32) when they write them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import UsageError

__all__ = ["Truncation", "choose_rank", "ema_weights", "normalize_weights", "stack_terms", "truncate"]


def normalize_weights(weights: Sequence[float], *, what: str = "--weights") -> list[float]:
    """Weights divided by their sum (a weighted mean). Each must be finite and the sum positive."""
    ws = [float(w) for w in weights]
    if not ws:
        raise UsageError(f"{what}: no weights")
    bad = [w for w in ws if not math.isfinite(w)]
    try:
        total = math.fsum(ws) if not bad else math.nan
    except OverflowError:  # 1e308,1e308: the same ratios over the largest, whose sum cannot overflow
        big = max(abs(w) for w in ws)
        ws = [w / big for w in ws]
        total = math.fsum(ws)
    if bad or not total > 0:
        raise UsageError(
            f"{what} {[float(w) for w in weights]}: weights must be finite numbers with a positive sum",
            hint="e.g. --weights 1,1,2 (divided by their sum: 0.25, 0.25, 0.5)",
        )
    return [w / total for w in ws]


def ema_weights(n: int, beta: float) -> list[float]:
    """The weights that the recurrence ema_1 = x_1, ema_t = beta * ema_(t-1) + (1 - beta) * x_t gives
    x_1..x_n in ema_n: beta^(n-1) for x_1 (the first step seeds the average, no bias towards zero) and
    (1 - beta) * beta^(n-t) for x_t, t >= 2. They sum to 1."""
    if n < 1:
        raise UsageError("--ema needs at least one input")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and 0 <= beta < 1):
        raise UsageError(f"--ema {beta!r}: beta must be in [0, 1)", hint="e.g. --ema 0.9")
    beta = float(beta)
    return [beta ** (n - 1)] + [(1 - beta) * beta ** (n - t) for t in range(2, n + 1)]


def stack_terms(
    terms: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_cat, B_cat), fp64, with B_cat @ A_cat == sum_i coef_i * B_i @ A_i for terms (A_i, B_i, coef_i):
    A_i stacked by rows, B_i * coef_i side by side. New tensors; the inputs are not modified."""
    if not terms:
        raise ValueError("stack_terms needs at least one term")
    a = torch.cat([t[0].to(torch.float64) for t in terms], dim=0)
    b = torch.cat([t[1].to(torch.float64) * float(t[2]) for t in terms], dim=1)
    return a, b


def _core(a: torch.Tensor, b: torch.Tensor):
    """Qb, U, S, Vh, Qa with B @ A = Qb U diag(S) Vh Qa^T (thin QRs of B and A^T, SVD of the core)."""
    qa, ra = torch.linalg.qr(a.to(torch.float64).T, mode="reduced")  # A^T = Qa Ra: [in, m], [m, r]
    qb, rb = torch.linalg.qr(b.to(torch.float64), mode="reduced")  # B = Qb Rb: [out, p], [p, r]
    u, s, vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)  # [p, m] = U S Vh
    return qb, u, s, vh, qa


def choose_rank(s: torch.Tensor, *, rank: int | None = None, energy: float | None = None) -> int:
    """k for `--rank K` (min(K, len(s))) or `--energy E`: the smallest k whose leading singular values
    keep at least E of sum(s^2) (at least 1, so a module stays a LoRA; a zero delta keeps rank 1)."""
    if (rank is None) == (energy is None):
        raise UsageError("pass exactly one of --rank K or --energy E")
    n = int(s.numel())
    if rank is not None:
        if int(rank) < 1:
            raise UsageError(f"--rank {rank}: must be >= 1")
        return max(1, min(int(rank), n))
    assert energy is not None  # exactly one of the two (checked above)
    if not (math.isfinite(energy) and 0 < energy <= 1):
        raise UsageError(f"--energy {energy!r}: must be in (0, 1]", hint="e.g. --energy 0.99")
    sq = s.to(torch.float64) ** 2
    total = float(sq.sum())
    if total == 0:
        return 1
    cum = torch.cumsum(sq, 0) / total
    # the tolerance keeps --energy 1 from asking for ranks beyond the fp64 rounding of a full sum
    return max(1, min(n, int((cum < energy - 1e-12).sum()) + 1))


@dataclass(frozen=True)
class Truncation:
    """What bringing one module to rank k kept and lost (fp64 figures, Frobenius norms)."""

    rank_in: int  # the rank of the factors given (rows of A)
    rank: int  # k, the rank written
    energy_total: float  # ||D||_F^2 = sum s_i^2
    energy_kept: float  # sum of the k largest s_i^2
    error: float  # ||D - D_k||_F = sqrt(sum of the discarded s_i^2)
    sigma_max: float
    sigma_next: float  # s_(k+1), 0 when none is discarded: the spectral-norm error

    @property
    def kept_fraction(self) -> float:
        return self.energy_kept / self.energy_total if self.energy_total > 0 else 1.0

    def to_json(self) -> dict:
        return {
            "rank_in": self.rank_in,
            "rank": self.rank,
            "energy_kept": self.kept_fraction,
            "error": self.error,
            "relative_error": (self.error / math.sqrt(self.energy_total) if self.energy_total > 0 else 0.0),
            "norm": math.sqrt(self.energy_total),
            "sigma_max": self.sigma_max,
            "sigma_next": self.sigma_next,
        }


def truncate(
    a: torch.Tensor, b: torch.Tensor, *, rank: int | None = None, energy: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, Truncation]:
    """(A_k [k, in], B_k [out, k], facts): the best rank-k LoRA of B @ A (fp64), k from `choose_rank`.
    The singular values are split evenly between the factors (B_k = Qb U_k sqrt(S_k), A_k = sqrt(S_k)
    V_k^T Qa^T), so neither factor carries the whole magnitude. Scale 1: fold any LoRA scale into B
    before calling."""
    qb, u, s, vh, qa = _core(a, b)
    k = choose_rank(s, rank=rank, energy=energy)
    root = s[:k].sqrt()
    b_k = (qb @ u[:, :k]) * root
    a_k = root[:, None] * (vh[:k] @ qa.T)
    sq = s**2
    facts = Truncation(
        rank_in=int(a.shape[0]),
        rank=k,
        energy_total=float(sq.sum()),
        energy_kept=float(sq[:k].sum()),
        error=math.sqrt(float(sq[k:].sum())),
        sigma_max=float(s[0]) if s.numel() else 0.0,
        sigma_next=float(s[k]) if s.numel() > k else 0.0,
    )
    return a_k, b_k, facts
