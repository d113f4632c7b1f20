"""How many times a compiled program reads one of its inputs, from XLA's own cost analysis.

The certificate's floor on an accelerator is one read of the ``[..., V]`` logits, so its cost
is counted in reads: the ``bytes accessed`` of the compiled program (``compiled.cost_analysis()``)
divided by the input's size. Two things XLA's figure counts that a reader of the program would
not, and that :func:`input_reads` reports apart:

* a **fused gather** is charged its whole operand: a fusion that gathers the window's 64 groups
  of 64 tokens from ``[64, 151936]`` logits (2.7% of them) is charged 1.03 reads. ``gathered``
  charges each such gather of the input by what it gathers (its output) instead.
* a **conditional** is charged its dearest branch, run or not. Callers that want the common
  path alone compile it without its rare branches (``jaxcert.core.solver``'s ``fallback``).

Example::

  reads = input_reads(lambda x: jax.nn.logsumexp(x, -1),
                      jax.ShapeDtypeStruct((64, 151936), jnp.float32))
  reads.xla, reads.gathered   # 2.0, 2.0
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import jax

__all__ = ["Reads", "compiled_reads", "input_reads"]

_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\((.*)$")
# Element-wise views of a fusion's parameter: inside a loop fusion they are computed only
# for the elements a gather asks for (bfloat16 logits are converted before their gather).
_ALIASES = ("bitcast", "convert", "reshape", "copy")


class Reads(NamedTuple):
    """Reads of one input by a compiled program (bytes accessed / the input's bytes).

    Attributes:
      xla: XLA's figure: ``bytes accessed`` of the whole program over the input's size.
      gathered: the same with each fused gather of the input charged its output's bytes
        instead of the whole input (``xla`` minus the difference).
    """

    xla: float
    gathered: float


def _bytes(shape: str) -> int | None:
    """Bytes of an HLO array type such as ``f32[64,151936]{1,0}`` (``None`` for tuples)."""
    m = _SHAPE.match(shape)
    if m is None:
        return None
    kind, dims = m.groups()
    width = re.match(r"[a-z]+?(\d+)", kind)  # f32, bf16, s8, f8e4m3fn, c64; pred: a byte
    bits = int(width.group(1)) if width else 8
    return -(-math.prod(int(d) for d in dims.split(",") if d) * bits // 8)


def _computations(text: str) -> dict[str, list[str]]:
    """The HLO module's computations by name, each as its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{\s*$", line)
        if head:
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            out[name] = []
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def _gather_overcharge(text: str, input_bytes: int) -> int:
    """Bytes XLA charges the entry's fusions for gathers of an input-sized operand beyond
    what the gathers read: per such fusion parameter used only through bitcasts by gathers,
    the parameter's bytes minus the gathers' output bytes."""
    comps = _computations(text)
    extra = 0
    for line in comps.get("ENTRY", []):
        m = _INSTRUCTION.match(line)
        if m is None or m.group(3) != "fusion":
            continue
        called = re.search(r"calls=%(\S+?)[,\s]", line + " ")
        body = comps.get(called.group(1), []) if called else []
        parsed = [i for i in (_INSTRUCTION.match(b) for b in body) if i]
        for param in (i for i in parsed if i.group(3) == "parameter"):
            if _bytes(param.group(2)) != input_bytes:
                continue
            names = {param.group(1)}
            gathered, other = 0, False
            for i in parsed:  # instructions are in order: aliases come before their users
                operands = re.findall(r"%([\w.\-]+)", i.group(4).split("),")[0])
                if not names.intersection(operands):
                    continue
                if i.group(3) in _ALIASES:
                    names.add(i.group(1))
                elif i.group(3) == "gather" and operands[0] in names:
                    gathered += _bytes(i.group(2)) or input_bytes
                else:
                    other = True
            if gathered and not other:
                extra += input_bytes - gathered
    return extra


def compiled_reads(compiled, input_bytes: int) -> Reads:
    """Reads of an input of ``input_bytes`` bytes by an already compiled program
    (``jax.jit(fn).lower(...).compile()``).

    Raises:
      ValueError: the backend gives no cost analysis.
    """
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    if not analysis or "bytes accessed" not in analysis:
        raise ValueError(f"the {jax.default_backend()} backend reports no cost analysis")
    total = float(analysis["bytes accessed"])
    over = _gather_overcharge(compiled.as_text(), input_bytes)
    return Reads(total / input_bytes, (total - over) / input_bytes)


def input_reads(fn, *args, of: int = 0) -> Reads:
    """Compiles ``jax.jit(fn)`` for ``args`` and counts the reads of ``args[of]``.

    Args:
      fn: the function (traced with ``args``; static arguments bound beforehand).
      *args: arrays or ``jax.ShapeDtypeStruct``.
      of: the position of the input whose size is the unit.

    Returns:
      :class:`Reads` (floats, in units of the input's bytes).

    Raises:
      ValueError: ``of`` names no argument, that argument is no array or is empty, or the
        backend gives no cost analysis.
    """
    if isinstance(of, bool) or not isinstance(of, int) or not 0 <= of < len(args):
        raise ValueError(f"of={of!r} names no argument (there are {len(args)})")
    unit = args[of]
    if not hasattr(unit, "shape") or not hasattr(unit, "dtype"):
        raise ValueError(f"argument {of} is no array (a {type(unit).__name__}): reads are "
                         "counted in units of an array's bytes")  # fmt: skip
    size = math.prod(unit.shape) * jax.numpy.dtype(unit.dtype).itemsize
    if size == 0:
        raise ValueError(f"argument {of} is empty (shape {tuple(unit.shape)}): no unit of reads")
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled_reads(compiled, size)
