"""Draft heads on each other's held-out records: which training data makes the better head.

Heads trained by ``jaxcert train-drafter --head`` on different data (``--data replies``:
ShareGPT's assistant replies; ``--data greedy``: the target's greedy continuations) are
evaluated on every named held-out store (each run's ``heldout/`` folder): held-out KL, TV,
greedy agreement and certified fractions per head, with 95% bootstrap intervals over the
store's sequences, and every head's paired difference from the first
(``jaxcert.training.head_recipe.evaluate_heads``; method in ``docs/training.md``,
"Replies or greedy continuations").

Usage::

  python scripts/compare_heads.py \\
      --head replies=RUN_R/kl+tv-seed0/head,RUN_R/kl+tv-seed1/head \\
      --head greedy=RUN_G/kl+tv-seed0/head,RUN_G/kl+tv-seed1/head \\
      --heldout replies=RUN_R/heldout --heldout greedy=RUN_G/heldout \\
      --out jaxcert-out/compare_heads.json

with RUN_R and RUN_G the ``--out`` folders of a ``--data replies`` and a ``--data greedy``
run. Prints a markdown table and writes the JSON to ``--out``. With ``--depth D`` it also
reports the 2nd to D-th drafted tokens of a round and the accepted tokens of a D-token
greedy chain (heads trained with and without training-time test: ``docs/training.md``,
"Training-time test").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def _named(text: str) -> tuple[str, list[pathlib.Path]]:
    name, sep, paths = text.partition("=")
    if not sep or not name or not paths or "" in paths.split(","):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[,PATH...], got {text!r}")
    return name, [pathlib.Path(p) for p in paths.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    from jaxcert.cli.argtypes import positive

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--head",
        type=_named,
        action="append",
        required=True,
        help="NAME=FOLDER[,FOLDER...]: a trained head (models.eagle.save_head), or several "
        "(seeds: their per-sequence metrics averaged); repeat; the first is the baseline of "
        "the paired differences",
    )
    p.add_argument(
        "--heldout",
        type=_named,
        action="append",
        required=True,
        help="NAME=FOLDER of a held-out record store (a train-drafter run's heldout/); repeat",
    )
    p.add_argument(
        "--depth",
        type=positive,
        default=1,
        help="drafted tokens a round: also report the 2nd..D-th token's KL and agreement and "
        "the accepted tokens of a D-token greedy chain (default %(default)s: first token only)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/compare_heads.json"),
        help="JSON results (default jaxcert-out/compare_heads.json)",
    )
    args = p.parse_args(argv)
    for name, paths in args.heldout:
        if len(paths) != 1:
            p.error(f"--heldout {name} names {len(paths)} folders; give one store a name")
    for flag in ("head", "heldout"):
        names = [name for name, _ in getattr(args, flag)]
        if len(set(names)) != len(names):
            p.error(f"--{flag} names must be distinct, got {names}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxcert.models.eagle import load_head
    from jaxcert.training import head_data, head_recipe

    start = time.perf_counter()
    heads = {name: [load_head(p) for p in paths] for name, paths in args.head}
    stores = {name: head_data.read_store(paths[0]) for name, paths in args.heldout}
    result = head_recipe.evaluate_heads(heads, stores, depth=args.depth)
    result["heads"] = {name: [str(p) for p in paths] for name, paths in args.head}
    result["command"] = " ".join(["scripts/compare_heads.py", *(argv or sys.argv[1:])])
    result["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(head_recipe.heads_table(result))
    print(f"[compare_heads] {result['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
