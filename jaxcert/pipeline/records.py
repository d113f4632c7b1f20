"""Serving engines' log-probability records, read as engines really write them.

One record per JSON Lines line (or one JSON document), in any of these spellings:

=====================================  =========================================================
OpenAI chat completions (vLLM,         ``choices[].logprobs.content[]``: ``token``, ``logprob``,
SGLang, llama.cpp, TGI OpenAI route)   ``bytes``, ``top_logprobs[]`` of ``{token, logprob}``
OpenAI completions (legacy; vLLM)      ``choices[].logprobs``: ``tokens``, ``token_logprobs``,
                                       ``top_logprobs[]`` of ``{token: logprob}`` or ``null``
OpenAI Responses API                   ``output[].content[].logprobs[]`` (as chat)
a bare chat ``logprobs`` object        ``{"content": [...]}``, or a list of positions
TGI native ``/generate``               ``details.tokens[]`` and ``details.top_tokens[][]``
SGLang native ``/generate``            ``meta_info.output_token_logprobs[]`` and
                                       ``meta_info.output_top_logprobs[][]``: ``[logprob, id,
                                       text]``
llama.cpp ``/completion``              ``completion_probabilities[]``: ``id``, ``token``,
                                       ``logprob``, ``top_logprobs[]``; with
                                       ``post_sampling_probs`` ``prob`` and ``top_probs[]``;
                                       older servers ``content`` and ``probs[]`` of
                                       ``{tok_str, prob}``
=====================================  =========================================================

A certificate of a position is exact only if its list holds the **true top** ``K``
probabilities (``docs/certificates.md`` §9). Engines' lists are not always that; each position
is turned into such a window as follows, and every change is counted
(:class:`RecordCounts`):

* **The appended sampled token.** The completions format puts the sampled token into
  ``top_logprobs`` even when it is not among the top ``N`` ("up to ``logprobs + 1``
  elements"), and vLLM's chat route may list it in place of the ``N``-th token. Such a
  token is below every true top-``N`` entry. So where a position names its sampled token
  ``s`` and ``s`` is strictly the least listed entry, ``s`` may be such an extra: it is
  left out of the window, unless ``p(s)`` exceeds the unseen mass ``1 - sum(listed)`` (then
  no unseen token can rank above it, so it is the next true entry whatever the engine
  did). Dropping an entry shortens the window, never overstates a certificate.
* **Duplicates.** An entry repeated with the same token, bytes and log-probability (an
  engine bug) is kept once. The same token id with two different log-probabilities is an
  error.
* **Sentinels.** A log-probability at or below ``-9999`` (OpenAI's "not in the top 20",
  vLLM's ``-inf``) is no value: that entry is left out (it ranks below every real one).
* **Missing positions.** ``top_logprobs: null`` (the first prompt token under ``echo``),
  an empty list, or an entry with no log-probability: the position has no window; it is
  skipped and counted, and the other positions are read.

A line that is no JSON (e.g. a truncated last line) is an error naming it, or, with
``skip_bad_lines``, skipped and counted. Streamed responses (``stream: true``, one
``chat.completion.chunk`` per line, ``data:`` prefixes of a saved event stream allowed)
are one record per stream ``id``, the chunks' positions in order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from jaxcert.base.tables import counted

__all__ = [
    "LOGPROB_TOLERANCE",
    "SENTINEL_LOGPROB",
    "LogprobRecords",
    "RecordCounts",
    "parse_logprob_records",
    "read_logprob_records",
    "top_window",
]

SENTINEL_LOGPROB = -9999.0  # at or below: "not in the top list" (OpenAI), "-inf" (vLLM)
_MASS_TOLERANCE = 1e-5  # engines' float32 log-probabilities sum to 1 within ~1e-6
LOGPROB_TOLERANCE = 1e-3  # a log-probability may exceed 0 by engines' float rounding


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One listed token: its log-probability (``None``: not given) and identity."""

    logprob: float | None
    id: int | None = None
    text: str | None = None
    raw_bytes: tuple[int, ...] | None = None

    def same_token(self, other: _Entry) -> bool:
        if self.id is not None and other.id is not None:
            return self.id == other.id
        if self.text is None or other.text is None or self.text != other.text:
            return False
        return (
            self.raw_bytes is None or other.raw_bytes is None or self.raw_bytes == other.raw_bytes
        )


_UNKNOWN = _Entry(None)  # a sampled token the record does not name, though it may be listed


@dataclasses.dataclass
class RecordCounts:
    """What reading the records changed or skipped (the summary reports it).

    Attributes:
      positions: positions with a window (rows of the result).
      missing_positions: positions without any usable log-probability (``null`` lists,
        empty lists, entries without a value): skipped.
      duplicates_removed: repeated identical entries dropped.
      sampled_dropped: positions whose sampled token was strictly the least entry and may
        have been appended outside the top ``N``: left out of the window.
      sentinel_entries: entries at or below ``-9999`` left out.
      ambiguous_cuts: windows cut after a value listed twice under a spelling that may
        stand for two tokens (a duplicate, or a tie: the next entry is not known).
      bad_lines_skipped: unreadable JSON lines skipped (``skip_bad_lines``).
    """

    positions: int = 0
    missing_positions: int = 0
    duplicates_removed: int = 0
    sampled_dropped: int = 0
    sentinel_entries: int = 0
    ambiguous_cuts: int = 0
    bad_lines_skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class LogprobRecords(NamedTuple):
    """Records read into top-``K`` windows.

    Attributes:
      index: columns ``record`` (0-based line, int64), ``choice`` (int32) and ``position``
        (int32, the position in its sequence, counting missing ones), each ``[N]``.
      logprobs: ``[N, K]`` float64 natural-log probabilities of each window, decreasing,
        padded with ``-inf``.
      counts: what was dropped or skipped (:class:`RecordCounts`).
    """

    index: dict[str, np.ndarray]  # type: ignore[assignment]  # the field shadows tuple.index
    logprobs: np.ndarray
    counts: RecordCounts


def _number(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {str(value)[:40]!r}")
    return float(value)


def _log_prob(entry: dict) -> float | None:
    if "logprob" in entry:
        return _number(entry["logprob"], "a logprob")
    if "prob" in entry:  # llama.cpp: probabilities (post_sampling_probs, older servers)
        prob = _number(entry["prob"], "a prob")
        if prob is None or math.isnan(prob):
            return None  # no value: the position is missing
        if prob < 0:
            raise ValueError(f"a negative prob: {prob!r}")
        return math.log(prob) if prob > 0 else -math.inf
    return None


def _entry(e) -> _Entry:
    """One entry of a top list, in any engine's spelling."""
    if isinstance(e, dict):
        token_id = e.get("id", e.get("token_id"))
        text = e.get("token", e.get("text", e.get("tok_str")))
        raw = e.get("bytes")
        return _Entry(
            _log_prob(e),
            int(token_id) if isinstance(token_id, int) and not isinstance(token_id, bool) else None,
            text if isinstance(text, str) else None,
            tuple(raw) if isinstance(raw, list) else None,
        )
    if isinstance(e, list | tuple) and e:  # SGLang: [logprob, token_id, text]
        token_id = e[1] if len(e) > 1 and isinstance(e[1], int) else None
        text = e[2] if len(e) > 2 and isinstance(e[2], str) else None
        return _Entry(_number(e[0], "a logprob"), token_id, text)
    if isinstance(e, int | float) and not isinstance(e, bool):  # a bare number
        return _Entry(float(e))
    raise ValueError(f"an entry without 'logprob' or 'prob': {str(e)[:80]}")


_Position = tuple[list[_Entry] | None, _Entry | None]  # (entries or None: missing, sampled)


def _position(pos) -> _Position:
    """One position of a chat / llama.cpp / TGI / bare sequence: its list and sampled token."""
    if pos is None:
        return None, None
    if isinstance(pos, dict):
        for key in ("top_logprobs", "top_probs", "probs", "top_tokens"):
            if key in pos:
                listed = pos[key]
                break
        else:
            raise ValueError(
                "a position without 'top_logprobs' (or llama.cpp's 'top_probs' / 'probs'): "
                f"{str(pos)[:80]}"
            )
        sampled = _entry(pos)
        if "probs" in pos and sampled.text is None and isinstance(pos.get("content"), str):
            sampled = _Entry(None, text=pos["content"])  # older llama.cpp: content + probs
        named = sampled.id is not None or sampled.text is not None or sampled.logprob is not None
        entries = None if listed is None else [_entry(e) for e in listed]
        return entries, (sampled if named else None)
    if isinstance(pos, list):
        return [_entry(e) for e in pos], None
    raise ValueError(f"a position that is not a list or an object: {str(pos)[:80]}")


def _completions(lp: dict) -> list[_Position]:
    """Legacy completions ``logprobs``: ``top_logprobs`` of ``{token: logprob}``."""
    tops = lp.get("top_logprobs") or []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    out: list[_Position] = []
    for t, top in enumerate(tops):
        sampled = _UNKNOWN  # listed "up to logprobs + 1": the least entry may be the extra
        if t < len(tokens) and isinstance(tokens[t], str):
            value = _number(values[t], "a token_logprob") if t < len(values) else None
            sampled = _Entry(value, text=tokens[t])
        if top is None:
            out.append((None, sampled))
        elif isinstance(top, dict):
            out.append(([_Entry(_number(v, "a logprob"), text=k) for k, v in top.items()], sampled))
        else:
            out.append(_position(top))
    return out


def _is_chunk(record) -> bool:
    """One chunk of a streamed response (``stream: true``): its positions continue the
    previous chunk's of the same ``id``."""
    return str(record.get("object", "")).endswith(".chunk")


def _paired(tops: list, tokens: list) -> list[_Position]:
    """Positions from parallel lists of top lists and sampled tokens (TGI, SGLang)."""
    sampled = [_entry(t) for t in tokens] + [None] * max(0, len(tops) - len(tokens))
    return [(None if top is None else [_entry(e) for e in top], s)
            for top, s in zip(tops, sampled, strict=False)]  # fmt: skip


def _sequences(record) -> list[list[_Position]]:
    """The positions of each sequence (choice) of one record."""
    if isinstance(record, dict) and "choices" in record:
        out = []
        for choice in record["choices"]:
            lp = choice.get("logprobs") or {}
            if "content" in lp:  # chat completions
                out.append([_position(p) for p in lp["content"] or []])
            elif "top_logprobs" in lp:  # completions
                out.append(_completions(lp))
            elif _is_chunk(record):  # a stream's role or finish chunk: no positions
                out.append([])
            else:
                raise ValueError("a choice without logprobs (request top_logprobs / logprobs)")
        return out
    if isinstance(record, dict) and isinstance(record.get("output"), list):  # Responses API
        out = []
        for item in record["output"]:
            for part in (item.get("content") or []) if isinstance(item, dict) else []:
                if isinstance(part, dict) and "logprobs" in part:
                    out.append([_position(p) for p in part["logprobs"] or []])
        if not out:
            raise ValueError("a Responses API record without output[].content[].logprobs")
        return out
    if isinstance(record, dict) and "details" in record:  # TGI native
        details = record["details"] or {}
        tokens = details.get("tokens") or []
        tops = details.get("top_tokens") or []
        if not tops:
            raise ValueError("TGI details without top_tokens (request top_n_tokens)")
        return [_paired(tops, tokens)]
    if isinstance(record, dict) and "meta_info" in record:  # SGLang native
        meta = record["meta_info"] or {}
        tops = meta.get("output_top_logprobs")
        if tops is None:
            raise ValueError(
                "SGLang meta_info without output_top_logprobs (request top_logprobs_num)"
            )
        tokens = meta.get("output_token_logprobs") or []
        return [_paired(tops, tokens)]
    if isinstance(record, dict) and "completion_probabilities" in record:  # llama.cpp
        return [[_position(p) for p in record["completion_probabilities"] or []]]
    if isinstance(record, dict) and isinstance(record.get("content"), list):
        return [[_position(p) for p in record["content"]]]  # a bare logprobs object
    if isinstance(record, list):
        return [[_position(p) for p in record]]
    raise ValueError(
        "unrecognised record: expected an OpenAI-style response with choices[].logprobs, "
        "a logprobs object with 'content', TGI 'details', SGLang 'meta_info' or llama.cpp "
        "'completion_probabilities'"
    )


def _ambiguous(e: _Entry, listed: list[_Entry]) -> bool:
    """Whether ``e``'s spelling may stand for several tokens: no id and no text, text that
    lost bytes in decoding (U+FFFD: vLLM spells every partial-UTF-8 token so), or another
    listed entry with the same spelling and another value."""
    if e.id is not None:
        return False
    if e.text is None or "\ufffd" in e.text:
        return True
    return any(o.same_token(e) and o.logprob != e.logprob for o in listed)


def top_window(
    entries: list[_Entry] | None, sampled: _Entry | None, counts: RecordCounts
) -> list[float] | None:
    """The window of one position: log-probabilities that are surely the true top ``K``.

    Returns ``None`` for a position without one (counted as missing). See the module
    docstring for the rules; every entry dropped is counted in ``counts``.

    Raises:
      ValueError: one token id listed with two different log-probabilities, or a
        log-probability above 0 (logits, not log-probabilities).
    """
    if not entries or any(e.logprob is None or math.isnan(e.logprob) for e in entries):
        counts.missing_positions += 1
        return None
    if any(_value(e) > LOGPROB_TOLERANCE for e in entries):
        worst = max(_value(e) for e in entries)
        raise ValueError(
            f"a log-probability above 0 ({worst:g}): pass the engine's logprobs, not logits"
        )
    kept: list[_Entry] = []
    for e in sorted(entries, key=lambda e: -_value(e)):  # stable: listed order among equals
        if _value(e) <= SENTINEL_LOGPROB:
            counts.sentinel_entries += 1
            continue
        if any(k.same_token(e) and _value(k) == _value(e) for k in kept):
            if not _ambiguous(e, entries):
                counts.duplicates_removed += 1
                continue
            # The same spelling and value twice: a repeated entry, or a tie of two tokens
            # spelt alike. Either way one copy of the value is the next entry; what follows
            # it is not known, so the window ends here.
            counts.ambiguous_cuts += 1
            break
        if e.id is not None and any(k.id == e.id for k in kept):
            raise ValueError(f"token id {e.id} is listed with two different log-probabilities")
        kept.append(e)
    if sampled is not None and kept:
        s = _listed_sampled(kept, sampled)
        if s is not None:
            others = [_value(e) for e in kept if e is not s]
            if not others or _value(s) < min(others):
                unseen = 1.0 - math.fsum(math.exp(_value(e)) for e in kept)
                if not math.exp(_value(s)) > unseen + _MASS_TOLERANCE:
                    kept.remove(s)
                    counts.sampled_dropped += 1
    if not kept:
        counts.missing_positions += 1
        return None
    return [_value(e) for e in kept]


def _listed_sampled(kept: list[_Entry], sampled: _Entry) -> _Entry | None:
    """The listed entry that may be the sampled token (the one to drop if it is the least)."""
    if sampled is _UNKNOWN:  # the format may append it, the record does not say which it is
        return kept[-1]
    if not _ambiguous(sampled, kept):
        named = [e for e in kept if e.same_token(sampled)]
        if named:
            if sampled.logprob is not None:
                close = [e for e in named if _close(_value(e), sampled.logprob)]
                if close:
                    return close[-1]
            return named[-1]  # the least of the entries spelt like it
    if sampled.logprob is not None:  # by value (a spelling that may stand for several)
        close = [e for e in kept if _close(_value(e), sampled.logprob)]
        if close:
            return close[-1]
    if sampled.text is not None and "\ufffd" in sampled.text:
        return kept[-1]  # spelt like any byte token, value unknown: the least could be it
    return None


def _value(e: _Entry) -> float:
    """``e.logprob`` of a listed entry of a window (`top_window` checked it is given)."""
    assert e.logprob is not None
    return e.logprob


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 1e-6 * abs(b)


def _documents(path: pathlib.Path, skip_bad_lines: bool, counts: RecordCounts):
    """``(line number, parsed record)`` of a JSON Lines file or one JSON document."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is no JSON
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file of JSON records ({err.reason})") from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            whole = json.loads(text)  # one (possibly pretty-printed) document
        except json.JSONDecodeError:
            whole = None  # JSON Lines (or broken): read line by line below
        if isinstance(whole, dict):
            return [(0, whole)]
        if isinstance(whole, list):
            return list(enumerate(whole))
    lines = []
    for number, line in enumerate(text.splitlines()):
        line = line.strip()
        if line.startswith("data:"):  # a saved server-sent event stream
            line = line[len("data:") :].strip()
            if line == "[DONE]":
                continue
        if not line:
            continue
        try:
            lines.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            if not skip_bad_lines:
                raise ValueError(
                    f"{path}:{number + 1}: invalid JSON ({err.msg}); pass --skip-bad-lines "
                    "(skip_bad_lines=True) to skip unreadable lines and count them"
                ) from None
            counts.bad_lines_skipped += 1
    return lines


def read_logprob_records(
    path: str | os.PathLike, *, skip_bad_lines: bool = False
) -> LogprobRecords:
    """Reads engines' top-``K`` log-probability records into exact top-``K`` windows.

    Args:
      path: a JSON Lines file (one response per line) or one JSON document (a response, or
        an array of them); the spellings in the module docstring.
      skip_bad_lines: skip lines that are no JSON (counted) instead of raising.

    Returns:
      :class:`LogprobRecords`: the index, ``[N, K]`` float64 windows (natural log,
      decreasing, ``-inf`` padded) and what was dropped (module docstring).

    Raises:
      ValueError: a missing file, unreadable JSON (unless skipped), an unrecognised
        record, or an inconsistent entry, naming the line; no position with a window.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"records file not found: {path}")
    counts = RecordCounts()
    return _read(_documents(path, skip_bad_lines, counts), str(path), counts)


def parse_logprob_records(documents: Iterable[Any]) -> LogprobRecords:
    """:func:`read_logprob_records` of records already parsed (e.g. response dicts from an
    engine's client), record ``i`` being the ``i``-th document. Raises as it does."""
    return _read(enumerate(documents), "record", RecordCounts())


def _read(lines: Iterable[tuple[int, Any]], label: str, counts: RecordCounts) -> LogprobRecords:
    rows: list[list[float]] = []
    index: dict[str, list[int]] = {"record": [], "choice": [], "position": []}
    stream: tuple | None = None  # (id, first line, {choice: positions so far}) of a stream
    for number, record in lines:
        try:
            sequences = _sequences(record)
            first, offsets = number, {}
            if isinstance(record, dict) and _is_chunk(record) and record.get("id") is not None:
                if stream is not None and stream[0] == record["id"]:
                    _, first, offsets = stream
                stream = (record["id"], first, offsets)
            else:
                stream = None
            for c, positions in enumerate(sequences):
                start = offsets.get(c, 0)
                for t, (entries, sampled) in enumerate(positions, start):
                    window = top_window(entries, sampled, counts)
                    if window is None:
                        continue
                    rows.append(window)
                    index["record"].append(first)
                    index["choice"].append(c)
                    index["position"].append(t)
                offsets[c] = start + len(positions)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"{label}:{number + 1}: {err}") from None
    if not rows:
        raise ValueError(
            f"{label}: no positions with top log-probabilities "
            f"({counted(counts.missing_positions, 'position')} without any)"
        )
    counts.positions = len(rows)
    width = max(len(r) for r in rows)
    logprobs = np.full((len(rows), width), -np.inf)
    for i, r in enumerate(rows):
        logprobs[i, : len(r)] = r
    columns: dict[str, np.ndarray] = {
        "record": np.asarray(index["record"], np.int64),
        "choice": np.asarray(index["choice"], np.int32),
        "position": np.asarray(index["position"], np.int32),
    }
    return LogprobRecords(columns, logprobs, counts)
