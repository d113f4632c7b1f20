"""Independent brute force (docs/certificates.md §8): SLSQP over logits z for every m-subset T of L.

min_z KL(p || softmax(z))  s.t.  z_x >= z_y  for x in T, y in U.  Convex in z with linear
constraints; three starts per subset. Accuracy about 1e-8 relative. Tiny V only.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import optimize

from jaxcert.core import reference


def _kl(p, z):
    z = z - z.max()
    log_q = z - np.log(np.exp(z).sum())
    pos = p > 0
    return float(np.sum(p[pos] * (np.log(p[pos]) - log_q[pos])))


def _project_slsqp(p, upper, subset):
    cons = [
        {"type": "ineq", "fun": (lambda z, x=x, y=y: z[x] - z[y])} for x in subset for y in upper
    ]
    best = math.inf
    rng = np.random.default_rng(0)
    logp = np.log(np.maximum(p, 1e-300))
    for start in (logp, np.zeros_like(p), logp + rng.normal(0, 0.5, p.shape)):
        z0 = start.copy()
        lift = max(z0[list(upper)])  # a feasible start: lift T above U
        z0[list(subset)] = lift + 0.1
        res = optimize.minimize(
            lambda z: _kl(p, z),
            z0,
            method="SLSQP",
            constraints=cons,
            options={"ftol": 1e-15, "maxiter": 1000},
        )
        if res.success or res.status == 8:
            best = min(best, _kl(p, res.x))
    return best


def certificate_slsqp(p, rule) -> float:
    """Numerical ``min_{q in R_p} KL(p||q)`` with no use of Lemmas 1 and 2."""
    p = np.asarray(p, np.float64)
    p = p / p.sum()
    order = np.argsort(-p, kind="stable")
    upper = reference._upper_set(p, order, rule).tolist()
    lower = [i for i in range(p.size) if i not in upper]
    m = rule.list_size
    if len(lower) < m:
        return math.inf
    if not upper:
        return 0.0
    return min(_project_slsqp(p, upper, t) for t in itertools.combinations(lower, m))
