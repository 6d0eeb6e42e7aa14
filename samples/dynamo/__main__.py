import sys

from samples.dynamo.launch import main

sys.exit(main())
