"""The sweep-file model: what a user asks for, checked before anything runs. Models, the eval
and calibration settings, backend blocks and their grids, job ids (``sweep``), the optional
blocks (``search``, ``tasks``, ``gates``, ``speed``: each capability's block lives here, with
the file it is written in), text sources and the YAML loader (``sweep_file``).

Nothing here starts a process or loads weights. It may import ``backends`` (to check each
config against its backend's options) and the shared words; every other layer imports it.
(Its name before this release was ``quantdask.spec``, kept as a deprecated alias.)"""
