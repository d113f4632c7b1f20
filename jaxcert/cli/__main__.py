"""``python -m jaxcert.cli``: the ``jaxcert`` command."""

import sys

from jaxcert.cli import main

if __name__ == "__main__":
    sys.exit(main())
