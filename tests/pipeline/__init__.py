"""Tests of jaxcert.pipeline (certify, certify-logits, records, mesh, multi-host)."""
