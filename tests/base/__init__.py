"""Tests of jaxcert.base."""
