import sys

from edgemoe.cli import main

sys.exit(main())
