import sys

from calexec.cli import main

sys.exit(main())
