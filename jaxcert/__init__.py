"""jaxcert: exact acceptance certificates, speculative decoding and certificate losses.

Shape letters, one meaning each across the package (``jaxcert.decoding`` and
``jaxcert.models`` add their own, listed in their docstrings, and never reuse these):

=====  ====================================================================
B      batch rows (for the solver: all leading axes flattened)
T      positions (time)
V      vocabulary
M      list size ``m`` of a rule (top-``m``, tree coverage)
W      the solver's sorted window of the top logits (``top_k``)
=====  ====================================================================

The math is in the repository's theory document, ``docs/certificates.md``; docstrings
cite its sections as "``docs/certificates.md`` §N".
"""

from jaxcert import losses
from jaxcert.base.compile_cache import enable_compilation_cache
from jaxcert.core.bounds import (
    certified_run_length,
    greedy_margin_bounds,
    tree_margin_lower_bound,
    tree_margin_upper_bound,
)
from jaxcert.core.rules import (
    Additive,
    Multiplicative,
    Rule,
    StrictGreedy,
    TargetTopK,
    TreeCoverage,
    Typical,
    parse_rule,
    parse_rules,
)
from jaxcert.core.solver import DEFAULT_TOP_K, Certificate, certificate, certificates
from jaxcert.core.stats import DistributionStats, distribution_stats

__version__ = "0.1.0"

__all__ = [
    "Additive",
    "Certificate",
    "DistributionStats",
    "DEFAULT_TOP_K",
    "Multiplicative",
    "Rule",
    "StrictGreedy",
    "TargetTopK",
    "TreeCoverage",
    "Typical",
    "certificate",
    "losses",
    "certificates",
    "certified_run_length",
    "distribution_stats",
    "enable_compilation_cache",
    "greedy_margin_bounds",
    "tree_margin_lower_bound",
    "tree_margin_upper_bound",
    "parse_rule",
    "parse_rules",
]
