"""Drafter-training recipe: KL vs KL + certificate violation (same as `jaxcert train-drafter`).

Usage: python scripts/train_drafter.py [--max-prompts 48] [--train-steps 150] [--out DIR]
(see `jaxcert train-drafter --help` for every flag).
"""

import sys

from jaxcert import cli

if __name__ == "__main__":
    sys.exit(cli.main(["train-drafter", *sys.argv[1:]]))
