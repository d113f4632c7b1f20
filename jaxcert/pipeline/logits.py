"""Certificates of logits computed elsewhere: dense dumps and top-``K`` log-probability records.

Two inputs, one table (one row per position):

* **Dense logits** ``[N, V]`` or ``[B, T, V]`` (float32, bfloat16 or float16), e.g. from
  ``.npy`` / ``.safetensors`` dumps or transformers' ``generate(output_logits=True)``:
  every certificate is exact (the full-vocabulary solver), streamed in fixed chunks of
  rows (:func:`certify_dense`, :func:`iter_dense_file`).
* **Top-K log-probabilities**, as returned by serving engines (vLLM, SGLang, TGI,
  llama.cpp's server; the OpenAI-compatible ``logprobs.content[i].top_logprobs[j].logprob``):
  :func:`certify_top_logprobs`.

**When the top ``K`` determine a certificate.** By ``docs/certificates.md`` §§4-5 and 9 the
certificate depends only on the pool ``P ⊆ U ∪ T*``: the accepted set ``U`` (a prefix of the tokens
sorted by ``p``) and ``T*``, the next ``m`` tokens. The window of the ``K`` largest
probabilities therefore determines ``C_p`` exactly iff it holds ``U`` and ``T*``:

* strict greedy, ``topk:k`` and ``tree:m``: ``|U|`` is fixed (1, ``k``, 1), so the window
  must reach ``|U| + m`` tokens: ``K >= 2``, ``K >= k + 1``, ``K >= m + 1``;
* additive / multiplicative (and tree over them): ``U`` is a threshold set; it is known
  once the window holds a token below the threshold (every token outside the window is
  then below it too), and ``T*`` once the window holds ``|U| + m`` tokens;
  (when ``p(x0) <= t`` every token is in ``U`` and ``C_p = +inf`` whatever the tail);
* typical: the threshold ``min(eps, delta e^{-H})`` needs the entropy ``H``. From the
  window alone ``H`` lies in ``[H_lo, H_hi]``: the unseen mass ``r = 1 - sum_window p``
  sits on at most ``V - K`` tokens each at most ``p_K`` (the smallest seen), so
  ``H_hi = H_window + r log((V - K) / r)`` (spread evenly) and ``H_lo = H_window +
  n p_K log(1/p_K) + s log(1/s)`` with ``n = floor(r / p_K)``, ``s = r - n p_K``
  (packed at ``p_K``; ``-x log x`` is concave, so the extreme points of the polytope
  give the extremes). The certificate is determined when ``U`` is the same at both ends
  (and the window reaches ``|U| + m``); this needs the vocabulary size ``V``.

Elsewhere the value is ``nan`` and ``determined`` is ``False``: the engine's top-``K``
is too short for that rule at that position (a longer ``top_logprobs`` helps).
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxcert.base.folders import atomic_file
from jaxcert.core import rules as rules_lib
from jaxcert.core import solver
from jaxcert.core import stats as stats_lib
from jaxcert.pipeline import drafter as drafter_lib
from jaxcert.pipeline.records import LOGPROB_TOLERANCE, read_logprob_records
from jaxcert.pipeline.report import rule_column

__all__ = [
    "CERTIFICATES",
    "PARTIAL",
    "certify_dense",
    "certify_dense_file",
    "certify_records",
    "certify_top_logprobs",
    "check_drafter_dump",
    "check_output",
    "dense_shape",
    "determined_column",
    "entropy_bounds",
    "iter_dense_file",
    "read_logprob_records",
    "row_list",
    "row_name",
    "stack_generate_logits",
    "summary_markdown",
    "summary_notes",
    "write_certificates",
]


def determined_column(rule) -> str:
    """Column name of whether a record's certificate is determined, e.g.
    ``determined_tree:4``."""
    return f"determined_{rule.spec}"


# ---------------------------------------------------------------------------------------------
# Dense logits


@jax.jit
def _dense_stats(x):
    st = stats_lib.distribution_stats(x, top=10)
    return st.greedy_token, st.top1, st.top_coverage, st.margin, st.entropy


def certify_dense(logits, rules: Sequence, *, drafter_logits=None) -> dict[str, np.ndarray]:
    """Exact certificates and statistics of dense logits (one chunk).

    Args:
      logits: ``[N, V]`` float32/bfloat16/float16 logits (or log-probabilities) of the
        target ``p``; ``-inf`` is a zero-probability token.
      rules: the rules.
      drafter_logits: ``[N, V]`` logits of a drafter ``q`` at the same positions, or ``None``.

    Returns:
      Columns ``valid`` (bool), ``token`` (``x0``), ``top1``, ``top10_coverage``,
      ``margin``, ``entropy`` (nats) and ``cert_<rule>`` (nats; ``inf`` where rejection is
      impossible), each ``[N]``. A row holding NaN or ``+inf``, or no finite logit, is no
      distribution: ``valid`` is ``False`` and its statistics and certificates are ``nan``
      (``token`` ``-1``); the other rows are unaffected. With ``drafter_logits`` also
      ``kl``, ``tv``, ``drafter_token``, ``certified_<rule>`` and ``accepted_<rule>``
      (:func:`jaxcert.pipeline.drafter.drafter_columns`); where the target's or the
      drafter's row is no distribution, ``kl`` and ``tv`` are ``nan``, ``drafter_token``
      is ``-1`` and certified and accepted are ``False``.

    Raises:
      ValueError: not ``[N, V]`` floating point with ``N >= 1``, ``V >= 2``; drafter
        logits of another shape (another vocabulary) or dtype kind.
    """
    x = jnp.asarray(logits)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"dense logits must be floating [N, V], got {x.shape} {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] < 2:
        raise ValueError(f"dense logits need N >= 1 rows and V >= 2 tokens, got {x.shape}")
    certs = solver.certificates(x, tuple(rules))
    drafted = None
    if drafter_logits is not None:
        d = jnp.asarray(drafter_logits)
        if d.shape != x.shape or not jnp.issubdtype(d.dtype, jnp.floating):
            raise ValueError(
                f"drafter logits must be floating and of the target's shape {x.shape}, got "
                f"{d.shape} {d.dtype}"
            )
        values = jnp.stack([c.value for c in certs], axis=-1)
        drafted = drafter_lib.drafter_columns(
            drafter_lib.drafter_terms(d, x, tuple(rules), values), rules
        )
    token, top1, cover, margin, entropy = jax.device_get(_dense_stats(x))
    valid = np.asarray(certs[0].valid)

    def masked(a):
        return np.where(valid, np.asarray(a, np.float64), np.nan).astype(np.float32)

    out = {"valid": valid, "token": np.where(valid, token, -1).astype(np.int32),
           "top1": masked(top1), "top10_coverage": masked(cover), "margin": masked(margin),
           "entropy": masked(entropy)}  # fmt: skip
    for rule, cert in zip(rules, certs, strict=True):
        out[rule_column(rule)] = masked(cert.value)
    if drafted is not None:
        # drafter_columns leaves nothing where KL is nan; nor is anything left where the
        # target's row is no distribution
        for name, column in drafted.items():
            empty = {np.dtype(bool): False, np.dtype(np.int32): -1}.get(column.dtype, np.nan)
            out[name] = np.where(valid, column, empty).astype(column.dtype)
    return out


def stack_generate_logits(scores) -> np.ndarray:
    """transformers' ``generate(..., output_logits=True).logits`` (a tuple of ``T`` arrays
    ``[B, V]``, torch or NumPy) as one ``[B, T, V]`` float32 NumPy array."""

    def host(t):
        if hasattr(t, "detach"):  # a torch tensor (bfloat16 has no NumPy twin: go via float)
            t = t.detach().float().cpu().numpy()
        return np.asarray(t, np.float32)

    return np.stack([host(t) for t in scores], axis=1)


def _open_dense(path: pathlib.Path, tensor: str | None):
    """A ``[B, T, V]`` or ``[N, V]`` array-like (memory-mapped / lazily sliced) of a dump."""
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, EOFError, OSError) as err:
            if "allow_pickle" in str(err):  # numpy's word for a header it cannot parse
                raise ValueError(f"{path}: not a .npy array of numbers") from None
            raise ValueError(f"{path}: not a readable .npy array ({err})") from None
        if array.dtype == np.dtype("V2"):  # ml_dtypes.bfloat16 saved by np.save
            import ml_dtypes

            array = array.view(ml_dtypes.bfloat16)
        return array, tuple(array.shape)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            f = safe_open(path, framework="numpy")
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
        names = list(f.keys())
        if tensor is None:
            if len(names) != 1 and "logits" not in names:
                raise ValueError(
                    f"{path} holds {len(names)} tensors {names[:8]}: name one with --tensor"
                )
            tensor = "logits" if "logits" in names else names[0]
        if tensor not in names:
            raise ValueError(f"{path} has no tensor {tensor!r} (it has {names[:8]})")
        sliced = f.get_slice(tensor)
        return sliced, tuple(sliced.get_shape())
    raise ValueError(f"{path}: dense logits must be a .npy or .safetensors file")


def _checked_dense(path: pathlib.Path, tensor: str | None):
    """:func:`_open_dense` of an existing file whose shape is ``[N, V]`` or ``[B, T, V]``."""
    if not path.is_file():
        raise ValueError(f"logits file not found: {path}")
    array, shape = _open_dense(path, tensor)
    if len(shape) not in (2, 3) or shape[-1] < 2:
        raise ValueError(f"{path}: logits must be [N, V] or [B, T, V] with V >= 2, got {shape}")
    if 0 in shape:
        raise ValueError(f"{path}: no positions (shape {shape})")
    return array, shape


def dense_shape(path: str | os.PathLike, *, tensor: str | None = None) -> tuple[int, ...]:
    """The shape of a dense dump, ``(N, V)`` or ``(B, T, V)``, read from its header.

    Raises:
      ValueError: a missing file, another suffix, an unreadable file, a missing tensor,
        another rank or no positions (as :func:`iter_dense_file`).
    """
    return _checked_dense(pathlib.Path(path), tensor)[1]


def check_drafter_dump(target, drafter, *, tensor: str | None = None) -> None:
    """Refuses a drafter's dense dump that does not hold the target's positions over the
    target's vocabulary (both read from their headers).

    Args:
      target, drafter: ``.npy`` / ``.safetensors`` dumps of the target's and the drafter's
        logits (``tensor``: the tensor's name in each ``.safetensors`` file).

    Raises:
      ValueError: as :func:`dense_shape` for either file; the last axes differ (a
        vocabulary mismatch), or the positions do.
    """
    t_shape = dense_shape(target, tensor=tensor)
    d_shape = dense_shape(drafter, tensor=tensor)
    if t_shape[-1] != d_shape[-1]:
        raise ValueError(
            f"vocabulary mismatch: the target's logits {target} have V = {t_shape[-1]}, the "
            f"drafter's {drafter} V = {d_shape[-1]}; a drafter must share the vocabulary"
        )
    if t_shape != d_shape:
        raise ValueError(
            f"the drafter's logits {drafter} have shape {d_shape}, the target's {target} "
            f"{t_shape}; they must hold the same positions"
        )


def iter_dense_file(
    path: str | os.PathLike,
    *,
    chunk_rows: int = 64,
    tensor: str | None = None,
    vocab_size: int | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Streams a dense dump in chunks of at most ``chunk_rows`` rows (memory: one chunk).

    Args:
      path: a ``.npy`` or ``.safetensors`` file holding ``[N, V]`` or ``[B, T, V]`` logits.
      chunk_rows: rows per chunk.
      tensor: the tensor's name in a ``.safetensors`` file holding several.
      vocab_size: ``V`` when known: the last axis must have it (a transposed ``[V, N]``
        dump is refused instead of certified as ``V`` positions of ``N`` tokens).

    Yields:
      ``(index, logits)``: index columns (``sequence`` and ``position`` for ``[B, T, V]``,
      ``row`` for ``[N, V]``) and the chunk's ``[n, V]`` logits in their stored dtype.

    Raises:
      ValueError: another suffix, an unreadable file, a missing tensor, another rank, a
        last axis other than ``vocab_size``, or a non-floating dtype.
    """
    path = pathlib.Path(path)
    array, shape = _checked_dense(path, tensor)
    if vocab_size is not None and shape[-1] != vocab_size:
        hint = (
            f"; its axis {shape.index(vocab_size)} has {vocab_size} entries: the dump looks "
            "transposed (save it as [N, V] or [B, T, V], vocabulary last)"
            if vocab_size in shape
            else ""
        )
        raise ValueError(
            f"{path}: the last axis has {shape[-1]} entries but --vocab-size is {vocab_size} "
            f"(shape {shape}){hint}"
        )
    if len(shape) == 2:
        for start in range(0, shape[0], chunk_rows):
            stop = min(shape[0], start + chunk_rows)
            rows = np.arange(start, stop, dtype=np.int64)
            yield {"row": rows}, _floating(array[start:stop], path)
        return
    b, t, _ = shape
    for seq in range(b):
        for start in range(0, t, chunk_rows):
            stop = min(t, start + chunk_rows)
            index = {
                "sequence": np.full(stop - start, seq, np.int64),
                "position": np.arange(start, stop, dtype=np.int32),
            }
            yield index, _floating(array[seq : seq + 1, start:stop][0], path)


def _floating(chunk, path) -> np.ndarray:
    chunk = np.asarray(chunk)
    if not (np.issubdtype(chunk.dtype, np.floating) or chunk.dtype.name == "bfloat16"):
        raise ValueError(f"{path}: logits must be floating point, got {chunk.dtype}")
    if not chunk.dtype.isnative:  # e.g. a big-endian '>f4' dump: JAX takes native order only
        chunk = chunk.astype(chunk.dtype.newbyteorder("="))
    return chunk


# ---------------------------------------------------------------------------------------------
# Top-K log-probabilities


def entropy_bounds(top_p: np.ndarray, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on ``H(p)`` (nats) from the ``K`` largest probabilities of each row.

    Args:
      top_p: ``[N, K]`` probabilities (``0`` marks a missing entry), any order.
      vocab_size: ``V``; ``None``: unknown (the upper bound is ``inf``).

    Returns:
      ``(lower, upper)``, each ``[N]``: ``H`` of every distribution on ``V`` tokens whose
      ``K`` largest probabilities are these lies in ``[lower, upper]`` (module docstring).
    """
    top_p = np.asarray(top_p, np.float64)
    seen = top_p > 0
    k = seen.sum(-1)
    safe = np.where(seen, top_p, 1.0)
    h_window = -np.sum(np.where(seen, top_p * np.log(safe), 0.0), -1)
    rest = np.clip(1.0 - np.sum(top_p, -1), 0.0, None)
    p_min = np.where(seen, top_p, np.inf).min(-1)
    p_min = np.where(np.isfinite(p_min), p_min, 1.0)
    full = np.floor(rest / p_min)
    part = rest - full * p_min

    def xlogx(x):
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)

    lower = h_window - full * xlogx(p_min) - xlogx(part)
    if vocab_size is None:
        upper = np.full_like(lower, np.inf)
    else:
        n = np.maximum(vocab_size - k, 1)
        upper = h_window + np.where(rest > 0, rest * np.log(n / np.where(rest > 0, rest, 1.0)), 0)
    return lower, np.maximum(upper, lower)


def _window_values(top_x, entropy, rule, vocab: int) -> np.ndarray:
    """:func:`jaxcert.core.solver.window_certificate` with the rows padded to a power of two
    (>= 8), so that files of different lengths share compiled programs."""
    n = top_x.shape[0]
    rows = max(8, 1 << max(0, n - 1).bit_length())
    pad = jnp.zeros((rows - n, top_x.shape[1]), top_x.dtype).at[:, 1:].set(-jnp.inf)
    value = solver.window_certificate(
        jnp.concatenate([top_x, pad]),
        rule,
        vocab_size=vocab,
        entropy=jnp.asarray(np.r_[entropy, np.zeros(rows - n)], jnp.float32),
    )
    return np.asarray(value, np.float64)[:n]


def _windows(logprobs, vocab_size):
    """The top-``K`` windows checked and sorted: ``(x, k, p)``, the log-probabilities
    (decreasing, missing entries ``-inf`` last, clipped at 0), the entries per row and the
    probabilities. Raises ``ValueError`` as :func:`certify_top_logprobs`."""
    x = np.asarray(logprobs, np.float64)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"top log-probabilities must be [N, K], got shape {x.shape}")
    x = np.where(np.isnan(x), -np.inf, x)
    x = -np.sort(-x, axis=-1)  # decreasing; missing entries (-inf) last
    k = np.sum(np.isfinite(x), -1)
    if x.shape[0] and k.min() < 1:
        raise ValueError(f"row {int(np.argmin(k))} has no log-probability")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
            raise ValueError(f"vocab_size must be an integer, got {vocab_size!r}")
        if x.shape[0] and not int(k.max()) <= vocab_size < 2**31:
            raise ValueError(
                f"vocab_size={vocab_size} is below the {int(k.max())} log-probabilities of a "
                "row (or above 2**31)"
            )
    raw = np.exp(x)
    x = np.minimum(x, 0.0)
    bad = (raw[:, 0] > np.exp(LOGPROB_TOLERANCE)) | (raw.sum(-1) > 1 + LOGPROB_TOLERANCE)
    if bad.any():
        raise ValueError(
            f"row {int(np.flatnonzero(bad)[0])}: these are not log-probabilities (a value "
            "above 0 or a total probability above 1); pass the engine's logprobs, not logits"
        )
    return x, k, np.exp(x)


def _rule_window(rule, top_x, k, h_lo, h_hi, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``(value, determined)`` of one rule over the windows (``value`` is ``nan`` where
    the window does not determine it)."""
    m = rule.list_size
    log_p_max = top_x[:, 0]
    if rule.static_upper_size is not None:
        size = min(rule.static_upper_size, vocab)
        determined = (size + m <= k) | (k >= vocab)
        value = _window_values(top_x, np.zeros(len(k), np.float32), rule, vocab)
        return np.where(determined, value, np.nan), np.asarray(determined, bool)
    positions = np.arange(top_x.shape[1])
    counts = []
    for h in (h_lo, h_hi) if rule.needs_entropy else (h_lo,):
        member = rules_lib.in_upper_set(
            rule, top_x - log_p_max[:, None], log_p_max[:, None],
            jnp.asarray(h, jnp.float32)[:, None],
        )  # fmt: skip
        member = np.asarray(member) & (positions[None, :] < k[:, None])
        counts.append(member.sum(-1))
    upper_lo, upper_hi = counts[0], counts[-1]
    determined = (upper_lo == upper_hi) & ((upper_lo + m <= k) | (k >= vocab))
    # A threshold at or below 0 (additive with p(x0) <= t) puts every token in U:
    # rejection is impossible whatever the tail holds.
    everything = np.asarray(
        rules_lib.in_upper_set(rule, -jnp.inf, log_p_max, jnp.asarray(h_hi, jnp.float32))
    )
    determined = determined | everything
    value = np.where(everything, np.inf, _window_values(top_x, h_lo, rule, vocab))
    return np.where(determined, value, np.nan), np.asarray(determined, bool)


def certify_top_logprobs(
    logprobs, rules: Sequence, *, vocab_size: int | None = None
) -> dict[str, np.ndarray]:
    """Certificates from each position's top-``K`` log-probabilities, where determined.

    Args:
      logprobs: ``[N, K]`` natural-log probabilities of the ``K`` most probable tokens of
        each position (any order; ``-inf`` or NaN marks a missing entry when rows have fewer).
        They must be normalised over the full vocabulary, as engines return them.
      rules: the rules.
      vocab_size: ``V``, the model's vocabulary size (needed to determine ``typical``).

    Returns:
      Columns, each ``[N]``: ``k`` (entries seen), ``top1``, ``margin`` (``nan`` with one
      entry), ``window_mass`` (total probability seen), ``entropy_lower`` /
      ``entropy_upper`` (nats), and per rule ``cert_<rule>`` (nats; ``nan`` where not
      determined) and ``determined_<rule>`` (bool).

    Raises:
      ValueError: not ``[N, K]``, a row without entries, or values that are not
        log-probabilities (above 0, or summing past 1), naming the row.
    """
    x, k, p = _windows(logprobs, vocab_size)
    h_lo, h_hi = entropy_bounds(p, vocab_size)
    vocab = vocab_size if vocab_size is not None else 2**30
    window = x.shape[1]
    out = {
        "k": k.astype(np.int32),
        "top1": p[:, 0],
        "margin": (p[:, 0] - p[:, 1]) if window > 1 else np.full(len(x), np.nan),
        "window_mass": p.sum(-1),
        "entropy_lower": h_lo,
        "entropy_upper": h_hi,
    }
    if window > 1:
        out["margin"] = np.where(k > 1, out["margin"], np.nan)
    top_x = jnp.asarray(x, jnp.float32)
    for rule in rules:
        value, determined = _rule_window(rule, top_x, k, h_lo, h_hi, vocab)
        out[rule_column(rule)] = value
        out[determined_column(rule)] = determined
    return out


# ---------------------------------------------------------------------------------------------
# ``jaxcert certify-logits``: a file in, certificates.parquet and its summary out

CERTIFICATES = "certificates.parquet"
PARTIAL = "certificates.partial.parquet"


def check_output(out: pathlib.Path, *, overwrite: bool) -> pathlib.Path:
    """``out/certificates.parquet``, once ``out`` may receive it (before any work).

    Raises:
      ValueError: ``out`` is a file, or it holds certificates and not ``overwrite``.
    """
    out = pathlib.Path(out)
    target = out / CERTIFICATES
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if target.exists() and not overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it or choose another --out")
    return target


def certify_dense_file(path, rules: Sequence, *, drafter=None, **kwargs) -> Iterator[pa.Table]:
    """Certified chunks of a dense dump, streamed: :func:`iter_dense_file` (``kwargs``:
    ``chunk_rows``, ``tensor``, ``vocab_size``) through :func:`certify_dense`, each chunk a
    table of its index columns and the certificate columns.

    With ``drafter``, a dump of a drafter's logits at the same positions (checked first
    by :func:`check_drafter_dump`), streamed beside it: each chunk also has the drafter's
    columns (:func:`certify_dense`'s ``drafter_logits``).

    Raises:
      ValueError: as :func:`iter_dense_file` and :func:`check_drafter_dump` (before the
        first chunk is read).
    """
    if drafter is None:
        for index, logits in iter_dense_file(path, **kwargs):
            yield pa.table({**index, **certify_dense(logits, rules)})
        return
    check_drafter_dump(path, drafter, tensor=kwargs.get("tensor"))
    chunks = zip(iter_dense_file(path, **kwargs), iter_dense_file(drafter, **kwargs), strict=True)
    for (index, logits), (_, drafter_logits) in chunks:
        yield pa.table({**index, **certify_dense(logits, rules, drafter_logits=drafter_logits)})


def certify_records(
    path, rules: Sequence, *, vocab_size: int | None = None, skip_bad_lines: bool = False
) -> tuple[pa.Table, dict]:
    """Certificates of a file of engine responses (:func:`read_logprob_records`).

    Returns:
      ``(table, counts)``: the records' index and :func:`certify_top_logprobs` columns, and
      what reading counted (``RecordCounts.as_dict``).

    Raises:
      ValueError: as :func:`read_logprob_records` and :func:`certify_top_logprobs`, a bad
        window named by its line, choice and position in ``path``.
    """
    records = read_logprob_records(path, skip_bad_lines=skip_bad_lines)
    try:
        columns = certify_top_logprobs(records.logprobs, rules, vocab_size=vocab_size)
    except ValueError as err:  # "row N: ..." names a window: name the record's line instead
        found = re.match(r"row (\d+)(.*)", str(err), re.S)
        if found is None:
            raise
        i, index = int(found.group(1)), records.index
        raise ValueError(
            f"{path}:{index['record'][i] + 1} (choice {index['choice'][i]}, position "
            f"{index['position'][i]}){found.group(2)}"
        ) from None
    return pa.table({**records.index, **columns}), records.counts.as_dict()


def write_certificates(out: pathlib.Path, tables, *, kept=None) -> list[str]:
    """Writes the tables into ``out/certificates.parquet`` atomically (a hidden temporary
    file, then a rename; an earlier failure's ``certificates.partial.parquet`` goes).

    Args:
      out: the output folder (created at the first table).
      tables: the certified tables (a stream).
      kept: on a failure, called with ``(rows, path)`` once what was certified is kept in
        ``certificates.partial.parquet`` (nothing is kept without rows).

    Returns:
      The names of the rows that are no distribution (``valid`` false), as
      ``"row N"`` or ``"(sequence B, position T)"``.
    """
    out = pathlib.Path(out)
    tables = iter(tables)
    first = next(tables, None)  # the folder is created only once there is a table
    if first is None:  # the readers raise on an empty input before any table
        raise ValueError("no certificates to write: no tables")
    out.mkdir(parents=True, exist_ok=True)
    rows, invalid = 0, []
    try:
        with (
            atomic_file(out / CERTIFICATES, fsync=False, keep_on_error=out / PARTIAL) as tmp,
            pq.ParquetWriter(tmp, first.schema) as writer,
        ):
            for table in itertools.chain([first], tables):
                writer.write_table(table)
                if "valid" in table.column_names:
                    bad = np.flatnonzero(~table["valid"].to_numpy(zero_copy_only=False))
                    invalid += [row_name(table, int(i)) for i in bad]
                rows += table.num_rows
    except BaseException:
        if rows and kept is not None:  # what was certified is in the partial file
            kept(rows, out / PARTIAL)
        raise
    (out / PARTIAL).unlink(missing_ok=True)  # an earlier failed run's rows are superseded
    return invalid


def row_name(table: pa.Table, i: int) -> str:
    """Row ``i`` of a certificates table as the input named it: ``(sequence s, position
    t)`` for a ``[B, T, V]`` dump, ``row i`` for ``[N, V]``."""
    if "sequence" in table.column_names:
        return f"(sequence {table['sequence'][i].as_py()}, position {table['position'][i].as_py()})"
    return f"row {table['row'][i].as_py()}"


def row_list(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` names, comma-separated (``...`` when there are more)."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


_COUNT_NOTES = {
    "missing_positions": "positions without log-probabilities (null or empty lists), skipped",
    "duplicates_removed": "duplicated entries removed",
    "sampled_dropped": "sampled tokens left out of the window (possibly appended below the "
    "true top N)",
    "sentinel_entries": "sentinel entries (logprob <= -9999) left out",
    "bad_lines_skipped": "unreadable lines skipped",
}


def summary_notes(*, invalid: Sequence[str] = (), counts: dict | None = None) -> list[str]:
    """The summary's notes: the dense rows that are no distribution (``invalid``, from
    :func:`write_certificates`) and what reading records counted (``counts``)."""
    counts = counts or {}
    notes = [f"{_COUNT_NOTES[k]}: {v}" for k, v in counts.items() if k in _COUNT_NOTES and v]
    if invalid:
        notes.append(
            "rows that are no distribution (NaN or +inf logits, or none finite; valid = "
            f"false, certificates nan): {len(invalid)}: {row_list(invalid)}"
        )
    return notes


def summary_markdown(
    table: pa.Table,
    rules: Sequence,
    *,
    name: str,
    dense: bool,
    notes: Sequence[str],
    vocab_given: bool,
) -> str:
    """``summary.md`` of a certify-logits run: the notes, for records the share of
    positions each rule's certificate is determined at (and what would determine the
    rest), then :func:`jaxcert.pipeline.report.summarize_positions` of the certificates
    (and of a drafter's ``kl`` and ``tv`` where the table has them)."""
    from jaxcert.pipeline import report

    text = f"## Positions: {table.num_rows} ({name})\n\n"
    if notes:
        text += "".join(f"- {n}\n" for n in notes) + "\n"
    if not dense:
        k = table["k"].to_numpy()
        shares, hints = [], []
        for r in rules:
            det = table[determined_column(r)].to_numpy(zero_copy_only=False)
            shares.append(f"{r.spec} {np.mean(det):.1%}")
            if not det.all():
                hints.append(f"- {r.spec}: {_needed_k(r, vocab_given)}")
        text += f"Determined by the top-K window (share of positions): {', '.join(shares)}\n\n"
        text += f"Entries per position: K = {k.min()} to {k.max()} (median {np.median(k):g}).\n\n"
        if hints:
            text += "Where a certificate is not determined:\n\n" + "\n".join(hints) + "\n\n"
        text += "Statistics over the determined positions:\n\n"
    drafted = ["kl", "tv"] if "kl" in table.column_names else []  # a drafter's too
    summary = report.summarize_positions(table, [rule_column(r) for r in rules] + drafted)
    return text + report.markdown_table(summary, blank_none=True) + "\n"


def _needed_k(rule, vocab_given: bool) -> str:
    """What top-list length determines ``rule`` (``docs/certificates.md`` §9)."""
    if rule.static_upper_size is not None:
        need = rule.static_upper_size + rule.list_size
        return f"needs K >= {need} entries per position (request top_logprobs >= {need})"
    return (
        f"needs the window to reach a token below the rule's threshold and |U| + "
        f"{rule.list_size} tokens: request a longer top_logprobs"
        + (" and pass --vocab-size" if rule.needs_entropy and not vocab_given else "")
    )
