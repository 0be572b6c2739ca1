import sys

from revenant.cli.main import main

sys.exit(main())
