import sys

from samples.quality.cli import main

sys.exit(main())
