"""`python -m mini_transformer.cli ...` (and `torchrun -m mini_transformer.cli ...`): the same as `mini-transformer`."""

import sys

from . import main

sys.exit(main())
