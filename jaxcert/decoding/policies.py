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
* ``cert:KAPPA``: certificate-aware (this package): stop when the drafter's own strict-greedy
  certificate ``C_q`` (the KL needed to flip its argmax) falls below ``KAPPA`` times the
  row's running geometric mean of ``KL(p||q)`` measured at verified positions. The exact
  certificate says ``KL(p||q) < C_p`` guarantees acceptance; at draft time ``p`` is unknown,
  so ``C_q`` stands in for ``C_p`` and the recent drafter-target divergence for ``KL``.

Every dynamic policy also stops at ``k_max`` (default 40), and the decoder stops a row's draft
where its token budget ends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxcert import _numerics
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


def _check_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_float(name, value, low, high, *, closed_high=True):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and low < value and (value <= high if closed_high else value < high)
    if not ok:
        raise ValueError(f"{name} must be a number in ({low}, {high}{']' if closed_high else ')'}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constant:
    """Draft exactly ``k`` tokens per round.

    Attributes:
      k: draft length, ``>= 1``.
    """

    k: int = 5

    def __post_init__(self):
        _check_int("Constant.k", self.k)

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
        _check_int("Heuristic.k0", self.k0)
        _check_int("Heuristic.k_max", self.k_max)

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
        _check_float("Confidence.tau", self.tau, 0.0, 1.0)
        _check_int("Confidence.k_max", self.k_max)

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
        _check_float("SVIP.h", self.h, 0.0, float("inf"))
        _check_float("SVIP.c", self.c, 0.0, float("inf"))
        _check_int("SVIP.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return f"svip:{self.h:g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Certified:
    """Certificate-aware stopping: continue while ``C_q >= kappa * KL_ema``.

    ``C_q`` is the exact strict-greedy certificate of the drafter's own distribution at the
    just-drafted position; ``KL_ema = exp(mean log KL(p||q))`` is an exponential moving
    geometric mean over the row's verified drafted positions, started at ``kl_prior``.

    Attributes:
      kappa: threshold factor (``> 0``).
      decay: weight of one new position in the moving mean, in ``(0, 1]``.
      kl_prior: ``KL_ema`` before any position was verified (nats).
      k_max: cap on the draft length.
    """

    kappa: float = 1.0
    decay: float = 0.1
    kl_prior: float = 0.1
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        _check_float("Certified.kappa", self.kappa, 0.0, float("inf"))
        _check_float("Certified.decay", self.decay, 0.0, 1.0)
        _check_float("Certified.kl_prior", self.kl_prior, 0.0, float("inf"))
        _check_int("Certified.k_max", self.k_max)

    @property
    def spec(self) -> str:
        return f"cert:{self.kappa:g}"


Policy = Constant | Heuristic | Confidence | SVIP | Certified


def parse_policy(spec: str) -> Policy:
    """Parses a policy: ``constant:K``, ``heuristic[:K0]``, ``confidence[:TAU]``, ``svip[:H]``.

    Also ``cert[:KAPPA]`` (this package's certificate-aware policy).

    An optional ``/KMAX`` suffix sets the cap of a dynamic policy, e.g. ``svip:0.3/16``.

    Raises:
      ValueError: unknown policy, wrong parameters or invalid values.
    """
    text = spec.strip().lower()
    text, _, cap = text.partition("/")
    name, _, arg = text.partition(":")
    grammar = "constant:K | heuristic[:K0] | confidence[:TAU] | svip[:H] | cert[:KAPPA] [/KMAX]"
    if name not in _KINDS:
        raise ValueError(f"unknown policy {spec!r}; expected {grammar}")
    try:
        extra = {"k_max": int(cap)} if cap else {}
        if name == "constant":
            if not arg or cap:
                raise ValueError("constant needs K and takes no /KMAX")
            return Constant(k=int(arg))
        number = float(arg) if arg else None
        if name == "heuristic":
            return Heuristic(k0=int(arg) if arg else 5, **extra)
        key = {"confidence": "tau", "svip": "h", "cert": "kappa"}[name]
        cls = {"confidence": Confidence, "svip": SVIP, "cert": Certified}[name]
        return cls(**({key: number} if number is not None else {}), **extra)
    except ValueError as err:
        raise ValueError(f"policy {spec!r}: {err}; expected {grammar}") from None


@struct.dataclass
class PolicyParams:
    """A policy lowered to scalars (traced, so one compilation serves every policy).

    Attributes:
      kind: ``[]`` int32 index into ``constant, heuristic, confidence, svip, cert``.
      k: ``[]`` int32 constant ``K`` or heuristic ``K0``.
      k_max: ``[]`` int32 cap on the draft length.
      tau, h, c, kappa, decay, kl_prior: ``[]`` float32 parameters (unused ones are 0).
    """

    kind: jax.Array
    k: jax.Array
    k_max: jax.Array
    tau: jax.Array
    h: jax.Array
    c: jax.Array
    kappa: jax.Array
    decay: jax.Array
    kl_prior: jax.Array

    @classmethod
    def from_policy(cls, policy: Policy) -> PolicyParams:
        values = dict(k=0, tau=0.0, h=0.0, c=0.0, kappa=0.0, decay=0.0, kl_prior=1.0)
        if isinstance(policy, Constant):
            kind, values["k"] = "constant", policy.k
        elif isinstance(policy, Heuristic):
            kind, values["k"] = "heuristic", policy.k0
        elif isinstance(policy, Confidence):
            kind, values["tau"] = "confidence", policy.tau
        elif isinstance(policy, SVIP):
            kind, values["h"], values["c"] = "svip", policy.h, policy.c
        elif isinstance(policy, Certified):
            kind = "cert"
            values.update(kappa=policy.kappa, decay=policy.decay, kl_prior=policy.kl_prior)
        else:
            raise ValueError(f"not a policy: {policy!r}")
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return cls(
            kind=jnp.asarray(_KINDS.index(kind), jnp.int32),
            k=jnp.asarray(values["k"], jnp.int32),
            k_max=jnp.asarray(policy.k_max, jnp.int32),
            **{n: f32(values[n]) for n in ("tau", "h", "c", "kappa", "decay", "kl_prior")},
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

    ``cert`` is the exact strict-greedy certificate of spec section 3, rule 1, in closed form
    from the top two probabilities: ``C_1 = s phi(gamma / s)`` with ``s = q1 + q2`` and
    ``gamma = q1 - q2`` (the value :func:`jaxcert.certificate` returns for ``StrictGreedy``;
    tested equal), evaluated without cancellation.
    """
    x = q_logits.astype(jnp.float32)
    top2, _ = _numerics.top_k(x, 2)
    x_max = top2[..., 0]
    total = jnp.sum(jnp.exp(x - x_max[..., None]), axis=-1)
    entropy = _numerics.entropy(x, x_max, total)
    q1 = 1.0 / total
    ratio = jnp.exp(top2[..., 1] - x_max)  # q2 / q1
    s = q1 * (1.0 + ratio)
    cert = s * _numerics.binary_kl_uniform(-jnp.expm1(top2[..., 1] - x_max) / (1.0 + ratio))
    return DrafterFeatures(top=q1, entropy=entropy, cert=cert)


def init_policy_state(params: PolicyParams, batch: int) -> PolicyState:
    """The state of ``batch`` rows before their first round."""
    return PolicyState(
        k=jnp.full((batch,), params.k, jnp.int32),
        kl_ema=jnp.full((batch,), jnp.log(params.kl_prior), jnp.float32),
        kl_count=jnp.zeros((batch,), jnp.float32),
    )


def should_continue(
    params: PolicyParams, state: PolicyState, features: DrafterFeatures, drafted: jax.Array
) -> jax.Array:
    """Whether each row drafts one more token.

    Args:
      params: the policy.
      state: the per-row policy state.
      features: features of the distribution that produced the just-drafted token.
      drafted: ``[B]`` int32 tokens drafted so far this round (the depth).

    Returns:
      ``[B]`` bool; ``False`` once ``drafted >= k_max``.
    """
    kind = params.kind
    log_cert = jnp.log(jnp.maximum(features.cert, 1e-30))
    decisions = jnp.stack(
        [
            drafted < params.k,
            drafted < state.k,
            features.top >= params.tau,
            jnp.sqrt(params.c * jnp.maximum(features.entropy, 0.0)) <= params.h,
            log_cert >= jnp.log(params.kappa) + state.kl_ema,
        ]
    )  # [kinds, B]
    return decisions[kind] & (drafted < params.k_max)


def update_policy_state(
    params: PolicyParams,
    state: PolicyState,
    *,
    drafted: jax.Array,
    accepted: jax.Array,
    log_kl_sum: jax.Array,
    kl_count: jax.Array,
    active: jax.Array,
) -> PolicyState:
    """The state after a round.

    Args:
      params: the policy.
      state: the state before the round.
      drafted: ``[B]`` int32 draft length (depth) of the round.
      accepted: ``[B]`` int32 accepted drafted tokens.
      log_kl_sum: ``[B]`` sum of ``log KL(p||q)`` over the round's verified positions.
      kl_count: ``[B]`` float32 number of those positions.
      active: ``[B]`` bool rows that took part (others keep their state).
    """
    full = accepted >= drafted
    k = jnp.where(full, state.k + 2, jnp.maximum(state.k - 1, 1))
    k = jnp.minimum(k, params.k_max)
    # Moving mean over positions: `count` updates with weight `decay` each, batched.
    keep = (1.0 - params.decay) ** kl_count
    mean = log_kl_sum / jnp.maximum(kl_count, 1.0)
    kl_ema = keep * state.kl_ema + (1.0 - keep) * mean
    return PolicyState(
        k=jnp.where(active, k, state.k),
        kl_ema=jnp.where(active & (kl_count > 0), kl_ema, state.kl_ema),
        kl_count=jnp.where(active, state.kl_count + kl_count, state.kl_count),
    )
