"""What every layer of jaxcert may use: argument checks, cache paths, the asset registry,
prompt sets and the persistent compilation cache. Imports nothing else from jaxcert.

=================  ==========================================================================
``validate``       argument checks with messages in the user's words
``paths``          the cache folder (``$JAXCERT_CACHE``)
``assets``         pinned real models and prompt sets from the package registry, verified
``prompts``        prompt sets, chat templates, padding token prompts into batches
``compile_cache``  JAX's persistent compilation cache under the cache folder
=================  ==========================================================================
"""
