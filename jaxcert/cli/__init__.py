"""The ``jaxcert`` command line: certify, certify-logits, decode, export-head, export-model,
fetch, finetune-drafter and train-drafter.

One module per command (:mod:`jaxcert.cli.certify`, :mod:`jaxcert.cli.certify_logits`,
:mod:`jaxcert.cli.decode`, :mod:`jaxcert.cli.export` (both exports),
:mod:`jaxcert.cli.fetch`, :mod:`jaxcert.cli.finetune_drafter`,
:mod:`jaxcert.cli.train_drafter`), each with ``add_parser(sub)``
and ``run(args)``; this module builds the parser and reports the commands' errors.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main", "DEFAULT_RULES", "DEFAULT_TARGET", "DEFAULT_DECODE_TARGET", "DEFAULT_DRAFTER"]

DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"
DEFAULT_DECODE_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_RULES = "greedy,additive:0.3,multiplicative:0.1,typical,topk:2,tree:2,tree:4,tree:8"


def build_parser() -> argparse.ArgumentParser:
    # The command modules read the defaults above: imported once this module is complete.
    from jaxcert.cli import (
        certify,
        certify_logits,
        decode,
        export,
        fetch,
        finetune_drafter,
        train_drafter,
    )

    parser = argparse.ArgumentParser(
        prog="jaxcert",
        description="Exact acceptance certificates, speculative decoding and certificate "
        "losses in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (
        certify,
        certify_logits,
        decode,
        export,
        fetch,
        finetune_drafter,
        train_drafter,
    ):
        command.add_parser(sub)
    return parser


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' advice that PyTorch was not found: jaxcert uses its tokenizers
    and configurations alone, never PyTorch. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def quiet_transformers() -> None:
    """Installs :class:`_NoTorchAdvice` on the ``transformers`` logger (once; before or
    after transformers is imported), so that it does not open every command."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxcert`` console script."""
    quiet_transformers()
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxcert.base.assets import AssetError

    try:
        return args.func(args)
    except (ValueError, OSError, AssetError) as err:  # OSError: unwritable --out, ...
        print(f"jaxcert {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what was finished is saved (the commands say where)
        print(f"jaxcert {args.command}: interrupted", file=sys.stderr)
        return 130
