"""The sweep: what a user asks for, checked before anything runs. Models, eval and calibration
settings, backend blocks and their grids, job ids (``sweep``), text sources, artifact settings
and the YAML loader (``sweep_file``). Nothing here starts a process or loads weights."""
