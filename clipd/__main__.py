import sys

from clipd.cli import main

if __name__ == "__main__":  # not when a spawned child process imports it
    sys.exit(main())
