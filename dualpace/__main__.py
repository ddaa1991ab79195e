import sys

from dualpace.cli import main

sys.exit(main())
