"""`python -m miles_core.config RECIPE [key=value ...]`: the resolved config as JSON, or the error (exit 2)."""

import sys

from miles_core.config.recipe import main

sys.exit(main(sys.argv[1:]))
