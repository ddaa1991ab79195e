import sys

from dualpace_cli.main import main

sys.exit(main())
