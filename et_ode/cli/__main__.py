"""``python -m et_ode.cli ...`` (e.g. under ``torchrun``): the ``et-ode`` console script."""

from et_ode.cli import main

raise SystemExit(main())
