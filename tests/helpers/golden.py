"""Loads the golden certificate cases of ../shared/cases/certificates.json."""

from __future__ import annotations

import json
import math
import os
import pathlib

from jaxcert.core import rules as rules_lib

# A copy of ../shared/cases/certificates.json travels with the repo so CI needs nothing
# outside the checkout; JAXCERT_GOLDEN_CASES points at another file.
_CANDIDATES = (
    os.environ.get("JAXCERT_GOLDEN_CASES", ""),
    pathlib.Path(__file__).resolve().parents[1] / "data" / "certificates.json",
)


def golden_path() -> pathlib.Path:
    for candidate in _CANDIDATES:
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    raise FileNotFoundError("golden cases not found; set JAXCERT_GOLDEN_CASES")


def rule_from_case(case: dict) -> rules_lib.Rule:
    name, params = case["rule"], dict(case["params"])
    if name == "strict_greedy":
        return rules_lib.StrictGreedy()
    if name == "additive":
        return rules_lib.Additive(params["t"])
    if name == "multiplicative":
        return rules_lib.Multiplicative(params["alpha"])
    if name == "topk":
        return rules_lib.TargetTopK(params["k"])
    if name == "entropy":
        return rules_lib.Typical(**params)
    if name == "tree":
        return rules_lib.TreeCoverage(params["m"])
    if name == "tree_relaxed":
        m, base = params.pop("m"), params.pop("base")
        single = rule_from_case({"rule": base, "params": params})
        return rules_lib.TreeCoverage(m, base=single)
    raise ValueError(f"unknown rule in golden case: {name}")


def load_cases() -> list[dict]:
    cases = json.loads(golden_path().read_text())["cases"]
    for case in cases:
        value = case["expected"]
        case["expected"] = math.inf if value in ("inf", math.inf) else float(value)
    return cases
