"""`python -m tests.factory OUT [...]` (from the repository root): the factory's CLI."""
import sys

from tests.factory.factory import main

sys.exit(main())
