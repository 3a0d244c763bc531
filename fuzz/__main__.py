import sys

from kvguard.fuzz.cli import main

sys.exit(main())
