"""`python -m rjax.cli ...`, the same as the `rjax` command."""
import sys

from rjax.cli.main import main

sys.exit(main())
