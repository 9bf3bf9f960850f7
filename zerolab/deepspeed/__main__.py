"""``python -m zerolab.deepspeed [launcher args] script.py [script args]``: see ``launch.py``."""
import sys

from zerolab.deepspeed.launch import main

sys.exit(main())
