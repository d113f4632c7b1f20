"""``python -m jaxcert.cli``: the ``jaxcert`` command."""

import sys

from jaxcert.cli import main

sys.exit(main())
