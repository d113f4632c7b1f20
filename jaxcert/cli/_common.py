"""Arguments shared by several commands."""

from __future__ import annotations

import argparse

from jaxcert._argtypes import non_negative

__all__ = ["add_prompt_arguments"]


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """``--prompts``, ``--turn``, ``--no-chat`` and ``--system-prompt``."""
    p.add_argument(
        "--prompts",
        default="mtbench",
        help="'mtbench', 'sharegpt' (first human turns; cut with --max-prompts), a JSONL "
        "file with a 'prompt' or 'turns' field, or a ShareGPT-format .json file",
    )
    p.add_argument("--turn", type=non_negative, default=0, help="turn of multi-turn records")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system-prompt", default=None, help="explicit system message")
