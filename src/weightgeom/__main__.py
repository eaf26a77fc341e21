"""``python -m weightgeom`` (also what torchrun launches: ``torchrun ... -m weightgeom train CONFIG``)."""

import sys

from weightgeom.cli import main

sys.exit(main())
