"""Tests of jaxcert.decoding."""
