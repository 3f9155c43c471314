"""`python -m freetoken.cli ...`: the `ft` command."""
import sys

from freetoken.cli import main

sys.exit(main())
