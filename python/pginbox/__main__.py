"""`python -m pginbox`: the same as the `pginbox` command."""

from pginbox.cli import main

main(prog_name="pginbox")
