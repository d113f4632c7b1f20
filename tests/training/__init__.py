"""Tests of jaxcert.training."""
