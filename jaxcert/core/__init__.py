"""The certificate math: rules, the exact solver, margin bounds and statistics.

The lowest layer of jaxcert above :mod:`jaxcert.base`: it imports nothing from the models,
the decoder, the pipeline or training. ``docs/certificates.md`` is its theory.

=================  ==========================================================================
``rules``          verification rules (strict greedy, relaxed, top-k, typical, tree) and their
                   accepted sets ``U``
``solver``         ``C_p = min KL(p‖q)`` over rejected drafters, with ``q*`` (full rows and top-K
                   windows)
``bounds``         margin-only bounds and certified run lengths
``stats``          per-position statistics (top-1, coverage, margin, entropy)
``reference``      the float64 NumPy reference solver the tests compare against
``numerics``       shared numerics (normaliser, entropy, a CPU-fast exact top-k)
``collectives``    the same over a vocabulary split across devices (``shard_map``)
=================  ==========================================================================
"""
