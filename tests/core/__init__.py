"""Tests of jaxcert.core (certificates, rules, bounds) and jaxcert.losses."""
