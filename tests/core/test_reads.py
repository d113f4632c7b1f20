"""How many times the compiled certificates and losses read the logits: XLA's cost analysis
(``jaxcert.base.reads``) of the programs at ``[64, 151936]`` float32, with XLA's default
options (in a subprocess: the suite compiles with cheaper ones, which fuse differently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_PROGRAMS = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from jaxcert import losses
    from jaxcert.base.reads import input_reads
    from jaxcert.cli import DEFAULT_RULES
    from jaxcert.core import rules as R, solver

    x = jax.ShapeDtypeStruct((64, 151936), jnp.float32)
    d = jax.ShapeDtypeStruct((4, 16, 151936), jnp.float32)
    ids = jax.ShapeDtypeStruct((64, 64), jnp.int32)

    def certify(spec, fallback):
        rules = R.parse_rules(spec)
        def run(a):
            outs = solver._certificates_local(a, None, rules=rules, return_q=False, top_k=64,
                                              exact_rows=None, fallback=fallback)
            return [c.value for c in outs]
        return input_reads(run, x)

    def grad(loss):
        return input_reads(lambda a, b: jax.value_and_grad(lambda a: loss(a, b).mean())(a), d, d)

    out = {
        "logsumexp": input_reads(lambda a: jax.nn.logsumexp(a, -1), x),
        "gather": input_reads(
            lambda a, i: jnp.take_along_axis(a.reshape(64, -1, 64), i[..., None], axis=-2), x, ids
        ),
        "greedy": certify("greedy", False),
        "all": certify(DEFAULT_RULES, False),
        "all_with_exact_path": certify(DEFAULT_RULES, True),
        "kl": grad(losses.kl_divergence),
        "violation": grad(
            lambda a, b: losses.certificate_violation(a, b, R.StrictGreedy(), margin=0.05)
        ),
    }
    print(json.dumps({k: v._asdict() for k, v in out.items()}))
    """
)


@pytest.fixture(scope="module")
def reads():
    env = dict(os.environ, XLA_FLAGS="")  # XLA's defaults, as a user compiles
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAMS], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_counter_counts_what_a_program_reads(reads):
    # max, then the sum of exp: two reads, nothing gathered.
    assert abs(reads["logsumexp"]["xla"] - 2.0) < 0.01
    assert reads["logsumexp"]["gathered"] == reads["logsumexp"]["xla"]
    # 64 groups of 64 of 151,936 tokens: XLA charges the whole operand, the counter the
    # gathered bytes (read, then written).
    window = 64 * 64 / 151_936
    assert reads["gather"]["xla"] > 1.0
    assert abs(reads["gather"]["gathered"] - 2 * window) < 0.01


@pytest.mark.slow
def test_certificates_read_the_logits_in_two_passes(reads):
    """greedy: the group maxima and the normaliser (2 passes) and the window's gather; all
    8 default rules: one more pass for typical's entropy (XLA:CPU fuses no sibling
    reductions). The exact path of rows whose accepted set outgrows the window is compiled
    out here: XLA charges a conditional its dearest branch, taken or not."""
    assert reads["greedy"]["gathered"] <= 2.5, reads["greedy"]
    assert reads["all"]["gathered"] <= 3.5, reads["all"]
    # The window's one gather is the only correction.
    for name in ("greedy", "all"):
        assert 0.9 < reads[name]["xla"] - reads[name]["gathered"] < 1.0
    # The exact path is behind its conditionals (charged, not dropped).
    assert reads["all_with_exact_path"]["xla"] > reads["all"]["xla"]


@pytest.mark.slow
def test_the_losses_read_the_logits_a_stated_number_of_times(reads):
    """``value_and_grad`` of the KL loss and of ``certificate_violation`` w.r.t. the
    drafter, in units of one ``[B, T, V]`` array (drafter and target logits alike): the KL
    reads each side's normaliser (2 passes each) and both once for the sum, and its
    gradient ``q - p`` reads both and writes one (11; differentiating two ``log_softmax``
    read 21); the certificate adds its two passes over the target and the window."""
    assert reads["kl"]["gathered"] <= 11.5, reads["kl"]
    extra = reads["violation"]["gathered"] - reads["kl"]["gathered"]
    assert 1.5 <= extra <= 2.5, (reads["violation"], reads["kl"])
