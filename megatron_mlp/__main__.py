import sys

from megatron_mlp.cli import main

sys.exit(main())
