import sys

from edgellm.runtime.cli import main

sys.exit(main())
