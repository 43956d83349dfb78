"""python -m specd.tools.distill evaluate ..."""

from specd.tools.distill.cli import main

raise SystemExit(main())
