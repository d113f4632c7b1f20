"""Batch certification: certify a model's greedy positions, or logits computed elsewhere.

Above :mod:`jaxcert.decoding`, below :mod:`jaxcert.training` and the CLI.

=================  ==========================================================================
``engine``         the certify run: continuous batching, chunked prefill, one table a prompt
``store``          streamed, resumable Parquet shards and the manifest
``report``         summaries, run lengths and plots of a run
``logits``         certificates of dense logit dumps and of top-K log-probability windows
``records``        serving engines' log-probability records, read into exact windows
``distributed``    multi-process runs: joining, parts sent to process 0, merging
=================  ==========================================================================
"""
