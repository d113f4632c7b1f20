"""Tests of jaxcert.models (the top-level folder models/)."""
