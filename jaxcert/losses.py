"""Differentiable certificate-violation losses, in optax style.

A drafter ``q`` is guaranteed to be accepted at a position when ``KL(p||q) < C_p``
(the exact certificate of the verification rule). These losses penalise the excess
``KL(p||q) - C_p (+ margin)`` per position, so that a drafter trained with them is
accepted more often, not just closer on average. Like optax losses they reduce over the
vocabulary only: the caller reduces over positions (see :func:`cvar` for a worst-group
reduction).

Gradients flow to the drafter logits. The target side is a constant by default; with
``differentiate_target=True`` gradients also flow to the target logits, through
``KL(p||q)`` and through ``C_p`` with the exact sensitivity ``dC/dp_i = log(p_i / c)`` on
the pool and 0 elsewhere (``docs/certificates.md`` §6), implemented as a custom VJP (no
differentiation through the solver's sort).

Source: "When Is a Draft Accepted?" (2026), its training on certificate violation;
``docs/certificates.md`` §6 (sensitivities).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxcert.base.validate import check_float, check_mask_shape, check_probability
from jaxcert.core import collectives, numerics
from jaxcert.core import rules as rules_lib
from jaxcert.core.solver import DEFAULT_TOP_K, certificate

__all__ = [
    "kl_divergence",
    "certificate_value",
    "certificate_violation",
    "certificate_violation_softplus",
    "certificate_ratio",
    "certificate_miss",
    "rejection_rate",
    "cvar",
]


def _check_pair(drafter_logits, target_logits):
    d = jnp.asarray(drafter_logits)
    t = jnp.asarray(target_logits)
    for name, a in (("drafter_logits", d), ("target_logits", t)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.ndim < 1:
            raise ValueError(f"{name} must be floating [..., V], got {a.dtype} {a.shape}")
    if d.shape != t.shape:
        raise ValueError(
            f"drafter and target logits must have the same shape [..., V] (same vocabulary), "
            f"got {d.shape} and {t.shape}"
        )
    return d, t


def _masked(where, shape, *arrays):
    """Replaces masked rows by zeros so that they produce neither NaN values nor gradients."""
    if where is None:
        return None, arrays
    where = jnp.asarray(where, bool)
    check_mask_shape("where", where.shape, shape[:-1], what="the logits' leading shape [...]")
    mask = jnp.broadcast_to(where, shape[:-1])
    return mask, tuple(jnp.where(mask[..., None], a, jnp.zeros((), a.dtype)) for a in arrays)


def _normalizer(x, axis_name):
    """``collectives.normalizer`` with its sum in a fusion of its own on CPU: XLA:CPU
    otherwise writes ``x - max`` out, to share it with the later passes."""
    x_max = collectives.vocab_max(x, axis_name)

    def total():  # this shard's sum; the collective stays outside the conditional
        return jnp.sum(jnp.exp(x - x_max[..., None]), axis=-1)

    return x_max, _psum(numerics.unfused(total, _probe(x_max)), axis_name)


def _probe(rows):
    """A scalar of the rows for :func:`numerics.unfused`: a reduction, not a slice (slicing
    an explicitly sharded array is refused), and a sum (XLA folds a maximum of row maxima
    into one more pass over the logits)."""
    return jnp.sum(rows)


def _psum(x, axis_name):
    return x if axis_name is None else lax.psum(x, axis_name)


def _kl_value(t, d, axis_name):
    """``KL(p || q)`` per row and a function giving ``(log_p, log_q, p)`` (for the
    derivatives, which compute them where they are used): ``(kl, logs)``.

    One normaliser per side (maximum, sum of ``exp``) and one pass over both for the sum;
    ``log_p`` and ``log_q`` are relative to each row's maximum (offset-free).
    """
    t_max, t_sum = _normalizer(t, axis_name)
    d_max, d_sum = _normalizer(d, axis_name)
    t_log_sum, d_log_sum = jnp.log(t_sum)[..., None], jnp.log(d_sum)[..., None]

    def logs():
        log_p = (t - t_max[..., None]) - t_log_sum
        return log_p, (d - d_max[..., None]) - d_log_sum, jnp.exp(log_p)

    def total():  # from the logits, in one fusion on CPU (no array of logs written)
        log_p, log_q, p = logs()
        positive = p > 0
        # q may be 0 where p is 0 (0 log 0 = 0); where p > 0 and q = 0 the KL is +inf.
        terms = jnp.where(positive, p * (log_p - jnp.where(positive, log_q, 0.0)), 0.0)
        return jnp.sum(terms, axis=-1)

    kl = _psum(numerics.unfused(total, _probe(t_sum)), axis_name)
    # A row that is no distribution (NaN, +inf, or no finite logit: all -inf) has no KL;
    # without this an all -inf target gave 0 (every p = NaN fails `p > 0`).
    ok = jnp.isfinite(t_max) & jnp.isfinite(d_max)
    return jnp.where(ok, kl, jnp.nan), logs


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _kl(target_logits, drafter_logits, axis_name=None):
    return _kl_value(target_logits, drafter_logits, axis_name)[0]


def _kl_jvp(axis_name, primals, tangents):
    """The exact derivatives, each one pass: ``dKL/dd_j = q_j - p_j`` and
    ``dKL/dt_j = p_j (log p_j - log q_j - KL)`` (0 where ``p_j = 0``, and on a row whose KL
    is ``+inf``, where ``q - p`` is still the drafter's direction). Written out so that
    reverse mode reads the logits a few times, not the ~21 array reads of differentiating
    two ``log_softmax`` (``docs/benchmarks.md``, "The solver"); a side that is not
    differentiated (``stop_gradient``, a constant) costs nothing."""
    t, d = primals
    dt, dd = tangents
    kl, logs = _kl_value(t, d, axis_name)
    log_p, log_q, p = logs()
    tangent = jnp.zeros_like(kl)
    if not isinstance(dd, SymbolicZero):
        tangent = tangent + collectives.vocab_sum((jnp.exp(log_q) - p) * dd, axis_name)
    if not isinstance(dt, SymbolicZero):
        gap = log_p - log_q - kl[..., None]
        gap = jnp.where((p > 0) & jnp.isfinite(gap), gap, 0.0)  # KL = +inf: no direction
        tangent = tangent + collectives.vocab_sum(p * gap * dt, axis_name)
    return kl, tangent


_kl.defjvp(_kl_jvp, symbolic_zeros=True)


def kl_divergence(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``KL(p || q)`` in nats per position, ``p = softmax(target)``, ``q = softmax(drafter)``.

    This is the direction the certificates use (and the usual distillation loss). The
    drafter comes first, as in every loss of this module and as optax puts the predictions
    first; pass both by keyword to make the direction explicit.

    Args:
      drafter_logits: ``[..., V]`` drafter logits.
      target_logits: ``[..., V]`` target logits (same shape).
      where: optional ``[...]`` bool mask, the logits' leading shape (axes of size 1
        broadcast; the rank must match); masked positions give exactly 0.
      axis_name: mesh axis name(s) splitting the vocabulary, when called inside
        ``shard_map`` on vocabulary shards (collective max and sums; see
        :func:`jaxcert.certificates` for sharded inputs outside ``shard_map``).

    Returns:
      ``[...]`` float32 (float64 for float64 input); ``nan`` where a target or drafter row
      is no distribution (a NaN or ``+inf`` logit, or no finite logit), ``+inf`` where the
      drafter gives 0 to a token the target does not.

    Derivatives are exact and written out, in forward and reverse mode and to any order:
    ``q - p`` for the drafter's logits, ``p (log p - log q - KL)`` for the target's (0 on a
    row whose KL is ``+inf``). ``value_and_grad`` reads the logits about 11 times in units
    of one array, not the ~21 of differentiating two ``log_softmax``
    (``docs/benchmarks.md``, "The solver").

    Raises:
      ValueError: non-floating inputs, mismatched shapes, or a ``where`` mask of another
        rank than the leading shape (it is not broadcast from the right).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcert.losses import kl_divergence
      >>> p, q = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.9, 0.1]))
      >>> round(float(kl_divergence(drafter_logits=q, target_logits=p)), 4)  # KL(p||q)
      0.5108
    """
    d, t = _check_pair(drafter_logits, target_logits)
    dtype = numerics.compute_dtype(d.dtype, t.dtype)
    mask, (d, t) = _masked(where, d.shape, d.astype(dtype), t.astype(dtype))
    kl = _kl(t, d, axis_name)
    return kl if mask is None else jnp.where(mask, kl, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _certificate_value(target_logits, rule, top_k, axis_name):
    return certificate(target_logits, rule, top_k=top_k, axis_name=axis_name).value


def _certificate_value_fwd(target_logits, rule, top_k, axis_name):
    cert = certificate(target_logits, rule, return_q=True, top_k=top_k, axis_name=axis_name)
    return cert.value, (target_logits, cert.q_star, cert.level, cert.value)


def _certificate_value_bwd(rule, top_k, axis_name, residuals, cotangent):
    del rule, top_k
    target_logits, q_star, level, value = residuals
    log_p = collectives.log_softmax(target_logits, axis_name)
    p = jnp.exp(log_p)
    ok = jnp.isfinite(value) & (value > 0)
    pooled = (q_star == level[..., None]) & (p > 0) & ok[..., None]
    safe_level = jnp.where(ok, level, 1.0)
    grad_p = jnp.where(pooled, log_p - jnp.log(safe_level)[..., None], 0.0)  # dC/dp
    # Chain through p = softmax(z): dC/dz_j = p_j (g_j - sum_i p_i g_i).
    mean = collectives.vocab_sum(p * grad_p, axis_name)[..., None]
    grad_z = p * (grad_p - mean)
    ct = jnp.where(ok, cotangent, 0.0)
    return (ct[..., None] * grad_z,)


_certificate_value.defvjp(_certificate_value_fwd, _certificate_value_bwd)


def certificate_value(
    target_logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """The certificate ``C_p`` (nats, ``[...]``) as a differentiable function of the target.

    The gradient is the exact sensitivity of ``docs/certificates.md`` §6, ``dC/dp_i = log(p_i / c)``
    on the pool and 0 elsewhere, chained through the softmax; it is 0 where ``C_p`` is 0 or
    ``+inf``. See :func:`jaxcert.certificate` for the value itself.
    """
    return _certificate_value(jnp.asarray(target_logits), rule, top_k, axis_name)


def _excess(
    drafter_logits, target_logits, rule, margin, where, differentiate_target, top_k, axis_name
):
    d, t = _check_pair(drafter_logits, target_logits)
    dtype = numerics.compute_dtype(d.dtype, t.dtype)
    mask, (d, t) = _masked(where, d.shape, d.astype(dtype), t.astype(dtype))
    if not differentiate_target:
        t = jax.lax.stop_gradient(t)
    kl = _kl(t, d, axis_name)
    c = _certificate_value(t, rule, top_k, axis_name)
    # -inf where rejection is impossible (C_p = +inf), whatever KL (+inf - +inf is no excess)
    excess = jnp.where(c == jnp.inf, -jnp.inf, kl - c + margin)
    return excess, kl, c, mask


def _positive(name: str, value):
    """``value`` if it is a finite number ``> 0`` (Python, NumPy or a concrete JAX scalar);
    a traced value (an annealed temperature under ``jit``) is the caller's to keep positive.

    Raises:
      ValueError: naming ``name``, otherwise.
    """
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
        kind = np.asarray(value).dtype
        if np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer):
            value = float(value)
    check_float(name, value, strict=True)
    return value


def _finish(loss, mask):
    return loss if mask is None else jnp.where(mask, loss, 0.0)


def certificate_violation(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    margin: float = 0.0,
    where: jax.typing.ArrayLike | None = None,
    differentiate_target: bool = False,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Hinge on the certificate: ``relu(KL(p||q) - C_p + margin)`` per position.

    The loss is 0 exactly where ``KL(p||q) <= C_p - margin``, i.e. where the drafter is
    certified (with a safety margin) to be accepted by ``rule``.

    Args:
      drafter_logits: ``[..., V]`` drafter logits (the trained side).
      target_logits: ``[..., V]`` target logits, same shape and vocabulary.
      rule: a verification rule (:mod:`jaxcert.core.rules`).
      margin: nats added to the excess; ``> 0`` asks for slack below the certificate.
      where: optional ``[...]`` bool mask of the logits' leading shape (axes of size 1
        broadcast; the rank must match); masked positions give exactly 0 loss and 0
        gradient (even if their logits are NaN).
      differentiate_target: also differentiate w.r.t. the target logits (default: the
        target is a constant, ``stop_gradient``).
      top_k: solver window (see :func:`jaxcert.certificates`).
      axis_name: mesh axis name(s) splitting the vocabulary, when called inside
        ``shard_map`` on vocabulary shards.

    Returns:
      ``[...]`` losses in nats, float32 (float64 for float64 input); no reduction over
      positions. Positions where rejection is impossible (``C_p = +inf``) give 0 loss and 0
      gradient.

    Raises:
      ValueError: non-floating inputs or mismatched shapes.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcert
      >>> target = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
      >>> loss = lambda d: jaxcert.losses.certificate_violation(
      ...     d, target, jaxcert.StrictGreedy()).mean()
      >>> grads = jax.grad(loss)(jnp.log(jnp.array([[0.2, 0.7, 0.1]])))
    """
    excess, _, _, mask = _excess(
        drafter_logits, target_logits, rule, margin, where, differentiate_target, top_k, axis_name
    )
    return _finish(jax.nn.relu(excess), mask)


def certificate_violation_softplus(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    temperature: float = 0.05,
    margin: float = 0.0,
    where: jax.typing.ArrayLike | None = None,
    differentiate_target: bool = False,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Smooth hinge: ``temperature * softplus((KL - C_p + margin) / temperature)``.

    Tends to :func:`certificate_violation` as ``temperature -> 0``; positive everywhere,
    so certified positions still get a small push towards a larger slack. ``+inf``
    certificates give exactly 0. Arguments and returns as :func:`certificate_violation`.

    Raises:
      ValueError: ``temperature <= 0``, or as :func:`certificate_violation`.
    """
    temperature = _positive("temperature", temperature)
    excess, _, _, mask = _excess(
        drafter_logits, target_logits, rule, margin, where, differentiate_target, top_k, axis_name
    )
    return _finish(temperature * jax.nn.softplus(excess / temperature), mask)


def certificate_miss(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    temperature: float = 0.1,
    margin: float = 0.0,
    where: jax.typing.ArrayLike | None = None,
    differentiate_target: bool = False,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Smoothed miss of the certificate: ``sigmoid((KL(p||q) - C_p + margin) / temperature)``.

    The mean over positions is a smooth count of the positions the certificate does not
    cover (the step ``KL >= C_p`` is the limit ``temperature -> 0``). Its gradient is
    ``sigmoid' / temperature`` times KL's, so it is concentrated on positions within a few
    ``temperature`` of the boundary ``KL = C_p``: those a small change of ``q`` certifies or
    loses. KL's own gradient is blind to ``C_p`` and spends as much on positions far above
    the certificate (which no small step certifies) as near it; a hinge
    (:func:`certificate_violation`) is KL's gradient wherever it is active. Added to KL
    (``docs/training.md``, "Fine-tuning a drafter at the boundary"), it asks for certified
    positions rather than a lower mean.

    Arguments as :func:`certificate_violation`; ``temperature`` in nats, ``> 0``.

    Returns:
      ``[...]`` values in ``[0, 1]``, float32 (float64 for float64 input); 0 where
      rejection is impossible (``C_p = +inf``) and on masked positions (0 gradient there).

    Raises:
      ValueError: ``temperature <= 0``, or as :func:`certificate_violation`.
    """
    temperature = _positive("temperature", temperature)
    excess, _, _, mask = _excess(
        drafter_logits, target_logits, rule, margin, where, differentiate_target, top_k, axis_name
    )
    return _finish(jax.nn.sigmoid(excess / temperature), mask)


def rejection_rate(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """The expected rejection of one drafted token at T = 1: ``TV(p, q) = 1 - sum_x min(p, q)``.

    Speculative sampling accepts a token drawn from ``q`` with probability
    ``sum_x min(p_x, q_x)`` (Leviathan et al. 2023, Theorem 3.5), so this is the acceptance
    objective of drafter training (speculators' ``tv`` loss). Computed as
    ``0.5 * sum_x |p_x - q_x|`` (accurate when it is small).

    Args:
      drafter_logits: ``[..., V]`` drafter logits (the trained side).
      target_logits: ``[..., V]`` target logits (a constant: no gradient flows to it).
      where: optional ``[...]`` bool mask (as :func:`kl_divergence`); masked positions give
        exactly 0 and 0 gradient.
      axis_name: mesh axis name(s) splitting the vocabulary inside ``shard_map``.

    Returns:
      ``[...]`` in ``[0, 1]``, float32 (float64 for float64 input); ``nan`` where a row is
      no distribution (as :func:`kl_divergence`).

    Raises:
      ValueError: non-floating inputs, mismatched shapes, or a mask of another rank.
    """
    d, t = _check_pair(drafter_logits, target_logits)
    dtype = numerics.compute_dtype(d.dtype, t.dtype)
    mask, (d, t) = _masked(where, d.shape, d.astype(dtype), t.astype(dtype))
    t = lax.stop_gradient(t)
    p = jnp.exp(collectives.log_softmax(t, axis_name))
    q = jnp.exp(collectives.log_softmax(d, axis_name))
    tv = 0.5 * collectives.vocab_sum(jnp.abs(p - q), axis_name)
    ok = jnp.isfinite(collectives.vocab_max(t, axis_name))
    ok &= jnp.isfinite(collectives.vocab_max(lax.stop_gradient(d), axis_name))
    tv = jnp.where(ok, tv, jnp.nan)
    return tv if mask is None else jnp.where(mask, tv, 0.0)


def certificate_ratio(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    eps: float = 1e-3,
    where: jax.typing.ArrayLike | None = None,
    differentiate_target: bool = False,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Ratio form ``KL(p||q) / (C_p + eps)``: below 1 means certified (for ``eps -> 0``).

    Scale-free across positions: a low-margin position (small ``C_p``) weighs more.
    ``eps`` (nats, ``> 0``) keeps positions with ``C_p = 0`` finite. ``+inf`` certificates
    give 0. Arguments and returns as :func:`certificate_violation`.

    Raises:
      ValueError: ``eps <= 0``, or as :func:`certificate_violation`.
    """
    eps = _positive("eps", eps)
    _, kl, c, mask = _excess(
        drafter_logits, target_logits, rule, 0.0, where, differentiate_target, top_k, axis_name
    )
    finite = jnp.isfinite(c)
    ratio = kl / jnp.where(finite, c + eps, 1.0)
    return _finish(jnp.where(finite, ratio, 0.0), mask)


def cvar(
    losses: jax.typing.ArrayLike,
    alpha: float,
    *,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Conditional value at risk: mean of the worst ``alpha``-fraction of the losses.

    With ``n`` (unmasked) losses the worst ``alpha n`` are averaged; a fractional last
    element is weighted by its fraction, so the result is continuous in ``alpha`` and
    ``alpha = 1`` gives the plain mean. Gradients flow to the selected losses only.

    Args:
      losses: any shape; all entries are pooled.
      alpha: fraction in ``(0, 1]``.
      where: optional bool mask of the same shape; masked entries are ignored.

    Returns:
      A scalar (0 if every entry is masked).

    Raises:
      ValueError: ``alpha`` outside ``(0, 1]`` or a mask of another shape.
    """
    check_probability("alpha", alpha)
    flat = jnp.ravel(jnp.asarray(losses))
    if where is None:
        mask = jnp.ones(flat.shape, bool)
    else:
        where = jnp.asarray(where, bool)
        if where.shape != jnp.shape(losses):
            raise ValueError(f"where has shape {where.shape}, losses {jnp.shape(losses)}")
        mask = jnp.ravel(where)
    keyed = jnp.where(mask, flat, -jnp.inf)
    order = jnp.argsort(-keyed)  # worst first; masked entries last
    ranked = jnp.where(mask[order], flat[order], 0.0)
    budget = alpha * jnp.sum(mask)
    weights = jnp.clip(budget - jnp.arange(flat.size), 0.0, 1.0)
    return jnp.sum(weights * ranked) / jnp.maximum(budget, 1e-12)
