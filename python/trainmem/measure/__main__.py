"""`python -m trainmem.measure ...` runs `trainmem-measure`."""

from .cli import main

raise SystemExit(main())
