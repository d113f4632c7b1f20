"""A drafter against the target, position by position: ``KL(p‖q)``, ``TV``, certified, accepted.

At a position with target distribution ``p`` and drafter distribution ``q`` (both over the
full vocabulary), and for each rule with certificate ``C_p`` (``docs/certificates.md`` §1):

* ``kl = KL(p‖q)`` in nats (:func:`jaxcert.losses.kl_divergence`);
* ``tv = 1 - Σ min(p, q) = ½ Σ |p - q|``, the total variation distance, the chance that
  speculative sampling rejects one drafted token (:func:`jaxcert.losses.rejection_rate`);
* ``certified`` per rule: ``KL(p‖q) < C_p``, the guarantee that the rule accepts ``q``'s
  proposal, whatever ``q``'s ties;
* ``accepted`` per rule: whether the rule's verifier accepts what the drafter actually
  proposes, ``q``'s greedy token (its top-``m`` tokens for ``tree:m``), ties to the lower
  token id as the decoder drafts them: at least one of them is in the rule's accepted set
  ``U(p)`` (:func:`jaxcert.decoding.verify.in_accepted_set`, the verifier's own test).

``certified`` implies ``accepted`` (``docs/certificates.md`` §1); ``accepted`` may hold where
``certified`` does not (the certificate is a sufficient condition). Near ``KL = C_p`` the
float32 comparison is only as good as both numbers (``docs/numerics.md``).

Shape letters: ``V`` vocabulary, ``R`` rules, ``M`` the largest list size ``m`` of the rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcert import losses
from jaxcert.core import numerics, solver
from jaxcert.decoding.verify import in_accepted_set
from jaxcert.pipeline.report import accepted_column, certified_column

__all__ = ["DrafterTerms", "drafter_columns", "drafter_terms"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrafterTerms:
    """The drafter's terms at each position (:func:`drafter_terms`).

    Attributes:
      kl: ``[...]`` float32, ``KL(p‖q)`` in nats (``nan`` where a row is no distribution).
      tv: ``[...]`` float32, ``1 - Σ min(p, q)`` in ``[0, 1]`` (``nan`` as ``kl``).
      drafter_token: ``[...]`` int32, ``q``'s greedy token (the lowest id among ties).
      certified: ``[..., R]`` bool, ``KL(p‖q) < C_p`` per rule.
      accepted: ``[..., R]`` bool, whether each rule accepts the drafter's proposal.
    """

    kl: jax.Array  # [...]
    tv: jax.Array  # [...]
    drafter_token: jax.Array  # [...]
    certified: jax.Array  # [..., R]
    accepted: jax.Array  # [..., R]


@functools.partial(jax.jit, static_argnames=("rules",))
def drafter_terms(
    drafter_logits: jax.typing.ArrayLike,
    target_logits: jax.typing.ArrayLike,
    rules: tuple,
    certificates: jax.typing.ArrayLike | None = None,
    *,
    proposal_logits: jax.typing.ArrayLike | None = None,
) -> DrafterTerms:
    """``KL(p‖q)``, ``TV``, and per rule certified and accepted, at every position.

    Args:
      drafter_logits: ``[..., V]`` logits of the drafter ``q`` (float32, bfloat16, float16).
      target_logits: ``[..., V]`` logits of the target ``p`` (same shape: one vocabulary).
      rules: a tuple of rules (:mod:`jaxcert.core.rules`; static).
      certificates: ``[..., R]`` the target's ``C_p`` of each rule in nats, when already
        computed (``jaxcert certify`` has them); ``None``: computed here
        (:func:`jaxcert.core.solver.certificates`).
      proposal_logits: ``[..., V]`` the logits whose top tokens the drafter proposes, where
        they are not ``drafter_logits``: an EAGLE-3 head drafts with ``-inf`` outside its
        draft vocabulary, while its ``q`` for ``KL`` and ``TV`` gives those tokens its
        shared logit (:class:`jaxcert.models.EagleHead`). ``None``: ``drafter_logits``.

    Returns:
      A :class:`DrafterTerms`. Computed in float32 (float64 for float64 input).

    Raises:
      ValueError: non-floating logits, shapes that differ, no rules, or ``certificates``
        of a shape other than ``[..., R]`` or ``proposal_logits`` of another shape than
        ``drafter_logits`` (at trace time).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcert.core.rules import StrictGreedy, TreeCoverage
      >>> p = jnp.log(jnp.array([0.5, 0.3, 0.2]))
      >>> q = jnp.log(jnp.array([0.4, 0.45, 0.15]))  # its greedy token is not x0 = 0
      >>> t = drafter_terms(q, p, (StrictGreedy(), TreeCoverage(2)))
      >>> t.accepted.tolist(), t.certified.tolist(), round(float(t.tv), 2)
      ([False, True], [False, True], 0.15)
    """
    if not rules:
        raise ValueError("no rules given")
    kl = losses.kl_divergence(drafter_logits=drafter_logits, target_logits=target_logits)
    tv = losses.rejection_rate(drafter_logits=drafter_logits, target_logits=target_logits)
    d, t = jnp.asarray(drafter_logits), jnp.asarray(target_logits)
    dtype = numerics.compute_dtype(d.dtype, t.dtype)
    d, t = d.astype(dtype), t.astype(dtype)
    if certificates is None:
        certificates = jnp.stack([c.value for c in solver.certificates(t, rules)], axis=-1)
    certificates = jnp.asarray(certificates)
    if certificates.shape != (*t.shape[:-1], len(rules)):
        raise ValueError(
            f"certificates must be [..., R] = {(*t.shape[:-1], len(rules))}, got "
            f"{certificates.shape}"
        )
    if proposal_logits is not None:
        proposal_logits = jnp.asarray(proposal_logits)
        if proposal_logits.shape != d.shape:
            raise ValueError(
                f"proposal_logits must have the drafter's shape {d.shape}, got "
                f"{proposal_logits.shape}"
            )
        d = proposal_logits.astype(dtype)
    vocab = t.shape[-1]
    _, top = numerics.top_k(d, min(max(r.list_size for r in rules), vocab))  # [..., M]
    accepted = []
    for rule in rules:
        proposed = top[..., : min(rule.list_size, vocab)]  # [..., m]
        hit = in_accepted_set(t[..., None, :], proposed, rule)  # [..., m]
        accepted.append(jnp.any(hit, axis=-1))
    return DrafterTerms(
        kl=kl,
        tv=tv,
        drafter_token=top[..., 0],
        certified=kl[..., None] < certificates,  # nan compares False
        accepted=jnp.stack(accepted, axis=-1),
    )


def drafter_columns(terms: DrafterTerms, rules: Sequence) -> dict[str, np.ndarray]:
    """The drafter's Parquet columns of :class:`DrafterTerms` (host arrays, any leading
    shape): ``kl``, ``tv``, ``drafter_token``, then ``certified_<rule>`` and
    ``accepted_<rule>`` per rule (:func:`jaxcert.pipeline.report.certified_column`).
    Where ``kl`` is ``nan`` (a row of either side that is no distribution: NaN or ``+inf``
    logits, or none finite) the drafter proposes nothing: ``drafter_token`` is ``-1`` and
    certified and accepted are ``False``."""
    terms = jax.device_get(terms)
    kl = np.asarray(terms.kl, np.float32)
    undefined = np.isnan(kl)
    out: dict[str, np.ndarray] = {
        "kl": kl,
        "tv": np.where(undefined, np.nan, np.asarray(terms.tv, np.float32)).astype(np.float32),
        "drafter_token": np.where(undefined, -1, np.asarray(terms.drafter_token)).astype(np.int32),
    }
    for i, rule in enumerate(rules):
        out[certified_column(rule)] = np.asarray(terms.certified[..., i], bool) & ~undefined
    for i, rule in enumerate(rules):
        out[accepted_column(rule)] = np.asarray(terms.accepted[..., i], bool) & ~undefined
    return out
