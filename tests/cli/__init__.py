"""Tests of the command line, jaxcert.cli (decode, export, train-drafter options)."""
