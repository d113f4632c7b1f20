"""``jaxcert certify``: certificates of every rule at every greedy decoding position.

Data flow: prompts -> tokenizer + chat template -> batched prefill of the target ->
jitted greedy loop (``lax.scan`` in chunks, one host round-trip per chunk for the
progress bar) that, at every step, computes the target's statistics and the exact
certificate of every rule from the full-vocabulary logits, then appends the greedy
token -> a table of positions.

On a mesh (:mod:`jaxcert.mesh`) the rows of each batch are split over the ``data`` axis and
the weights over ``model``. With ``model = 1`` each row's numbers are those of a one-device
run with as many rows per batch as each device holds (bit for bit). With ``part`` a
process certifies only its share of the prompts (the same padded width as the whole run, so
the same compiled programs and numbers) and :func:`merge_parts` joins the shares.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcert import mesh as mesh_lib
from jaxcert import models
from jaxcert import stats as stats_lib
from jaxcert._validate import check_int, round_up
from jaxcert.prompts import Prompt, encode_prompts, pad_prompts
from jaxcert.solver import certificates

__all__ = ["CertifyOptions", "certify_prompts", "merge_parts", "rule_column"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CertifyOptions:
    """Options of a certification run.

    Attributes:
      steps: greedy continuation length per prompt, in tokens.
      batch_size: prompts decoded together.
      min_prompt_tokens: prompts shorter than this (after the chat template) are skipped.
      stop_at_eos: stop recording a prompt after it emits an end-of-turn token.
      chunk: decoding steps per jitted call (the progress bar moves once per chunk).
      top: ``k`` of the recorded top-``k`` coverage.
      chat: apply the tokenizer's chat template.
      system_prompt: explicit system message (``None``: the template's default).
    """

    steps: int = 128
    batch_size: int = 8
    min_prompt_tokens: int = 0
    stop_at_eos: bool = True
    chunk: int = 16
    top: int = 10
    chat: bool = True
    system_prompt: str | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "chunk", "top"):
            check_int(name, getattr(self, name))
        check_int("min_prompt_tokens", self.min_prompt_tokens, 0)


def rule_column(rule) -> str:
    """Column name of a rule's certificate, e.g. ``cert_tree:4``."""
    return f"cert_{rule.spec}"


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8), donate_argnums=(2,))
def _decode_chunk(graphdef, state, cache, logits, active, rules, steps, top, eos):
    """``steps`` greedy steps; records statistics and certificates of each position."""
    eos = jnp.asarray(eos, jnp.int32)

    def step(carry, _):
        cache, logits, active = carry
        st = stats_lib.distribution_stats(logits, top=top)
        certs = certificates(logits, rules)
        record = (st, tuple(c.value for c in certs), active)
        token = st.greedy_token
        new_logits, cache = models.decode_step(graphdef, state, token, cache, active)
        active = active & ~jnp.isin(token, eos)
        return (cache, new_logits, active), record

    (cache, logits, active), records = lax.scan(step, (cache, logits, active), None, length=steps)
    return cache, logits, active, records


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, tokens, lengths, cache):
    logits, cache = models.forward(graphdef, state, tokens, cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, cache.commit(lengths)


def _batches(order: list[int], size: int):
    for start in range(0, len(order), size):
        yield order[start : start + size]


def _text(value) -> str | None:
    return None if value is None else str(value)


def certify_prompts(
    lm,
    prompts: Sequence[Prompt],
    rules: Sequence,
    options: CertifyOptions = CertifyOptions(),
    *,
    mesh: jax.sharding.Mesh | None = None,
    part: tuple[int, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_batch: Callable[[pa.Table], None] | None = None,
) -> tuple[pa.Table, dict]:
    """Greedy-decodes every prompt and certifies every position under every rule.

    Args:
      lm: a ``models.LoadedModel`` (the target).
      prompts: the prompts.
      rules: the verification rules (``jaxcert.rules``).
      options: a :class:`CertifyOptions`.
      mesh: a ``("data", "model")`` mesh (:func:`jaxcert.mesh.make_mesh`): each batch is
        split over ``data`` (the batch size rounded up to a multiple of its size), the
        weights over ``model`` (``jaxcert.models.shard``; tensor parallelism). ``None``:
        JAX's default device.
      part: ``(index, count)``: certify only share ``index`` of ``count`` (the prompts,
        sorted by length, dealt round-robin) and keep a ``prompt_order`` column (the
        prompt's index in ``prompts``) for :func:`merge_parts`.
      progress: called as ``progress(done_steps, total_steps)`` after every chunk.
      on_batch: called with each finished batch's table (so a caller can save partial
        results before a later batch fails).

    Returns:
      ``(table, info)``: one row per recorded position with columns ``prompt_id``,
      ``category``, ``prompt_tokens``, ``position``, ``token``, ``top1``,
      ``top{k}_coverage``, ``margin``, ``entropy`` and one ``cert_<rule>`` column per rule
      (nats, ``inf`` where rejection is impossible); ``info`` has counts and timings.

    Raises:
      ValueError: no prompt is long enough, no rules, prompts plus steps exceed the
        model's context length, mesh axes other than data/model, or more parts than
        prompts.
    """
    rules = tuple(rules)
    if not rules:
        raise ValueError("no rules given")
    encoded = encode_prompts(
        lm.tokenizer, prompts, chat=options.chat, system_prompt=options.system_prompt
    )
    keep = [i for i, ids in enumerate(encoded) if len(ids) >= max(1, options.min_prompt_tokens)]
    if not keep:
        raise ValueError(
            f"no prompt has at least {options.min_prompt_tokens} tokens "
            f"(lengths: {sorted(len(e) for e in encoded)[:10]}...)"
        )
    # Batch prompts of similar length together: less padding in the prefill.
    order = sorted(keep, key=lambda i: len(encoded[i]))
    # One prompt width and one cache size for every batch (the last batch is padded with
    # copies of a prompt whose rows are dropped), so each jitted function compiles once;
    # taken over all prompts, so every part of a multi-process run has the same shapes.
    width = round_up(max(len(encoded[i]) for i in order), 16)
    data = 1 if mesh is None else mesh_lib.data_size(mesh)
    batch_size = round_up(options.batch_size, data)
    # Rows per batch (a multiple of the data axis), also from all prompts: a part then
    # computes each row with the same shapes, hence the same numbers, as a one-process run.
    rows = round_up(min(batch_size, len(order)), data)
    if part is not None:
        index, count = part
        check_int("part count", count)
        if not 0 <= index < count:
            raise ValueError(f"part index must be in [0, {count}), got {index}")
        if count > len(order):
            raise ValueError(
                f"{count} processes for {len(order)} prompts: each process needs a prompt"
            )
        order = order[index::count]
    eos = lm.eos_ids or (-1,)  # -1: no token ends a row
    chunks = math.ceil(options.steps / options.chunk)
    total = math.ceil(len(order) / batch_size) * chunks * options.chunk
    done = 0
    tables = []
    timings = {"prefill_s": 0.0, "decode_s": 0.0}
    cache_length = width + chunks * options.chunk + 1
    if cache_length > lm.config.max_position_embeddings:
        raise ValueError(
            f"prompts of up to {width} tokens plus {options.steps} steps need {cache_length} "
            f"positions; the model supports {lm.config.max_position_embeddings}"
        )
    # The weights split over "model" (a model loaded onto this mesh stays where it is); the
    # forward pass keeps the rows of activations and cache on "data".
    graphdef, state = nnx.split(mesh_lib.shard_model(lm.model, mesh))

    def place(tree):  # host arrays of a batch onto the device(s): rows split over "data"
        if mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return mesh_lib.place(tree, mesh, P("data"))

    for batch in _batches(order, batch_size):
        ids = [encoded[i] for i in batch]
        ids += [ids[0]] * (rows - len(ids))
        tokens, lengths = pad_prompts(ids, width=width)
        cache = _new_cache(lm, rows, cache_length, mesh)
        tokens_in, lengths_in = place((tokens, lengths))
        t0 = time.perf_counter()
        logits, cache = _prefill(graphdef, state, tokens_in, lengths_in, cache)
        logits.block_until_ready()
        timings["prefill_s"] += time.perf_counter() - t0
        active = place(np.arange(rows) < len(batch))
        parts = []
        for _ in range(chunks):
            t0 = time.perf_counter()
            cache, logits, active, records = _decode_chunk(
                graphdef, state, cache, logits, active, rules, options.chunk, options.top, eos
            )
            records = jax.device_get(records)
            timings["decode_s"] += time.perf_counter() - t0
            parts.append(records)
            done += options.chunk
            if progress is not None:
                progress(done, total)
            if options.stop_at_eos and not np.any(jax.device_get(active)):
                done += (chunks - len(parts)) * options.chunk
                break
        table = _batch_table(parts, batch, prompts, lengths[: len(batch)], rules, options)
        tables.append(table)
        if on_batch is not None:
            on_batch(table)
    if progress is not None:
        progress(total, total)
    table = pa.concat_tables(tables)
    table = _sorted(table) if part is not None else merge_parts([table])
    info = {
        "prompts_given": len(prompts),
        "prompts_used": len(keep),
        "prompts_skipped_short": len(prompts) - len(keep),
        "positions": table.num_rows,
        **{k: round(v, 3) for k, v in timings.items()},
    }
    if part is not None:
        info["part"] = {"index": part[0], "count": part[1], "prompts": len(order)}
    if mesh is not None:
        info["mesh"] = dict(mesh.shape)
    return table, info


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("prompt_order", "ascending"), ("position", "ascending")])


def merge_parts(tables: Sequence[pa.Table]) -> pa.Table:
    """Joins the tables of :func:`certify_prompts` runs with ``part=(i, n)``, ``i < n``.

    The result is the table of one run over all prompts: rows in prompt order, then position
    order, without the ``prompt_order`` column.
    """
    return _sorted(pa.concat_tables(tables)).drop_columns(["prompt_order"])


def _new_cache(lm, batch: int, length: int, mesh=None):
    """An empty cache; on a mesh its rows split over "data", its heads over "model"."""
    return models.KVCache.create(lm.config, batch, length, dtype=lm.model.dtype, mesh=mesh)


def _batch_table(parts, batch, prompts, lengths, rules, options) -> pa.Table:
    stats = [p[0] for p in parts]
    values = [p[1] for p in parts]
    active = np.concatenate([p[2] for p in parts], axis=0)  # [steps, B]

    def cat(get):
        return np.concatenate([get(s) for s in stats], axis=0)  # [steps, B]

    columns = {
        "token": cat(lambda s: s.greedy_token),
        "top1": cat(lambda s: s.top1),
        f"top{options.top}_coverage": cat(lambda s: s.top_coverage),
        "margin": cat(lambda s: s.margin),
        "entropy": cat(lambda s: s.entropy),
    }
    for r, rule in enumerate(rules):
        columns[rule_column(rule)] = np.concatenate([v[r] for v in values], axis=0)
    keep = active.copy() if options.stop_at_eos else np.ones_like(active)
    keep[options.steps :] = False
    keep[:, len(batch) :] = False  # rows that only pad the last batch
    pos, row = np.nonzero(keep)  # step-major
    out = {
        "prompt_order": np.asarray(batch)[row],
        # Explicit types: every batch has the same schema whatever its prompts hold.
        "prompt_id": pa.array([str(prompts[batch[b]].id) for b in row], pa.string()),
        "category": pa.array([_text(prompts[batch[b]].category) for b in row], pa.string()),
        "prompt_tokens": lengths[row],
        "position": pos.astype(np.int32),
    }
    for name, array in columns.items():
        out[name] = array[pos, row]
    return pa.table(out)
