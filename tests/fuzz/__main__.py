import sys

from tests.fuzz.run import main

sys.exit(main())
