"""Prompt sets: MT-Bench and ShareGPT from the registry, JSONL / ShareGPT files, chat templates."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Sequence

import numpy as np

from jaxcert.base.validate import check_int

__all__ = ["Prompt", "editing_prompts", "load_prompts", "encode_prompts", "pad_prompts"]


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user prompt.

    Attributes:
      id: identifier (MT-Bench ``question_id``, a JSONL ``id``, or the line number).
      text: the user turn.
      category: optional category (MT-Bench: writing, roleplay, ...).
      response: the reply that followed the turn, where the source has one (ShareGPT's
        ``gpt`` message right after the human turn), else ``None``.
    """

    id: str
    text: str
    category: str | None = None
    response: str | None = None


def _read_jsonl(path: pathlib.Path, turn: int) -> list[Prompt]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    records = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            records += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line")
            if isinstance(record.get("prompt"), str):
                if turn > 0:  # a single-turn record has no later turn
                    continue
                text = record["prompt"]
            elif isinstance(record.get("turns"), list) and record["turns"]:
                if turn >= len(record["turns"]):
                    continue
                text = record["turns"][turn]
            else:
                raise ValueError(
                    f"{path}:{number}: needs a string 'prompt' or a non-empty list 'turns'"
                )
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{number}: the prompt is empty or not a string")
            ident = record.get("id", record.get("question_id", number))
            category = record.get("category")
            category = None if category is None else str(category)
            prompts.append(Prompt(str(ident), text, category))
    if not prompts and records and turn > 0:
        raise ValueError(
            f"{path}: none of its {records} records has a turn {turn} (counting from 0)"
        )
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def _cut_off(text: str, err: json.JSONDecodeError) -> bool:
    """Whether a decode error is the end of the text arriving mid-value (a file cut short),
    rather than invalid JSON before it."""
    if err.msg.startswith("Unterminated string"):  # no closing quote before the end
        return True
    rest = text[err.pos :].rstrip()
    return any(word.startswith(rest) for word in ("true", "false", "null"))  # "" included


def _read_sharegpt(path: pathlib.Path, turn: int, limit: int | None) -> list[Prompt]:
    """The ``turn``-th human message of each conversation of a ShareGPT-format JSON array.

    The array is parsed one record at a time, so a file cut off mid-record (as the
    registry's copy is) yields its complete conversations; parsing stops at ``limit``.

    Raises:
      ValueError: not a JSON array; invalid JSON before the end of the file (a record cut
        short only at the end is dropped); a record without a ``conversations`` list; no
        conversation with a human turn ``turn``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: a ShareGPT file is a JSON array of conversations")
    pos += 1
    prompts: list[Prompt] = []
    index = -1  # of the record read, counting from 0
    while limit is None or len(prompts) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        index += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if _cut_off(text, err):
                break  # the last record, cut off at the end of the file
            raise ValueError(
                f"{path}: invalid JSON in record {index} ({err.msg}, line {err.lineno} "
                f"column {err.colno})"
            ) from None
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: record {index} has no 'conversations' list")
        turns = [t for t in turns if isinstance(t, dict)]
        human = [i for i, t in enumerate(turns) if t.get("from") == "human"]
        if turn >= len(human):
            continue
        at = human[turn]
        question = turns[at].get("value")
        if isinstance(question, str) and question.strip():
            after = turns[at + 1] if at + 1 < len(turns) else {}
            answer = after.get("value") if after.get("from") == "gpt" else None
            answer = answer if isinstance(answer, str) and answer.strip() else None
            prompts.append(Prompt(str(record.get("id", len(prompts))), question, None, answer))
    if not prompts:
        raise ValueError(f"{path}: no conversation with a human turn {turn}")
    return prompts


EDIT_VERBS = re.compile(
    r"\b(fix|modify|refactor|rewrite|change|convert|improve|edit|optimi[sz]e|update|"
    r"add|remove|rename|clean)\b",
    re.IGNORECASE,
)
EDIT_SKIP = 2000  # ShareGPT conversations before this one are left to training


def editing_prompts(
    prompt_set: Sequence[Prompt],
    *,
    skip: int = EDIT_SKIP,
    min_chars: int = 300,
    max_chars: int = 2500,
    min_code_lines: int = 5,
) -> list[Prompt]:
    """The prompts that hand the model a piece of code to change: the task where drafting
    by prompt lookup (`jaxcert.decoding.NgramDrafter`) is known to pay, since the reply
    repeats much of the prompt (``docs/cli.md``, "Prompts").

    A prompt qualifies when it holds a fenced code block (```) of at least
    ``min_code_lines`` lines, its text outside the code asks for an edit (fix, modify,
    refactor, rewrite, convert, add, ...), and it is ``min_chars`` to ``max_chars``
    characters long. The first ``skip`` prompts are passed over (``'sharegpt'``: they
    are the ones draft heads train on).

    Returns:
      The qualifying prompts, in order, with category ``'edit'``.
    """
    out = []
    for p in prompt_set[skip:]:
        if not min_chars <= len(p.text) <= max_chars:
            continue
        parts = p.text.split("```")
        if len(parts) < 3:
            continue
        code = parts[1::2]
        prose = " ".join(parts[0::2])
        if max(c.count("\n") for c in code) < min_code_lines or not EDIT_VERBS.search(prose):
            continue
        out.append(dataclasses.replace(p, category="edit"))
    return out


def load_prompts(source: str, *, turn: int = 0, max_prompts: int | None = None) -> list[Prompt]:
    """Loads prompts from a registry prompt set or a file.

    Sources:

    * ``'mtbench'``: the 80 MT-Bench questions (8 categories; ``turn`` 0 or 1).
    * ``'sharegpt'``: the first human turn (``turn``: the ``turn``-th) of each complete
      conversation of the ShareGPT V3 registry copy (17,382), in file order.
    * ``'sharegpt:edit'``: those of them that ask for an edit of quoted code
      (:func:`editing_prompts`).
    * a ``.jsonl`` file: each line an object with a string ``prompt`` or a list ``turns``
      (the ``turn``-th entry is used; records with fewer turns, and ``prompt`` records when
      ``turn > 0``, are skipped), and optional ``id`` / ``question_id`` and ``category``.
    * a ``.json`` file in ShareGPT format (an array of ``{"id", "conversations": [{"from":
      "human" | "gpt", "value"}]}``).

    The registry sets are downloaded once (``jaxcert fetch``) and cached.

    Args:
      source: ``'mtbench'``, ``'sharegpt'``, ``'sharegpt:edit'`` or a file path.
      turn: which turn of multi-turn records to use (0 = first).
      max_prompts: keep only the first ``max_prompts``.

    Returns:
      The prompts, in file order.

    Raises:
      FileNotFoundError: no such file, and not the name of a prompt set.
      ValueError: invalid JSON or a record without a usable prompt (line number given),
        no prompts at all, or the name of an asset that is a model.
    """
    from jaxcert.base import assets

    if max_prompts is not None:
        check_int("max_prompts", max_prompts)
    if source == "sharegpt:edit":
        edits = editing_prompts(load_prompts("sharegpt", turn=turn))
        return edits[:max_prompts] if max_prompts is not None else edits
    sets = assets.names("prompts")
    asset = assets.ASSETS.get(source)
    if asset is not None and asset.kind != "prompts":
        raise ValueError(f"{source!r} is a {asset.kind}, not a prompt set ({', '.join(sets)})")
    if asset is not None:
        path = assets.fetch(source)
    else:
        path = pathlib.Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"no prompt file {source!r}, and it is no prompt set name ({', '.join(sets)})"
            )
    if source == "sharegpt" or path.suffix == ".json":
        return _read_sharegpt(path, turn, max_prompts)
    prompts = _read_jsonl(path, turn)
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    return prompts


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    chat: bool = True,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, with the model's chat template when it has one.

    Args:
      tokenizer: a ``transformers`` tokenizer.
      prompts: the prompts.
      chat: apply the tokenizer's chat template (with the generation prompt) if it has
        one; otherwise, or with ``chat=False``, encode the raw text.
      system_prompt: an explicit system message; ``None`` keeps the template's default
        (Qwen2.5 adds "You are Qwen, created by Alibaba Cloud...").

    Returns:
      One list of token ids per prompt.
    """
    out = []
    use_chat = chat and getattr(tokenizer, "chat_template", None)
    for prompt in prompts:
        if use_chat:
            messages = [{"role": "user", "content": prompt.text}]
            if system_prompt is not None:
                messages.insert(0, {"role": "system", "content": system_prompt})
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        out.append([int(i) for i in ids])
    return out


def pad_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    width: int | None = None,
    minimum: int = 1,
    vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token-id prompts into one array, after checking every id.

    The one padding routine of the package (certify, the decoder, drafter training).

    Args:
      prompts: ``B`` sequences of int token ids.
      width: the padded width ``T`` (``None``: the longest prompt).
      minimum: the fewest tokens a prompt may have.
      vocab_size: ids must be in ``[0, V)`` (``None``: only ``>= 0`` is checked).

    Returns:
      ``(tokens, lengths)``: ``[B, T]`` int32 (zeros after each prompt) and ``[B]`` int32.

    Raises:
      ValueError: no prompts, a row that is not a sequence of integers, an id out of range,
        a prompt shorter than ``minimum``, or ``width`` shorter than the longest prompt.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts")
    if any(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError("prompts must be a list of token-id sequences (one per row)")
    rows = [np.asarray(p) for p in prompts]
    for i, ids in enumerate(rows):
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompt {i}: expected a sequence of integer token ids")
        high = np.iinfo(np.int32).max if vocab_size is None else vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= high):
            raise ValueError(
                f"prompt {i}: token ids must be in [0, {vocab_size}), got {ids.min()}..{ids.max()}"
            )
    lengths = np.array([len(p) for p in rows], np.int32)
    if lengths.min() < minimum:
        raise ValueError(
            f"every prompt needs at least {minimum} token{'s' if minimum != 1 else ''}; "
            f"prompt {int(lengths.argmin())} "
            f"has {lengths.min()}"
        )
    w = int(lengths.max()) if width is None else width
    if w < lengths.max():
        raise ValueError(f"prompt_width={w} is shorter than the longest prompt ({lengths.max()})")
    out = np.zeros((len(prompts), w), np.int32)
    for row, ids in enumerate(rows):
        out[row, : len(ids)] = ids
    return out, lengths
