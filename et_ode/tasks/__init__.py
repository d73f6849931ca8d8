"""The tasks built on the model, the field and ``solve``: image completion (:mod:`et_ode.tasks.image`, its
baselines :mod:`et_ode.tasks.baselines`, its evaluation :mod:`et_ode.tasks.evaluation`, films of a completion
:mod:`et_ode.tasks.film`, the demo :mod:`et_ode.tasks.demo`, the official checkpoint on photos
:mod:`et_ode.tasks.photos`) and the graph
tasks (:mod:`et_ode.tasks.graph`). Each is a set of plain Python functions; :mod:`et_ode.cli` parses options into
their calls."""
