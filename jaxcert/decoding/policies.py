"""Draft-length policies: when does the drafter stop proposing tokens in a round?

A policy is a pure function of the drafter's distribution ``q`` at the just-drafted position
(the one that produced the token just drafted, which is kept) and a small per-row
:class:`~jaxcert.decoding.state.PolicyState`; it runs inside the jitted draft loop. Every
policy config lowers to the same :class:`PolicyParams` pytree of scalars, so one compiled
decoder serves every policy (the kind is data, not structure).

Policies (``K`` drafted tokens so far, ``q`` the drafter distribution that produced the last):

* ``constant:K``: draft exactly ``K`` tokens.
* ``heuristic``: Hugging Face assisted generation's schedule: start at ``K0 = 5`` (the
  ``num_assistant_tokens`` default that came with the heuristic schedule); after a fully
  accepted round ``K += 2``, otherwise ``K = max(1, K - 1)``.
* ``confidence:TAU``: stop when ``max q < TAU`` (HF's ``assistant_confidence_threshold``,
  default 0.4).
* ``svip:H``: SVIP (Zhang et al., 2024): stop when ``sqrt(c * H(q)) > H`` with ``H(q)`` the
  drafter's full-vocabulary entropy in nats; ``c = 0.15``, ``H = 0.3`` as in its code.
* ``cert:LAMBDA``: certificate-aware (this package), see :class:`Certified`: estimate each
  drafted token's acceptance from the drafter's own exact strict-greedy certificate ``C_q``
  as ``(C_q / log 2) ** beta`` and stop when the product over the round's tokens (the chance
  that the whole draft is accepted) falls below ``LAMBDA`` (default 0.55, ``beta`` 0.3).

Every dynamic policy also stops at ``k_max`` (default 40), and the decoder stops a row's draft
where its token budget ends.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxcert.base.validate import check_float, check_int, check_probability, in_user_words
from jaxcert.core import numerics
from jaxcert.core.stats import distribution_stats
from jaxcert.decoding.state import PolicyState

__all__ = [
    "Constant",
    "Heuristic",
    "Confidence",
    "SVIP",
    "Certified",
    "Policy",
    "PolicyParams",
    "DrafterFeatures",
    "parse_policy",
    "drafter_features",
    "should_continue",
    "init_policy_state",
    "update_policy_state",
]

DEFAULT_K_MAX = 40
_KINDS = ("constant", "heuristic", "confidence", "svip", "cert")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constant:
    """Draft exactly ``k`` tokens per round.

    Attributes:
      k: draft length, ``>= 1``.
    """

    k: int = 5

    def __post_init__(self):
        check_int("Constant.k", self.k)

    @property
    def k_max(self) -> int:
        return self.k

    @property
    def spec(self) -> str:
        return f"constant:{self.k}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heuristic:
    """Hugging Face's ``heuristic`` schedule: ``K += 2`` after a fully accepted round, else ``-1``.

    Attributes:
      k0: initial draft length (HF's ``num_assistant_tokens`` default for this schedule: 5).
      k_max: cap on ``K``.
    """

    k0: int = 5
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        check_int("Heuristic.k0", self.k0)
        check_int("Heuristic.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return "heuristic" if self.k0 == 5 else f"heuristic:{self.k0}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Confidence:
    """Stop when the drafter's top probability at the just-drafted position is below ``tau``.

    Attributes:
      tau: confidence threshold in ``(0, 1]`` (HF's ``assistant_confidence_threshold``: 0.4).
      k_max: cap on the draft length.
    """

    tau: float = 0.4
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        check_probability("Confidence.tau", self.tau)
        check_int("Confidence.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return f"confidence:{self.tau:g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SVIP:
    """SVIP: stop when ``sqrt(c * H(q)) > h`` (``H`` the drafter entropy in nats).

    Attributes:
      h: threshold (SVIP's default 0.3).
      c: entropy scale (SVIP's code: 0.15).
      k_max: cap on the draft length.
    """

    h: float = 0.3
    c: float = 0.15
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        check_float("SVIP.h", self.h, strict=True)
        check_float("SVIP.c", self.c, strict=True)
        check_int("SVIP.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return f"svip:{self.h:g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Certified:
    """Certificate-aware stopping: continue while ``prod_j (C_q,j / log 2) ** beta >= lam``.

    ``C_q,j`` is the exact strict-greedy certificate of the drafter distribution that produced
    the ``j``-th token of the round: the least ``KL(q || r)`` of any ``r`` whose argmax differs
    from ``q``'s. Since ``KL(q || p) < C_q`` guarantees that the target's greedy token is the
    drafter's (the certificate theorem applied with the roles of ``p`` and ``q`` swapped),
    ``C_q`` measures how far the target may drift before the token is rejected; ``log 2`` is
    its supremum (``q`` a point mass), so ``C_q / log 2`` in ``[0, 1)`` is a normalised
    robustness and ``(C_q / log 2) ** beta`` a calibrated acceptance probability. The product
    over the round is the probability that the whole draft is accepted, and drafting one more
    token pays only while it stays above ``lam`` (the cost of a drafted token relative to the
    expected gain). Defaults were tuned on held-out MT-Bench prompts (not the benchmark's).

    Attributes:
      lam: threshold on the estimated probability that the whole draft is accepted, in
        ``(0, 1]``.
      beta: calibration exponent, ``> 0``.
      k_max: cap on the draft length.
    """

    lam: float = 0.55
    beta: float = 0.3
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        check_probability("Certified.lam", self.lam)
        check_float("Certified.beta", self.beta, strict=True)
        check_int("Certified.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return f"cert:{self.lam:g}" if self.beta == 0.3 else f"cert:{self.lam:g}:{self.beta:g}"


Policy = Constant | Heuristic | Confidence | SVIP | Certified


# The policy fields as the command-line grammar spells them.
_USER_NAMES = {
    "Constant.k": "K",
    "Heuristic.k0": "K0",
    "Confidence.tau": "TAU",
    "SVIP.h": "H",
    "Certified.lam": "LAMBDA",
    "Certified.beta": "BETA",
    **{f"{cls}.k_max": "KMAX" for cls in ("Heuristic", "Confidence", "SVIP", "Certified")},
}


def parse_policy(spec: str) -> Policy:
    """Parses a policy: ``constant:K``, ``heuristic[:K0]``, ``confidence[:TAU]``, ``svip[:H]``.

    Also ``cert[:LAMBDA[:BETA]]`` (this package's certificate-aware policy).

    An optional ``/KMAX`` suffix sets the cap of a dynamic policy, e.g. ``svip:0.3/16``.

    Raises:
      ValueError: unknown policy, wrong parameters or invalid values.
    """
    text = spec.strip().lower()
    text, _, cap = text.partition("/")
    name, _, arg = text.partition(":")
    grammar = "constant:K | heuristic[:K0] | confidence[:TAU] | svip[:H] | cert[:LAMBDA[:BETA]]"
    grammar += " [/KMAX]"
    if name not in _KINDS:
        raise ValueError(f"unknown policy {spec!r}; expected {grammar}")
    try:
        extra = {"k_max": int(cap)} if cap else {}
        if name == "constant":
            if not arg or cap:
                raise ValueError("constant needs K and takes no /KMAX")
            return Constant(k=int(arg))
        if name == "heuristic":
            return Heuristic(k0=int(arg) if arg else 5, **extra)
        numbers = [float(x) for x in arg.split(":")] if arg else []
        keys = {"confidence": ("tau",), "svip": ("h",), "cert": ("lam", "beta")}[name]
        if len(numbers) > len(keys):
            raise ValueError(f"{name} takes at most {len(keys)} parameter(s)")
        cls = {"confidence": Confidence, "svip": SVIP, "cert": Certified}[name]
        return cls(**dict(zip(keys, numbers, strict=False)), **extra)
    except ValueError as err:
        message = in_user_words(err, _USER_NAMES)
        raise ValueError(f"policy {spec!r}: {message}; expected {grammar}") from None


@struct.dataclass
class PolicyParams:
    """A policy lowered to scalars (traced, so one compilation serves every policy).

    Attributes:
      kind: ``[]`` int32 index into ``constant, heuristic, confidence, svip, cert``.
      k: ``[]`` int32 constant ``K`` or heuristic ``K0``.
      k_max: ``[]`` int32 cap on the draft length.
      tau, h, c, lam, beta: ``[]`` float32 parameters (unused ones are 0).
    """

    kind: jax.Array
    k: jax.Array
    k_max: jax.Array
    tau: jax.Array
    h: jax.Array
    c: jax.Array
    lam: jax.Array
    beta: jax.Array

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> PolicyParams: ...

    @classmethod
    def from_policy(cls, policy: Policy) -> PolicyParams:
        values = dict(k=0, tau=0.0, h=0.0, c=0.0, lam=0.0, beta=0.0)
        if isinstance(policy, Constant):
            kind, values["k"] = "constant", policy.k
        elif isinstance(policy, Heuristic):
            kind, values["k"] = "heuristic", policy.k0
        elif isinstance(policy, Confidence):
            kind, values["tau"] = "confidence", policy.tau
        elif isinstance(policy, SVIP):
            kind, values["h"], values["c"] = "svip", policy.h, policy.c
        elif isinstance(policy, Certified):
            kind, values["lam"], values["beta"] = "cert", policy.lam, policy.beta
        else:
            raise ValueError(f"not a policy: {policy!r}")
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return cls(
            kind=jnp.asarray(_KINDS.index(kind), jnp.int32),
            k=jnp.asarray(values["k"], jnp.int32),
            k_max=jnp.asarray(policy.k_max, jnp.int32),
            **{n: f32(values[n]) for n in ("tau", "h", "c", "lam", "beta")},
        )


@struct.dataclass
class DrafterFeatures:
    """What the policies read from a drafter distribution ``q``; every field is ``[B]``.

    Attributes:
      top: ``max q``.
      entropy: ``H(q)`` in nats.
      cert: ``C_q``, the strict-greedy certificate of ``q`` (nats, ``< log 2``).
    """

    top: jax.Array
    entropy: jax.Array
    cert: jax.Array


def drafter_features(q_logits: jax.Array) -> DrafterFeatures:
    """Features of ``softmax(q_logits)``: ``[B, V]`` float logits -> ``[B]`` fields.

    ``cert`` is the exact strict-greedy certificate of ``docs/certificates.md`` §5, rule 1, in
    closed form from the top two probabilities: ``C_1 = s phi(gamma / s)`` with ``s = q1 + q2`` and
    ``gamma = q1 - q2`` (the value :func:`jaxcert.certificate` returns for ``StrictGreedy``;
    tested equal), evaluated without cancellation.
    """
    st = distribution_stats(q_logits, top=2)
    s = 2.0 * st.top1 - st.margin  # q1 + q2
    cert = s * numerics.binary_kl_uniform(st.margin / s)
    return DrafterFeatures(top=st.top1, entropy=st.entropy, cert=cert)


def init_policy_state(params: PolicyParams, batch: int) -> PolicyState:
    """The state of ``batch`` rows before their first round."""
    return PolicyState(k=jnp.full((batch,), params.k, jnp.int32))


def should_continue(
    params: PolicyParams,
    state: PolicyState,
    features: DrafterFeatures,
    drafted: jax.Array,
    survival: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Whether each row drafts one more token.

    Args:
      params: the policy.
      state: the per-row policy state.
      features: features of the distribution that produced the just-drafted token.
      drafted: ``[B]`` int32 tokens drafted so far this round (the depth).
      survival: ``[B]`` float32 the round's running product for ``cert`` (1 at round start).

    Returns:
      ``(continue, survival)``: ``[B]`` bool, ``False`` once ``drafted >= k_max``, and the
      updated product.
    """
    ratio = jnp.clip(features.cert / jnp.log(2.0), 0.0, 1.0)
    survival = survival * jnp.where(params.beta > 0, ratio ** jnp.maximum(params.beta, 1e-6), 1)
    decisions = jnp.stack(
        [
            drafted < params.k,
            drafted < state.k,
            features.top >= params.tau,
            jnp.sqrt(params.c * jnp.maximum(features.entropy, 0.0)) <= params.h,
            survival >= params.lam,
        ]
    )  # [kinds, B]
    return decisions[params.kind] & (drafted < params.k_max), survival


def update_policy_state(
    params: PolicyParams,
    state: PolicyState,
    *,
    drafted: jax.Array,
    accepted: jax.Array,
    active: jax.Array,
) -> PolicyState:
    """The state after a round (the ``heuristic`` schedule).

    Args:
      params: the policy.
      state: the state before the round.
      drafted: ``[B]`` int32 draft length (depth) of the round.
      accepted: ``[B]`` int32 accepted drafted tokens.
      active: ``[B]`` bool rows that took part (others keep their state).
    """
    full = accepted >= drafted
    k = jnp.where(full, state.k + 2, jnp.maximum(state.k - 1, 1))
    return PolicyState(k=jnp.where(active, jnp.minimum(k, params.k_max), state.k))
