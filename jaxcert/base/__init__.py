"""What every layer of jaxcert may use: argument checks, cache paths, the asset registry,
prompt sets, the persistent compilation cache and markdown tables. Imports nothing else
from jaxcert.

=================  ==========================================================================
``validate``       argument checks with messages in the user's words
``paths``          the cache folder (``$JAXCERT_CACHE``)
``assets``         pinned real models and prompt sets from the package registry, verified
``prompts``        prompt sets, chat templates, padding token prompts into batches
``compile_cache``  JAX's persistent compilation cache under the cache folder
``tables``         markdown tables of dict rows (every printed report)
``reads``          how many times a compiled program reads an input (XLA's cost analysis)
=================  ==========================================================================
"""
