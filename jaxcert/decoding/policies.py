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

* ``goodput[:PRIOR[:BETA]][:NAME=VALUE...]``: cost-aware (this package), see
  :class:`Goodput` (named options ``memory``, ``patience``, ``spread``): drafts the
  depth that maximises the batch's expected emitted tokens per second under the measured
  pass costs (:class:`RoundCosts`), drafting nothing, or skipping the drafter for a plain
  target step, when that is faster (``docs/goodput.md``).

Every dynamic policy also stops at ``k_max`` (default 40), and the decoder stops a row's draft
where its token budget ends.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxcert.base.validate import check_float, check_int, check_probability, in_user_words
from jaxcert.core import numerics
from jaxcert.core.stats import distribution_stats
from jaxcert.decoding import ngram as ngram_lib
from jaxcert.decoding.state import DraftTree, PolicyState

__all__ = [
    "Constant",
    "Heuristic",
    "Confidence",
    "SVIP",
    "Certified",
    "Goodput",
    "Policy",
    "RoundCosts",
    "Survival",
    "PolicyParams",
    "DrafterFeatures",
    "parse_policy",
    "drafter_features",
    "should_continue",
    "draft_any",
    "measured_rate",
    "should_skip",
    "init_policy_state",
    "update_policy_state",
    "tested_estimate",
    "match_counts",
    "tree_match_counts",
    "proposal_features",
    "MATCH_CLASSES",
]

DEFAULT_K_MAX = 40
# Classes of a proposing drafter's match length that ``goodput`` keeps acceptance counts for:
# 1, 2, ..., MATCH_CLASSES - 1 tokens, and MATCH_CLASSES or more.
MATCH_CLASSES = ngram_lib.MATCH_REACH
_KINDS = ("constant", "heuristic", "confidence", "svip", "cert", "goodput")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Goodput:
    """Cost-aware drafting: the draft depth that maximises expected emitted tokens per second.

    With per-token acceptance estimates ``a`` and the measured cost of a round that drafts
    ``d`` tokens, ``T(d)`` (:class:`RoundCosts`), a round of the batch emits
    ``sum_b E_b(d)`` tokens in expectation, ``E_b(d) = 1 + sum_{k <= d} prod_{j <= k} a_bj``,
    at ``sum_b E_b(d) / T(d)`` tokens per second. Before drafting, the policy compares the
    rate its drafting rounds have measured (tokens they emitted over their cost
    ``T(d)``, summed over the rows, raised by ``spread / sqrt(n)`` for ``n`` measured
    row-rounds: an upper confidence bound) against a plain target step without the
    drafter, and skips the drafter when the step is faster (at
    most ``DecodeConfig.max_skip`` rounds in a row, then one round drafts to measure again;
    a row's first round always drafts, unless the costs alone rule drafting out or a prior
    from earlier decodes (``PolicyParams.with_past``) says drafting loses; after
    ``patience`` row-rounds of measurement in a row that were followed by a skip, it stops
    measuring and runs plain steps to the end of the decode). While
    drafting, it keeps going while some deeper draft, its future tokens
    accepted at the last token's rate, has a higher rate than stopping now; drafting zero
    tokens is one of its choices. A drafted token's estimate is ``c_b (C_q / log 2) ** beta``:
    the drafter's certificate (as ``cert``) scaled by the row's calibration ``c_b``, its
    accepted tokens over the sum of their estimates, which starts at ``prior``. Derivation:
    ``docs/goodput.md``.

    Attributes:
      prior: acceptance rate per token assumed before a row has drafted, in ``(0, 1)``.
      beta: calibration exponent of the certificate estimate, ``> 0``.
      memory: weight of the past in the running acceptance counts, in ``[0, 1)``.
      patience: losing measurements in a row (drafting rounds each followed by a skip),
        counted in row-rounds (a round of ``B`` active rows counts ``B``), after which the
        batch stops measuring (the drafter then never runs again in this decode, and never
        re-reads what it skipped): by default two measuring rounds at batch 1, one from
        batch 2 up; ``0``: measure every ``max_skip + 1`` rounds forever.
      spread: the relative standard deviation assumed for one row-round's emitted tokens,
        ``>= 0``: the skip decision raises the measured drafting rate by
        ``spread / sqrt(n)`` (``n`` measured row-rounds), so that one unlucky round does
        not switch drafting off; ``0``: the measured rate as it is.
      k_max: cap on the draft length.
    """

    prior: float = 0.6
    beta: float = 0.3
    memory: float = 0.8
    patience: int = 2
    spread: float = 0.5
    k_max: int = DEFAULT_K_MAX

    def __post_init__(self):
        check_probability("Goodput.prior", self.prior, closed_right=False)
        check_float("Goodput.beta", self.beta, strict=True)
        check_float("Goodput.memory", self.memory)
        if self.memory >= 1.0:
            raise ValueError(f"Goodput.memory must be in [0, 1), got {self.memory!r}")
        check_int("Goodput.patience", self.patience, low=0)
        check_float("Goodput.spread", self.spread)
        check_int("Goodput.k_max", self.k_max)

    @property
    def spec(self) -> str:
        """The spelling :func:`parse_policy` reads back to this policy (``k_max`` aside)."""
        parts = ["goodput"]
        if self.beta != 0.3:
            parts += [f"{self.prior:g}", f"{self.beta:g}"]
        elif self.prior != 0.6:
            parts.append(f"{self.prior:g}")
        defaults = Goodput()
        for name in _GOODPUT_OPTIONS:
            if getattr(self, name) != getattr(defaults, name):
                parts.append(f"{name}={getattr(self, name):g}")
        return ":".join(parts)


# ``goodput``'s options by name: ``goodput:0.6:memory=0.5:patience=0:spread=0``.
_GOODPUT_OPTIONS = {"memory": float, "patience": int, "spread": float}


Policy = Constant | Heuristic | Confidence | SVIP | Certified | Goodput


@struct.dataclass
class RoundCosts:
    """What a round costs, in seconds, by the depth it drafts (``goodput`` reads it).

    Attributes:
      round_s: ``[K + 1]`` float32; entry ``d`` is a speculative round that drafts ``d``
        tokens: the drafter's re-read, ``d - 1`` more drafter steps and the verification
        pass at the width the decoder would use (its bucket). Entry 0 drafts nothing.
      skip_s: ``[]`` float32 a plain target step without the drafter.
    """

    round_s: jax.Array
    skip_s: jax.Array

    @classmethod
    def unknown(cls, depth: int) -> RoundCosts:
        """Zeros: for the policies that do not read costs (same shapes, same program)."""
        return cls(round_s=jnp.zeros((depth + 1,), jnp.float32), skip_s=jnp.zeros((), jnp.float32))


@struct.dataclass
class Survival:
    """The running quantities of one round's draft, per row.

    Attributes:
      prob: ``[B]`` float32 the estimated probability that every token drafted so far is
        accepted (``cert`` and ``goodput``).
      expected: ``[B]`` float32 expected emitted tokens if the draft stopped now
        (``goodput``: ``1 + sum_k prob_k``).
    """

    prob: jax.Array
    expected: jax.Array

    @classmethod
    def start(cls, batch: int) -> Survival:
        """Before the first drafted token: probability 1, one token (the target's)."""
        return cls(prob=jnp.ones((batch,), jnp.float32), expected=jnp.ones((batch,), jnp.float32))


# The policy fields as the command-line grammar spells them.
_USER_NAMES = {
    "Constant.k": "K",
    "Heuristic.k0": "K0",
    "Confidence.tau": "TAU",
    "SVIP.h": "H",
    "Certified.lam": "LAMBDA",
    "Certified.beta": "BETA",
    "Goodput.prior": "PRIOR",
    "Goodput.beta": "BETA",
    "Goodput.memory": "memory",
    "Goodput.patience": "patience",
    "Goodput.spread": "spread",
    **{
        f"{cls}.k_max": "KMAX"
        for cls in ("Heuristic", "Confidence", "SVIP", "Certified", "Goodput")
    },
}


def parse_policy(spec: str) -> Policy:
    """Parses a policy: ``constant:K``, ``heuristic[:K0]``, ``confidence[:TAU]``, ``svip[:H]``.

    Also ``cert[:LAMBDA[:BETA]]`` and ``goodput[:PRIOR[:BETA]][:NAME=VALUE...]`` (this
    package's certificate-aware and cost-aware policies; ``goodput``'s named options are
    ``memory``, ``patience`` and ``spread``, e.g. ``goodput:patience=0:spread=0.3``).

    An optional ``/KMAX`` suffix sets the cap of a dynamic policy, e.g. ``svip:0.3/16``.

    Raises:
      ValueError: unknown policy, wrong parameters or invalid values.
    """
    text = spec.strip().lower()
    text, _, cap = text.partition("/")
    name, _, arg = text.partition(":")
    grammar = "constant:K | heuristic[:K0] | confidence[:TAU] | svip[:H] | cert[:LAMBDA[:BETA]]"
    grammar += " | goodput[:PRIOR[:BETA]][:memory=M][:patience=P][:spread=S] [/KMAX]"
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
        positional, named = _split_options(name, arg.split(":") if arg else [])
        numbers = [_number(name, x) for x in positional]
        keys = {
            "confidence": ("tau",),
            "svip": ("h",),
            "cert": ("lam", "beta"),
            "goodput": ("prior", "beta"),
        }[name]
        if len(numbers) > len(keys):
            raise ValueError(f"{name} takes at most {len(keys)} parameter(s)")
        cls = {"confidence": Confidence, "svip": SVIP, "cert": Certified, "goodput": Goodput}[name]
        return cls(**dict(zip(keys, numbers, strict=False)), **named, **extra)
    except ValueError as err:
        message = in_user_words(err, _USER_NAMES)
        raise ValueError(f"policy {spec!r}: {message}; expected {grammar}") from None


def _split_options(name: str, items: list[str]) -> tuple[list[str], dict[str, float | int]]:
    """``(positional, named)``: a policy spelling's positional items, then ``goodput``'s
    ``NAME=VALUE`` options after them.

    Raises:
      ValueError: a named option of another policy, an unknown or repeated name, a value
        that is not a number of the option's type, or a positional parameter after one.
    """
    positional: list[str] = []
    named: dict[str, float | int] = {}
    for item in items:
        if "=" not in item:
            if named:
                raise ValueError(f"{name}'s parameter {item!r} comes after a named option")
            positional.append(item)
            continue
        key, _, value = item.partition("=")
        if name != "goodput":
            raise ValueError(f"{name} takes no named options, got {item!r}")
        if key not in _GOODPUT_OPTIONS:
            known = ", ".join(_GOODPUT_OPTIONS)
            raise ValueError(f"goodput has no option {key!r} (its options: {known})")
        if key in named:
            raise ValueError(f"goodput's option {key!r} is given twice")
        kind = _GOODPUT_OPTIONS[key]
        try:
            named[key] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"goodput's {key} must be {what}, got {value!r}") from None
    return positional, named


def _number(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}'s parameters are numbers, got {text!r}") from None


@struct.dataclass
class PolicyParams:
    """A policy lowered to scalars (traced, so one compilation serves every policy).

    Attributes:
      kind: ``[]`` int32 index into ``constant, heuristic, confidence, svip, cert, goodput``.
      k: ``[]`` int32 constant ``K`` or heuristic ``K0``.
      k_max: ``[]`` int32 cap on the draft length.
      patience: ``[]`` int32 ``goodput``'s losing row-rounds of measurement before it
        stops measuring (``0``: never stops; unused by the others).
      tau, h, c, lam, beta, prior, memory, spread: ``[]`` float32 parameters (unused ones
        are 0).
      costs: the :class:`RoundCosts` ``goodput`` weighs (zeros for the others).
      past_emitted: ``[]`` float32 ``goodput``'s prior for each row's measured drafting
        rate: the tokens emitted by drafting rounds of earlier decodes, per row (what
        :class:`~jaxcert.decoding.costs.PastDrafting` kept; 0: none). Each row starts with
        them as if it had drafted them this decode; ``past_rounds`` ``[K + 1]`` (or ``[1]``,
        broadcast) float32 those rounds by depth, so ``sum(past_rounds)`` is the prior's
        weight in row-rounds. With a prior, a row's first round need not draft:
        ``docs/goodput.md``, "What earlier decodes measured".
    """

    kind: jax.Array
    k: jax.Array
    k_max: jax.Array
    patience: jax.Array
    tau: jax.Array
    h: jax.Array
    c: jax.Array
    lam: jax.Array
    beta: jax.Array
    prior: jax.Array
    memory: jax.Array
    spread: jax.Array
    costs: RoundCosts
    past_emitted: jax.Array
    past_rounds: jax.Array

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> PolicyParams: ...

    @classmethod
    def from_policy(cls, policy: Policy, costs: RoundCosts | None = None) -> PolicyParams:
        """The policy's scalars, with ``costs`` (default: unknown, one entry: set them with
        ``replace(costs=...)`` before decoding with ``goodput``)."""
        values = dict(
            k=0, tau=0.0, h=0.0, c=0.0, lam=0.0, beta=0.0, prior=0.0, memory=0.0, spread=0.0
        )
        patience = 0
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
        elif isinstance(policy, Goodput):
            kind, values["beta"] = "goodput", policy.beta
            values["prior"], values["memory"] = policy.prior, policy.memory
            values["spread"] = policy.spread
            patience = policy.patience
        else:
            raise ValueError(f"not a policy: {policy!r}")
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        costs = RoundCosts.unknown(0) if costs is None else costs
        return cls(
            kind=jnp.asarray(_KINDS.index(kind), jnp.int32),
            k=jnp.asarray(values["k"], jnp.int32),
            k_max=jnp.asarray(policy.k_max, jnp.int32),
            patience=jnp.asarray(patience, jnp.int32),
            **{n: f32(v) for n, v in values.items() if n != "k"},
            costs=costs,
            past_emitted=f32(0.0),
            past_rounds=jnp.zeros_like(costs.round_s, jnp.float32),
        )

    def with_past(self, emitted, rounds) -> PolicyParams:
        """These params with ``goodput``'s prior from earlier decodes: ``emitted`` tokens
        (``[]``) and ``rounds`` (``[K + 1]``, by depth) per row; zeros: no prior.

        Raises:
          ValueError: ``rounds`` not of the costs' shape, or a negative or non-finite entry.
        """
        rounds = np.asarray(rounds, np.float64)
        if rounds.shape != tuple(self.costs.round_s.shape):
            raise ValueError(
                f"past rounds of shape {rounds.shape}, expected {tuple(self.costs.round_s.shape)}"
            )
        values = np.append(rounds, emitted)
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"past drafting must be finite and >= 0, got {emitted!r}, {rounds}")
        return self.replace(
            past_emitted=jnp.asarray(emitted, jnp.float32),
            past_rounds=jnp.asarray(rounds, jnp.float32),
        )


@struct.dataclass
class DrafterFeatures:
    """What the policies read from a drafter distribution ``q``; every field is ``[B]``.

    Attributes:
      top: ``max q``.
      entropy: ``H(q)`` in nats.
      cert: ``C_q``, the strict-greedy certificate of ``q`` (nats, ``< log 2``).
      match: int32 for a proposing drafter, the length of the match that proposed the token
        (``ngram.match_length``; 0: no proposal); 0 for a drafter with distributions.
    """

    top: jax.Array
    entropy: jax.Array
    cert: jax.Array
    match: jax.Array


def drafter_features(q_logits: jax.Array, proposes: bool = False) -> DrafterFeatures:
    """Features of ``softmax(q_logits)``: ``[B, V]`` float logits -> ``[B]`` fields.

    ``proposes`` (static): the drafter proposes tokens (a one-hot ``q`` whose finite logit is
    the match length, :class:`~jaxcert.decoding.ngram.NgramDrafter`); ``match`` reads it.

    ``cert`` is the exact strict-greedy certificate of ``docs/certificates.md`` §5, rule 1, in
    closed form from the top two probabilities: ``C_1 = s phi(gamma / s)`` with ``s = q1 + q2`` and
    ``gamma = q1 - q2`` (the value :func:`jaxcert.certificate` returns for ``StrictGreedy``;
    tested equal), evaluated without cancellation.
    """
    st = distribution_stats(q_logits, top=2)
    s = 2.0 * st.top1 - st.margin  # q1 + q2
    cert = s * numerics.binary_kl_uniform(st.margin / s)
    if proposes:
        match = ngram_lib.match_length(q_logits)
    else:
        match = jnp.zeros(q_logits.shape[:-1], jnp.int32)
    return DrafterFeatures(top=st.top1, entropy=st.entropy, cert=cert, match=match)


# ``PolicyState.skipped`` of a row that has not drafted yet: ``goodput`` measures before it
# skips (its first round drafts), unless no acceptance rate could make drafting pay.
UNMEASURED = 1 << 20


def init_policy_state(policy: PolicyParams, batch: int) -> PolicyState:
    """The policy state of ``batch`` rows before their first round (``goodput``'s counts hold
    one tested token accepted at the prior rate; ``skipped`` is :data:`UNMEASURED`). With
    a prior from earlier decodes (``policy.past_rounds`` not all 0) every row starts with
    it as its measured drafting (``emitted``, ``rounds``) and ``skipped`` is 0: the first
    round's skip decision weighs the prior, and a skip then counts as a losing
    measurement."""
    depths = policy.costs.round_s.shape[0]
    past = jnp.broadcast_to(policy.past_rounds, (depths,)).astype(jnp.float32)
    known = jnp.sum(past) > 0
    return PolicyState(
        k=jnp.full((batch,), policy.k, jnp.int32),
        accepted=jnp.full((batch,), policy.prior, jnp.float32),
        tested=jnp.ones((batch,), jnp.float32),
        predicted=jnp.ones((batch,), jnp.float32),
        skipped=jnp.full((batch,), jnp.where(known, 0, UNMEASURED), jnp.int32),
        losses=jnp.zeros((batch,), jnp.int32),
        emitted=jnp.full((batch,), jnp.where(known, policy.past_emitted, 0.0), jnp.float32),
        rounds=jnp.broadcast_to(jnp.where(known, past, 0.0), (batch, depths)),
        match_accepted=jnp.full((batch, MATCH_CLASSES), policy.prior, jnp.float32),
        match_tested=jnp.ones((batch, MATCH_CLASSES), jnp.float32),
    )


def _rate(policy_state: PolicyState) -> jax.Array:
    """``[B]`` the rows' running acceptance rate per tested token, in ``[0, 0.999]``."""
    return jnp.clip(policy_state.accepted / jnp.maximum(policy_state.tested, 1e-6), 0.0, 0.999)


def _batch(values: jax.Array, need: jax.Array | None) -> jax.Array:
    """The batch's figure of per-row tokens ``values`` (``[B]`` or ``[B, K + 1]``).

    ``need`` ``None``: their sum over the rows (tokens per round of the whole batch). Else
    ``[B]`` the tokens each row still has to write (0: done): the least ``values_b /
    need_b`` over the rows still decoding, the share of its remaining work that the row
    furthest from finishing does (a batch ends when its last row does:
    ``docs/goodput.md``, "A batch finishes with its last row"); 0 when every row is done.
    """
    if need is None:
        return jnp.sum(values, axis=0)
    need = jnp.asarray(need, jnp.float32).reshape((-1,) + (1,) * (values.ndim - 1))
    share = jnp.where(need > 0, values / jnp.maximum(need, 1e-12), jnp.inf)
    return jnp.where(jnp.any(need > 0), jnp.min(share, axis=0), 0.0)


def _best_deeper(costs: RoundCosts, expected, prob, a, drafted, k_max, need=None):
    """The best rate of a draft deeper than ``drafted``, and of stopping.

    Row ``b`` stops with ``expected[b]`` tokens; drafting ``j`` more adds
    ``prob[b] * (a + a^2 + ... + a^j)`` (each further token accepted with probability
    ``a[b]``). Depth ``d`` costs ``costs.round_s[d]``. Every ``[B]``; returns two ``[]``:
    the batch's tokens per second (``need`` ``None``), or with ``need`` (``[B]`` tokens
    each row still has to write) the rate at which the row furthest from finishing gets
    through its remaining work (:func:`_batch`).
    """
    depths = jnp.arange(costs.round_s.shape[0], dtype=jnp.int32)  # [K + 1]
    j = jnp.maximum(depths - drafted, 0).astype(jnp.float32)  # further tokens
    a = jnp.clip(a, 0.0, 0.999)[:, None]
    geometric = a * (1.0 - a**j) / (1.0 - a)  # [B, K + 1], 0 at j = 0
    total = _batch(expected[:, None] + prob[:, None] * geometric, need)  # [K + 1]
    rate = total / jnp.maximum(costs.round_s, 1e-12)
    deeper = (depths > drafted) & (depths <= k_max)
    now = _batch(expected, need) / jnp.maximum(
        costs.round_s[jnp.minimum(drafted, depths[-1])], 1e-12
    )
    return jnp.max(jnp.where(deeper, rate, -jnp.inf)), now


def _worth_drafting(policy, policy_state, features, need):
    """``goodput``'s choice (``[]`` bool): a round that drafts beats a plain verification
    of the root, at the acceptance estimate of the drafter's first token."""
    a = _token_estimate(policy, policy_state, features)
    one = jnp.ones_like(a)
    start = jnp.asarray(0, jnp.int32)
    deeper, now = _best_deeper(policy.costs, one, one, a, start, policy.k_max, need)
    return deeper > now


def draft_any(
    policy: PolicyParams,
    policy_state: PolicyState,
    features: DrafterFeatures,
    need: jax.Array | None = None,
) -> jax.Array:
    """Whether the batch drafts at all this round (``[]`` bool), decided after the drafter's
    first distribution: ``goodput`` may draft nothing (a plain verification of the root),
    except in a round that measures (a row's first, or the one after skipped rounds: it
    drafts at least one token, or the rates it decides by would never change); every other
    policy drafts at least one token.

    Args:
      policy, policy_state: the policy and its per-row state.
      features: ``[B]`` features of the drafter's distribution of the first token.
      need: ``[B]`` tokens each row still has to write (0: done); ``None``: weigh the
        batch's total tokens per second instead of its finishing time (:func:`_batch`).
    """
    worth = _worth_drafting(policy, policy_state, features, need)
    measures = jnp.any(policy_state.skipped > 0)
    return (policy.kind != _KINDS.index("goodput")) | worth | measures


def proposal_features(proposals: jax.Array) -> DrafterFeatures:
    """The :class:`DrafterFeatures` of a proposing drafter's proposals, ``[B, 2]`` int
    (token, match length; token ``-1``: none), as
    :meth:`~jaxcert.decoding.ngram.NgramDrafter.propose` returns them: the match length,
    0 without a proposal; ``top``, ``entropy`` and ``cert`` are ``nan`` (a point mass has
    no certificate worth reading)."""
    proposals = jnp.asarray(proposals, jnp.int32)
    match = jnp.where(proposals[:, 0] >= 0, proposals[:, 1], 0)
    nan = jnp.full(match.shape, jnp.nan, jnp.float32)
    return DrafterFeatures(top=nan, entropy=nan, cert=nan, match=match)


def should_skip(
    policy: PolicyParams,
    policy_state: PolicyState,
    active: jax.Array,
    max_skip: int,
    need: jax.Array | None = None,
    proposal: DrafterFeatures | None = None,
):
    """Whether the batch skips the drafter this round: a plain target step (``[]`` bool).

    Only ``goodput``, and only when a plain step's rate (``active`` rows per
    ``costs.skip_s``) is at least the rate of drafting: what the batch's drafting rounds
    measured (:func:`measured_rate`); at most ``max_skip`` rounds in a row, and not
    before a row's first drafting round (:data:`UNMEASURED`), since the next drafting round
    measures the rate again. Where even an acceptance rate of 0.999 would not make drafting
    pay (the costs alone decide), every round skips: nothing is left to measure. So does
    every round once ``patience`` row-rounds of measurement in a row were followed by a
    skip (``policy_state.losses``): the batch stops measuring. A batch that has skipped more than
    ``max_skip`` rounds in a row always skips: its drafter is further behind than one
    re-read (``DecodeConfig.reread``) can catch up.

    A proposing drafter (prompt lookup) is read before the round instead, since reading
    it costs nothing: the batch skips exactly when no draft of the active rows'
    ``proposal`` (each estimated by its match length) beats a plain step.
    Its drafter catches up from the text after skipped rounds, so it is never stale
    (``docs/goodput.md``, "Prompt lookup: looking before drafting").

    Args:
      policy, policy_state: the policy and its per-row state.
      active: ``[B]`` bool rows still decoding.
      max_skip: static, ``DecodeConfig.max_skip``.
      need: ``[B]`` tokens each row still has to write (0 for rows not ``active``);
        ``None``: weigh the batch's total tokens per second (:func:`_batch`).
      proposal: for a proposing drafter, the ``[B]`` features of each row's next proposal
        (:func:`proposal_features`); ``None`` for a drafter with distributions.
    """
    if max_skip == 0:
        return jnp.asarray(False)
    goodput = policy.kind == _KINDS.index("goodput")
    w = active.astype(jnp.float32)
    start = jnp.asarray(0, jnp.int32)
    plain = _batch(w, need) / jnp.maximum(policy.costs.skip_s, 1e-12)
    if proposal is not None:  # the best draft of these proposals against a plain step
        match = jnp.where(active, proposal.match, 0)
        a = _token_estimate(policy, policy_state, dataclasses.replace(proposal, match=match))
        best, _ = _best_deeper(policy.costs, w, w, a, start, policy.k_max, need)
        return goodput & (plain >= best) & jnp.any(active)
    full = jnp.full_like(w, 0.999)
    best, _ = _best_deeper(policy.costs, w, w, full, start, policy.k_max, need)
    hopeless = plain >= best
    gave_up = (policy.patience > 0) & jnp.all(policy_state.losses >= policy.patience)
    stale = jnp.any((policy_state.skipped > max_skip) & (policy_state.skipped != UNMEASURED))
    drafting = measured_rate(policy, policy_state, active, need)
    chooses = (plain >= drafting) & (jnp.all(policy_state.skipped < max_skip) | hopeless | gave_up)
    return goodput & (chooses | stale) & jnp.any(active)


def measured_rate(
    policy: PolicyParams,
    policy_state: PolicyState,
    active: jax.Array,
    need: jax.Array | None = None,
) -> jax.Array:
    """The batch's rate of drafting, in tokens per second (``[]`` float32), that the skip
    decision of ``goodput`` weighs against a plain step: ``sum_b emitted_b / spent_b`` over
    the ``active`` rows (``[B]`` bool), what its drafting rounds emitted over their cost
    (``spent_b = sum_d rounds_bd * costs.round_s[d]``, at the costs as they are now: a cost
    corrected since a round ran applies to it too),
    times ``1 + spread / sqrt(n)`` for ``n`` measured row-rounds (an upper confidence bound:
    the policy skips only when drafting is measured slower). Before a row has drafted, the
    model's prediction stands in: the best rate of drafting ``1..k_max`` tokens at each
    row's acceptance rate per token. Derivation: ``docs/goodput.md``, "The skip decision".

    With ``need`` (``[B]`` tokens each row still has to write) the figure is the batch's
    finishing rate instead (:func:`_batch`): each row's own rate, raised by ``spread /
    sqrt(n_b)`` for its ``n_b`` measured rounds, over its remaining work; the least of them.
    """
    w = active.astype(jnp.float32)
    start = jnp.asarray(0, jnp.int32)
    predicted, _ = _best_deeper(policy.costs, w, w, _rate(policy_state), start, policy.k_max, need)
    spent = policy_state.rounds @ policy.costs.round_s  # [B] seconds, at today's costs
    measured = jnp.sum(policy_state.rounds, axis=-1)  # [B]
    rates = policy_state.emitted / jnp.maximum(spent, 1e-12)  # [B] each row's tokens per second
    # No floor at one row-round: a prior from earlier decodes may weigh less (it halves
    # with each decode), and its bound must keep rising until a decode measures again.
    if need is None:
        n = jnp.sum(w * measured)
        bound = jnp.sum(w * rates) * (1.0 + policy.spread / jnp.sqrt(jnp.maximum(n, 1e-6)))
    else:
        raised = rates * (1.0 + policy.spread / jnp.sqrt(jnp.maximum(measured, 1e-6)))
        bound = _batch(jnp.where(active, raised, 0.0), jnp.where(active, need, 0.0))
    known = jnp.all(~active | (measured > 0)) & jnp.any(active)
    return jnp.where(known, bound, predicted)


def _match_class(length: jax.Array) -> jax.Array:
    """A match length (``>= 1``, any shape) -> its column of ``PolicyState.match_*``."""
    return jnp.clip(length, 1, MATCH_CLASSES) - 1


def _token_estimate(policy: PolicyParams, policy_state: PolicyState, features: DrafterFeatures):
    """``goodput``'s acceptance estimate of a drafted token: ``[B]``, the certificate
    estimate ``(C_q / log 2) ** beta`` times the row's calibration ``accepted / predicted``;
    for a proposing drafter's token (``features.match > 0``) the row's acceptance rate of
    proposals from matches of that length instead (``match_accepted / match_tested``, which
    start at ``prior``); in ``[0, 0.999]``."""
    ratio = _cert_ratio(features.cert)
    ratio = jnp.where(jnp.isnan(ratio), 0.0, ratio)
    calibration = policy_state.accepted / jnp.maximum(policy_state.predicted, 1e-6)
    estimate = calibration * ratio ** jnp.maximum(policy.beta, 1e-6)
    column = _match_class(features.match)[:, None]
    hits = jnp.take_along_axis(policy_state.match_accepted, column, axis=1)[:, 0]
    tries = jnp.take_along_axis(policy_state.match_tested, column, axis=1)[:, 0]
    by_match = hits / jnp.maximum(tries, 1e-6)
    return jnp.clip(jnp.where(features.match > 0, by_match, estimate), 0.0, 0.999)


def tested_estimate(policy: PolicyParams, q_cert: jax.Array, tested: jax.Array) -> jax.Array:
    """The sum of the certificate estimates ``(C_q / log 2) ** beta`` of a round's tested
    tokens: ``[B]`` float32, for :func:`update_policy_state`.

    Args:
      policy: the policy (its ``beta``).
      q_cert: ``[B, N]`` the drafter's certificate ``C_q`` at each drafted node (``nan``
        for a proposing drafter's point mass: estimate 1).
      tested: ``[B, N]`` bool the nodes the target tested: the drafter's first choice below
        the root and below every accepted node.
    """
    ratio = jnp.where(jnp.isnan(q_cert), 1.0, _cert_ratio(q_cert))
    estimate = ratio ** jnp.maximum(policy.beta, 1e-6)
    return jnp.sum(jnp.where(tested, estimate, 0.0), axis=-1)


def _cert_ratio(cert: jax.Array) -> jax.Array:
    """``C_q / log 2`` in ``[0, 1]`` (any shape): the drafter's normalised robustness,
    which ``cert`` and ``goodput`` raise to ``beta`` as an acceptance estimate."""
    return jnp.clip(cert / jnp.log(2.0), 0.0, 1.0)


def should_continue(
    policy: PolicyParams,
    policy_state: PolicyState,
    features: DrafterFeatures,
    drafted: jax.Array,
    survival: Survival,
    alive: jax.Array | None = None,
    need: jax.Array | None = None,
) -> tuple[jax.Array, Survival]:
    """Whether each row drafts one more token.

    Args:
      policy: the policy.
      policy_state: the per-row policy state.
      features: features of the distribution that produced the just-drafted token.
      drafted: ``[B]`` int32 tokens drafted so far this round (the depth, equal in every
        row).
      survival: the round's running :class:`Survival` (``Survival.start`` at round start).
      alive: ``[B]`` bool rows whose draft still has a token at this depth (``None``: all);
        the others add nothing to ``goodput``'s expected tokens.
      need: ``[B]`` tokens each row still has to write (0: done); ``None``: ``goodput``
        weighs the batch's total tokens per second instead of its finishing time.

    Returns:
      ``(continue, survival)``: ``[B]`` bool, ``False`` once ``drafted >= k_max``, and the
      updated :class:`Survival`.
    """
    ratio = _cert_ratio(features.cert)
    goodput = policy.kind == _KINDS.index("goodput")
    a = jnp.where(goodput, _token_estimate(policy, policy_state, features), ratio**policy.beta)
    prob = survival.prob * jnp.where(policy.beta > 0, a, 1)
    if alive is not None:
        prob = jnp.where(alive, prob, 0.0)
    survival = Survival(prob=prob, expected=survival.expected + prob)
    deeper, now = _best_deeper(
        policy.costs, survival.expected, prob, a, drafted[0], policy.k_max, need
    )
    decisions = jnp.stack(
        [
            drafted < policy.k,
            drafted < policy_state.k,
            features.top >= policy.tau,
            jnp.sqrt(policy.c * jnp.maximum(features.entropy, 0.0)) <= policy.h,
            survival.prob >= policy.lam,
            jnp.broadcast_to(deeper > now, drafted.shape),
        ]
    )  # [kinds, B]
    return decisions[policy.kind] & (drafted < policy.k_max), survival


def update_policy_state(
    policy: PolicyParams,
    policy_state: PolicyState,
    *,
    drafted: jax.Array,
    accepted: jax.Array,
    active: jax.Array,
    predicted: jax.Array | None = None,
    match: tuple[jax.Array, jax.Array] | None = None,
    emitted: jax.Array | None = None,
) -> PolicyState:
    """The policy state after a round that ran the drafter (the ``heuristic`` schedule,
    ``goodput``'s acceptance counts, and its measured drafting rate: the round's emitted
    tokens and its cost, ``costs.round_s`` at the batch's depth, depth 0 included: a round
    whose rows read the drafter and drafted nothing is a cost of drafting too; its skip
    count returns to 0, and its count of losing measurements too when the round before
    drafted as well: that one was followed by a drafting round).

    Args:
      policy: the policy.
      policy_state: the state before the round.
      drafted: ``[B]`` int32 draft length (depth) of the round.
      accepted: ``[B]`` int32 accepted drafted tokens.
      active: ``[B]`` bool rows that took part (others keep their policy_state).
      predicted: ``[B]`` float32 the sum of the tested tokens' certificate estimates
        (:func:`tested_estimate`); ``None``: estimate 1 for each.
      match: a proposing drafter's ``(accepted, tested)`` ``[B, L]`` float32 tokens of the
        round by match length (:func:`match_counts`); the counts of each length tested
        this round are weighed by ``memory`` first. ``None``: unchanged.
      emitted: ``[B]`` int32 tokens the round emitted: its accepted drafts and the target's
        token, less what an end token or the budget cut off (``None``: ``accepted + 1``).
        The measured drafting rate counts these, never tokens that were not emitted.
    """
    emitted = accepted + 1 if emitted is None else emitted
    full = accepted >= drafted
    k = jnp.where(full, policy_state.k + 2, jnp.maximum(policy_state.k - 1, 1))
    tested = jnp.minimum(drafted, accepted + 1).astype(jnp.float32)  # the first rejected too
    if predicted is None:
        predicted = tested
    measured = active & (drafted > 0)
    keep = jnp.where(measured, policy.memory, 1.0)  # the past's weight in the counts
    add = lambda x: jnp.where(measured, x, 0.0)  # noqa: E731  this round's tokens, in full
    depth = jnp.max(jnp.where(active, drafted, 0))  # the batch drafts to its deepest row
    # Every row of the round spent its time, even where no row drafted: reading the drafter
    # and drafting nothing costs more than a plain step, and the skip decision must see it.
    took = active
    at = jnp.arange(policy_state.rounds.shape[1]) == jnp.minimum(
        depth, policy_state.rounds.shape[1] - 1
    )
    match_accepted, match_tested = policy_state.match_accepted, policy_state.match_tested
    if match is not None:
        hits, tries = (jnp.where(active[:, None], x, 0.0) for x in match)
        fade = jnp.where(tries > 0, policy.memory, 1.0)
        match_accepted = fade * match_accepted + hits
        match_tested = fade * match_tested + tries
    return PolicyState(
        k=jnp.where(active, jnp.minimum(k, policy.k_max), policy_state.k),
        accepted=keep * policy_state.accepted + add(accepted.astype(jnp.float32)),
        tested=keep * policy_state.tested + add(tested),
        predicted=keep * policy_state.predicted + add(predicted),
        skipped=jnp.zeros_like(policy_state.skipped),
        losses=jnp.where(policy_state.skipped == 0, 0, policy_state.losses),
        emitted=policy_state.emitted + jnp.where(took, emitted, 0).astype(jnp.float32),
        rounds=policy_state.rounds + (took[:, None] & at[None, :]).astype(jnp.float32),
        match_accepted=match_accepted,
        match_tested=match_tested,
    )


def match_counts(length: jax.Array, tested: jax.Array, accepted: jax.Array):
    """A round's tested and accepted proposals by match length, for
    :func:`update_policy_state`.

    Args:
      length: ``[B, N]`` int32 each node's match length (0: not a proposal).
      tested: ``[B, N]`` bool the nodes the target tested.
      accepted: ``[B, N]`` bool the nodes on the accepted path.

    Returns:
      ``(accepted, tested)``: ``[B, L]`` float32 counts per :data:`MATCH_CLASSES` column.
    """
    columns = jax.nn.one_hot(_match_class(length), MATCH_CLASSES, dtype=jnp.float32)
    tried = (tested & (length > 0)).astype(jnp.float32)[..., None]  # [B, N, 1]
    hit = tried * accepted.astype(jnp.float32)[..., None]
    return jnp.sum(hit * columns, axis=1), jnp.sum(tried * columns, axis=1)


def tree_match_counts(tree: DraftTree, tested: jax.Array, accepted: jax.Array):
    """:func:`match_counts` of a proposing drafter's round: each node's match length read
    from the drafter logits that proposed it (``tree.q_logits`` at ``tree.q_index``).

    Args:
      tree: the round's :class:`~jaxcert.decoding.state.DraftTree` (``[B, N]`` nodes).
      tested, accepted: ``[B, N]`` bool nodes the target tested, and on the accepted path.
    """
    per_row = ngram_lib.match_length(tree.q_logits)  # [B, X]: reduce before gathering
    length = jnp.take_along_axis(per_row, tree.q_index, axis=1)  # [B, N]
    return match_counts(jnp.where(tree.valid, length, 0), tested, accepted)


def skipped_round(policy_state: PolicyState, count=1, rows=None) -> PolicyState:
    """The policy state after ``count`` rounds (``[]`` int32 or ``int``) that skipped the drafter
    (plain target steps): a skip right after a drafting round counts that round as a losing
    measurement, weighed by the ``rows`` (``[]`` int32 or ``int``; default: the batch) it
    measured: ``losses`` counts row-rounds, so a batch of 8 rows measures as much in one
    round as a single row in 8."""
    ran = jnp.asarray(count, jnp.int32)
    rows = policy_state.skipped.shape[0] if rows is None else rows
    lost = (policy_state.skipped == 0) & (ran > 0)
    return policy_state.replace(
        skipped=policy_state.skipped + ran, losses=policy_state.losses + jnp.where(lost, rows, 0)
    )
