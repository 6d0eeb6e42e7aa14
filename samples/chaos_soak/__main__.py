import sys

from samples.chaos_soak.soak import main

sys.exit(main())
