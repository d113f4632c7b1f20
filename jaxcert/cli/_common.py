"""Arguments shared by several commands."""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxcert.base.tables import counted
from jaxcert.base.validate import parsed_by
from jaxcert.cli.argtypes import non_negative, positive

__all__ = [
    "add_prompt_arguments",
    "check_vocabularies",
    "load_model",
    "load_prompt_set",
    "policy_arg",
    "rules_arg",
    "verify_arg",
]


def _parse_rules(text: str):
    from jaxcert.core.rules import parse_rules  # imported when used: `jaxcert --help` stays fast

    return parse_rules(text)


def _parse_policy(text: str):
    from jaxcert.decoding.policies import parse_policy

    return parse_policy(text)


def _parse_verify(text: str):
    from jaxcert.decoding.verify import parse_verify

    return parse_verify(text)


# argparse types: a bad spec fails when the command line is parsed, naming the option.
rules_arg = parsed_by(_parse_rules)
rules_arg.__name__ = "rules"
policy_arg = parsed_by(_parse_policy)
policy_arg.__name__ = "policy"
verify_arg = parsed_by(_parse_verify)
verify_arg.__name__ = "verify"


def load_model(option: str, name_or_path, **kwargs):
    """``models.load``, its errors prefixed with the option that named the model."""
    from jaxcert import models

    try:
        return models.load(name_or_path, **kwargs)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None


def load_drafter(name_or_path, target, **kwargs):
    """The ``--drafter``: a language model (``models.load``), a draft head folder
    (``models.eagle.save_head``, or an EAGLE-3 / speculators folder read by
    ``models.eagle3.read_head``), checked against ``target`` (a ``models.LoadedModel``), or
    ``ngram:N[:MIN]`` (a :class:`jaxcert.decoding.NgramDrafter` of the target's vocabulary,
    returned as the module itself).

    A head is returned as a ``models.LoadedModel`` with the target's tokenizer and the
    head's folder as its path (placed on ``kwargs["mesh"]`` when given).

    Raises:
      ValueError: as ``models.load``; a head built for another target (prefixed with
        ``--drafter``).
    """
    from jaxcert import models
    from jaxcert.decoding.ngram import parse_ngram
    from jaxcert.models import eagle

    try:
        ngram = parse_ngram(str(name_or_path))
    except ValueError as err:
        raise ValueError(f"--drafter: {err}") from None
    if ngram is not None:
        return ngram.for_vocabulary(target.config.vocab_size)
    from jaxcert.models import eagle3

    engine = eagle3.engine_format(name_or_path) is not None
    if not eagle.is_head_folder(name_or_path) and not engine:
        return load_model("--drafter", name_or_path, **kwargs)
    try:
        head = eagle3.read_head(name_or_path, target.model)
        eagle.check_head_fits(head, target.config)
    except ValueError as err:
        raise ValueError(f"--drafter: {err}") from None
    if kwargs.get("mesh") is not None:
        head = models.shard(head, kwargs["mesh"])
    return models.LoadedModel(
        model=head, tokenizer=target.tokenizer, config=head.config, path=pathlib.Path(name_or_path)
    )


def check_vocabularies(target, drafter) -> None:
    """Refuses a target and a drafter of different vocabulary sizes, from their configs alone.

    Reads each model's `config.json` or GGUF header (`models.read_config`), so a mismatch is
    refused before any weights are read or dequantised; the tokenizers are compared once
    the models are loaded (`models.check_same_vocabulary` on them).

    Args:
      target, drafter: what ``--target`` and ``--drafter`` name (asset, folder or ``.gguf``).

    Raises:
      ValueError: the vocabulary sizes differ, or a model cannot be found or its config read
        (prefixed with the option that named it).
    """
    from jaxcert import models
    from jaxcert.decoding.ngram import parse_ngram
    from jaxcert.models import eagle, eagle3

    try:
        if parse_ngram(str(drafter)) is not None:  # it takes the target's vocabulary
            return
    except ValueError as err:
        raise ValueError(f"--drafter: {err}") from None
    configs = []
    for option, name_or_path in (("--target", target), ("--drafter", drafter)):
        try:
            if eagle.is_head_folder(name_or_path):  # a draft head: its target's config
                configs.append(eagle.read_head_config(name_or_path))
                continue
            if eagle3.engine_format(name_or_path) is not None:  # an EAGLE-3 / speculators head
                configs.append(eagle3.head_target_config(name_or_path, configs[0]))
                continue
            configs.append(models.read_config(name_or_path))
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    models.check_same_vocabulary(*configs)


def describe_drafter(drafter) -> tuple[str, str]:
    """``(name, what)`` of a loaded ``--drafter`` for logs and summaries: the folder or file
    name and its layers, or ``ngram:N`` and ``prompt lookup``."""
    spec = getattr(drafter, "spec", None)
    if spec is not None and getattr(drafter, "proposes_tokens", False):
        return spec, "prompt lookup"
    return drafter.path.name, counted(drafter.config.num_layers, "layer")


def load_prompt_set(source: str, **kwargs):
    """``prompts.load_prompts``, its errors prefixed with ``--prompts``."""
    from jaxcert.base import prompts

    try:
        return prompts.load_prompts(source, **kwargs)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"--prompts: {err}") from None


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """``--prompts``, ``--turn``, ``--no-chat`` and ``--system-prompt``."""
    p.add_argument(
        "--prompts",
        default="mtbench",
        help="'mtbench', 'sharegpt' (first human turns; cut with --max-prompts), a JSONL "
        "file with a 'prompt' or 'turns' field, or a ShareGPT-format .json file "
        "(default %(default)s)",
    )
    p.add_argument(
        "--turn",
        type=non_negative,
        default=0,
        help="turn of multi-turn records, from 0 (default %(default)s)",
    )
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--system-prompt",
        default=None,
        help="explicit system message (default: none, the chat template's own)",
    )


def add_mesh_argument(p, what: str, default: str = "every local device on data") -> None:
    """Adds ``--mesh data=D,model=M`` to an ``argparse`` parser (checked by :func:`make_mesh`)."""
    p.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help=f"device mesh of this process: {what} (default: {default})",
    )


def add_distributed_arguments(p) -> None:
    """Adds ``--coordinator``, ``--num-processes``, ``--process-id`` and ``--distributed``
    (read by :func:`initialize_distributed`)."""
    g = p.add_argument_group("multi-process runs (see 'scaling out' below)")
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordination service (or $JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes",
        type=positive,
        default=None,
        help="number of processes (or $JAX_NUM_PROCESSES)",
    )
    g.add_argument(
        "--process-id",
        type=non_negative,
        default=None,
        help="this process's index, 0 to N-1 (or $JAX_PROCESS_ID)",
    )
    g.add_argument(
        "--join-timeout",
        type=positive,
        default=300,
        help="seconds to wait for every process to join before giving up with an error "
        "(default 300)",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() and let JAX detect the rest (TPU pods, "
        "SLURM, Open MPI)",
    )


def warn_undefined_drafter(undefined: int, positions: int, where: str = "") -> None:
    """The one warning line of certify and certify-logits for the positions whose drafter
    logits are no distribution (NaN or +inf, or none finite), to stderr; nothing when
    ``undefined`` is 0. ``where`` names those positions (certify-logits' rows)."""
    if undefined:
        named = f" ({where})" if where else ""
        print(f"[jaxcert] warning: the drafter's logits are no distribution (NaN or +inf, or "
              f"none finite) at {counted(undefined, 'position')} of {positions}{named}: KL "
              "undefined there, counted as neither certified nor accepted",
              file=sys.stderr)  # fmt: skip


def clamp_kls(value):
    """``value`` (a JSON-like tree of dicts and lists) with every KL divergence, a float
    under a key ``kl`` or ending in ``_kl``, clamped to ``>= 0.0``: a KL is never negative,
    and float rounding of one near 0 gives ``-0.0`` or ``-1e-9``. Other values and ``None``
    stay as they are; a new tree is returned."""
    if isinstance(value, dict):
        return {
            k: _nonnegative(v) if _is_kl(k) and isinstance(v, float) else clamp_kls(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(clamp_kls(v) for v in value)
    return value


def _is_kl(key) -> bool:
    return isinstance(key, str) and (key == "kl" or key.endswith("_kl"))


def _nonnegative(x: float) -> float:
    return 0.0 if x <= 0.0 else x  # -0.0 <= 0.0 too; nan stays nan
