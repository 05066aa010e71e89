import sys

from picompile.cli import main

sys.exit(main())
