"""The test suite, a package mirroring jaxcert: tests.<subpackage>, and tests.helpers."""
