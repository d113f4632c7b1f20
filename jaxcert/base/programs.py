"""Compiled decoder programs: an object that holds them, counts them and sets XLA options.

Example::

  programs = decoding.Programs(compiler_options={"xla_backend_optimization_level": 0})
  out = decoding.speculative_decode(target, drafter, prompts, policy=policy, config=config,
                                    programs=programs)
  programs.compiled   # programs compiled so far
  programs.clear()    # frees them (the next call compiles again)

Without ``programs=`` the decoders use :func:`default_programs`, one per process.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping

import jax

__all__ = ["Programs", "default_programs"]


class Programs:
    """A bounded cache of AOT-compiled decoder programs, least recently used evicted.

    Bounded because every CPU executable holds hundreds of memory maps (measured: about 580
    per decoder program of a tiny model) until it is freed, and a process dies at the
    system's map limit (65,530 by default).

    Args:
      max_programs: programs kept (default 48).
      compiler_options: XLA options for every program compiled here, e.g.
        ``{"xla_backend_optimization_level": 0}`` (trades run time for compile time; the
        tests do this). Part of each program's key: changing them compiles anew.

    Attributes:
      compiled: programs compiled by this object so far (evicted ones included).
      compiler_options: the options (a dict; may be changed between calls).

    A program's first execution is slower than the ones after it (on 2 CPU cores a
    1.5B-target round loop's first call of 8 rounds took 2.6 s more than the next ones):
    :meth:`first_execution` tells a caller that times its calls which ones to leave out.
    """

    def __init__(self, max_programs: int = 48, compiler_options: Mapping | None = None):
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise ValueError(f"max_programs must be a positive integer, got {max_programs!r}")
        self.max_programs = max_programs
        self.compiler_options = dict(compiler_options or {})
        self.compiled = 0
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._unrun: set[int] = set()  # ids of programs compiled here and not yet run

    def __len__(self) -> int:
        return len(self._programs)

    def of(self, fn) -> list:
        """The compiled programs of ``fn`` held now (``jax.stages.Compiled``), oldest first."""
        return [c for key, c in self._programs.items() if key[0] is fn]

    def clear(self) -> None:
        """Frees every compiled program (the next call compiles again)."""
        self._programs.clear()
        self._unrun.clear()

    def compile(
        self, fn, args: tuple, static: dict, on_compile: Callable[[str], None] | None = None
    ):
        """``fn`` (a ``jax.jit``) compiled for these static arguments and argument shapes.

        ``args`` are the dynamic arguments (arrays or ``ShapeDtypeStruct``), ``static`` the
        static ones by name; the result is called with the dynamic arguments only.
        ``on_compile`` is called with ``fn``'s name before a compilation.
        """
        leaves, treedef = jax.tree.flatten(args)
        # The shardings too: the same shapes on one device and on a mesh compile differently.
        avals = tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)
        options = tuple(sorted(self.compiler_options.items()))
        key = (fn, tuple(sorted(static.items())), str(treedef), avals, options)
        if key not in self._programs:
            if on_compile is not None:
                on_compile(fn.__name__)
            lowered = fn.lower(*args, **static)
            self._programs[key] = lowered.compile(compiler_options=dict(options) or None)
            self._unrun.add(id(self._programs[key]))
            self.compiled += 1
            while len(self._programs) > self.max_programs:
                self._unrun.discard(id(self._programs.popitem(last=False)[1]))
        self._programs.move_to_end(key)
        return self._programs[key]

    def first_execution(self, *programs) -> bool:
        """Whether any of ``programs`` (as :meth:`compile` returned them) is about to run
        for the first time; each counts as run from then on. A program this object did not
        compile counts as run."""
        fresh = [id(p) for p in programs if id(p) in self._unrun]
        self._unrun.difference_update(fresh)
        return bool(fresh)


@functools.cache
def default_programs() -> Programs:
    """The process's :class:`Programs`, used when a decoder call is given none."""
    return Programs()
