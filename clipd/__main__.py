import sys

from clipd.cli import main

sys.exit(main())
