"""`python -m zerolab ...`: the command line (see zerolab.cli)."""
from zerolab.cli import main

main()
