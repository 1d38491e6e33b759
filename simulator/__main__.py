"""Entry point for `python -m simulator`; see simulator/cli.py for the flags."""

from simulator.cli import main

raise SystemExit(main())
